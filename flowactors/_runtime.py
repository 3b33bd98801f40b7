"""The worker-process side: the registry of live instances and the functions that pinned tasks run.

Every function here runs inside a Dask worker process, in its single task thread, as a normal task pinned to
that worker (docs/design.md §3: not a Dask Actor call, so futures in the arguments are resolved by the scheduler, the
task stream shows the call, and per-process ordering can be enforced by the controller). The `_after` argument
is the previous call issued to this process; taking it as an input is what orders the calls.

One torch.distributed "world" spans all slots the controller uses; each group is a `new_group` of it plus a
DeviceMesh (pp, dp, tp). Creating them must happen in the same order on every world rank, which the per-process
ordering guarantees. What the world listens on is chosen here too: only the address the workers use (see
`init_world`), never every interface, and nothing once `teardown_world` ran.

Inputs that are earlier calls' outputs arrive as reference tuples whose futures Dask has resolved (see
`_resolve_one`): a whole call's outputs (joined here with its protocol), one part of it (rank r's share, sent
straight from the rank that produced it), or a whole value this rank splits to take its share. A rank whose
part failed cannot run, and its peers must not run without it (they would wait in the method's first collective
until the process group's timeout): so a call that takes parts first agrees, in one small all-reduce over the
group, whether every rank has its inputs (`_agree`), before any rank runs the method.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import structlog

from flowactors.batch import Batch
from flowactors.log import info_enabled
from flowactors.protocols import Layout, Protocol

_log = structlog.get_logger("flowactors.worker")


@dataclass
class GroupContext:
    name: str
    rank: int
    layout: Layout
    process_group: Any
    mesh: Any
    subgroups: dict = field(default_factory=dict)
    instance: Any = None


@dataclass
class RankFailure:
    """What a rank returns instead of raising, so one failed call does not poison the next call's dependency.

    `peer` marks a rank that did not run because another rank of the same call could not take its inputs."""

    group: str
    method: str
    rank: int
    exc_type: str
    message: str
    traceback: str
    peer: bool = False


CALL_REF = "__flowactors_call__"
"""First item of the tuple that stands for a whole CallFuture in task arguments (see CallFuture._ref):
(CALL_REF, group, method, protocol, layout, outputs of every rank)."""
PART_REF = "__flowactors_part__"
"""(PART_REF, group, method, ranks, outputs): one part of a call's output (Protocol.parts): outputs[0] holds the
data, the others (dropped on their workers) only say whether their ranks succeeded; ranks are the producing ranks."""
SPLIT_REF = "__flowactors_split__"
"""(SPLIT_REF, parts, index, value): take part `index` of `value` split into `parts` when it is a Batch."""
_REFS = (CALL_REF, PART_REF, SPLIT_REF)

_GROUPS: dict[str, GroupContext] = {}
_WORLD: dict[str, Any] = {}


def context_of(name: str) -> GroupContext | None:
    """This process's rank of group `name` (None when it has none here)."""
    return _GROUPS.get(name)


@dataclass
class LinkContext:
    """This process's place in a link: a process group over the ranks of several groups (Controller.link)."""

    name: str
    rank: int
    """This process's rank in the link (the groups' ranks in the order the groups were given)."""
    groups: dict[str, list[int]]
    """Each linked group's ranks, as link ranks."""
    process_group: Any
    subgroups: dict = field(default_factory=dict)
    """The extra process groups asked for (tuples of link ranks) that this process is a member of."""


_LINKS: dict[str, LinkContext] = {}
_RESERVED: dict[int, socket.socket] = {}  # port -> socket bound for rank 0's store, from free_port to init_world


def free_port(_after: Any = None) -> tuple[str, int, bool]:
    """Reserve a port for the world's rendezvous store on this worker's own address, and say whether it has CUDA.

    The socket stays bound (not listening) until `init_world` hands it to the store on this same process, so no
    other process can take the port in between."""
    host = _worker_host()
    for old in _RESERVED.values():
        old.close()
    _RESERVED.clear()
    sock = _bound(host, 0)
    port = sock.getsockname()[1]
    _RESERVED[port] = sock
    return host, port, torch_cuda_available()


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def init_world(
    rank: int, world_size: int, host: str, port: int, backend: str, timeout_s: float, device: int, _after: Any = None
) -> str:
    """Join the world whose rendezvous store rank 0 serves at host:port (reserved there by `free_port`).

    What listens, and where: torch's own `tcp://` rendezvous would start the store on every interface
    (`::`, unauthenticated) whatever host it is given, so rank 0 builds the store itself on the socket
    `free_port` bound to its worker's address (TCPStore's `master_listen_fd`). Gloo (and NCCL's bootstrap on a
    loopback world) listen on the interface named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, else on whatever
    the host name resolves to; they are set here, for the life of the world, to this worker's interface
    (`_pin_interfaces`). Values the user set are kept."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        if _WORLD.get("key") == (world_size, host, port):
            return "already"
        teardown_world()
    if backend == "nccl":
        torch.cuda.set_device(device % torch.cuda.device_count())  # 0 in a process pinned to one device
    timeout = timedelta(seconds=timeout_s)
    _unpin_interfaces()  # left by a formation that failed
    _WORLD["env"] = _pin_interfaces(_worker_host(), nccl=backend == "nccl")
    if rank == 0:
        sock = _RESERVED.pop(port, None) or _bound(host, port)  # rebound if this worker restarted meanwhile
        fd = sock.detach()  # the store owns the socket from here on and closes it with itself
        store = dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd, use_libuv=True)
    else:
        store = dist.TCPStore(host, port, world_size, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _WORLD.update(key=(world_size, host, port), rank=rank, backend=backend, store=store, timeout=timeout)
    return backend


def solo_world(
    name: str, layout: Layout, backend: str | None, timeout_s: float, subgroups: list = (), _after: Any = None
) -> str:
    """A one-rank world of this process's own, with `name`'s group in it, in one call: nothing to rendezvous with,
    so an in-process store and no listener (an elastic pool's one-rank groups: a worker that joins builds faster).

    Idempotent, as `init_world` is: Dask runs a task again when the scheduler forgot its result while a client
    still holds its future (a client that reconnects), and a second run must not tear down the group built since."""
    import torch
    import torch.distributed as dist

    key = (1, "solo", name)
    if dist.is_initialized():
        if _WORLD.get("key") == key and name in _GROUPS:
            return _WORLD["backend"]
        teardown_world()
    want = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if want == "nccl":
        torch.cuda.set_device(0)
    timeout = timedelta(seconds=timeout_s)
    store = dist.HashStore()
    dist.init_process_group(want, store=store, rank=0, world_size=1, timeout=timeout)
    _WORLD.update(key=key, rank=0, backend=want, store=store, timeout=timeout)
    new_group(name, [0], layout, list(subgroups))
    return want


def teardown_world(_after: Any = None) -> None:
    """Destroy the world: its process groups (gloo's listeners with them) and, on rank 0, the rendezvous store,
    which closes when the last reference to it goes; the interface settings of `init_world` are undone."""
    import torch.distributed as dist

    for name in list(_GROUPS):
        destroy(name)
    if dist.is_initialized():
        dist.destroy_process_group()
    _unpin_interfaces()
    _WORLD.clear()
    for sock in _RESERVED.values():
        sock.close()
    _RESERVED.clear()


def _bound(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, port))
    return sock


def _worker_host() -> str:
    """The host part of this Dask worker's address (brackets of an IPv6 literal removed)."""
    from distributed import get_worker

    return get_worker().address.split("://")[-1].rsplit(":", 1)[0].strip("[]")


_IFNAME_VARS = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def _pin_interfaces(host: str, nccl: bool) -> dict[str, str]:
    """Make gloo listen on the interface that holds `host` (the address this worker is reached at), and NCCL's
    bootstrap too when that is the loopback interface (one machine; on several, NCCL's own choice of interface
    stays). Returns the variables set, for `teardown_world` to remove; a variable the user set is left alone."""
    ip = _ip_of(host)
    name = interface_of(host)
    if ip is None or name is None:
        return {}
    wanted = [_IFNAME_VARS["gloo"]] + ([_IFNAME_VARS["nccl"]] if nccl and ip.is_loopback else [])
    pinned = {}
    for var in wanted:
        if var not in os.environ:
            os.environ[var] = pinned[var] = name
    return pinned


def _unpin_interfaces() -> None:
    for var in _WORLD.pop("env", {}):
        os.environ.pop(var, None)


def _ip_of(host: str) -> Any:
    """`host` as an ipaddress object (a name resolved), or None where it does not resolve."""
    import ipaddress

    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds address `host` (any loopback interface for a loopback
    address), or None where it cannot be told (a name that does not resolve, a platform without the ioctl)."""
    ip = _ip_of(host)
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names if ip is not None else ():
        addresses = _interface_addresses(name)
        if ip in addresses or (ip.is_loopback and any(a.is_loopback for a in addresses)):
            return name
    return None


def _interface_addresses(name: str) -> list:
    """IPv4 (SIOCGIFADDR) and IPv6 (/proc/net/if_inet6) addresses of interface `name`; Linux only, else []."""
    import fcntl
    import ipaddress
    import struct

    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            req = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            out.append(ipaddress.ip_address(req[20:24]))
        except OSError:
            pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5] == name:
                    out.append(ipaddress.ip_address(bytes.fromhex(parts[0])))
    except OSError:
        pass
    return out


def new_group(
    name: str, global_ranks: list[int], layout: Layout, subgroups: list[tuple[int, ...]] = (), _after: Any = None
) -> bool:
    """Create the group's process group, mesh and subgroups (tuples of group ranks); every world rank runs this,
    members keep the result."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if name in _GROUPS:
        raise RuntimeError(f"group {name!r} already exists in this worker process; close it first")
    timeout = _WORLD.get("timeout")  # the world's: torch gives a new group 30 minutes otherwise
    pg = dist.new_group(global_ranks, timeout=timeout)
    device_type = "cuda" if _WORLD.get("backend") == "nccl" else "cpu"
    mesh = DeviceMesh(
        device_type,
        torch.tensor(global_ranks).reshape(layout.pp, layout.dp, layout.tp),
        mesh_dim_names=("pp", "dp", "tp"),
    )
    me = dist.get_rank()
    mine = {}
    for sub in subgroups:
        group = dist.new_group([global_ranks[r] for r in sub], timeout=timeout)
        if me in global_ranks and global_ranks.index(me) in sub:
            mine[tuple(sub)] = group
    if me in global_ranks:
        _GROUPS[name] = GroupContext(name, global_ranks.index(me), layout, pg, mesh, mine)
        return True
    return False


def new_link(
    name: str,
    global_ranks: list[int],
    groups: dict[str, list[int]],
    subgroups: list[tuple[int, ...]] = (),
    _after: Any = None,
) -> bool:
    """Create a link's process group and subgroups (tuples of link ranks); every world rank runs this, members
    keep the result."""
    import torch.distributed as dist

    if name in _LINKS:
        raise RuntimeError(f"link {name!r} already exists in this worker process")
    timeout = _WORLD.get("timeout")
    pg = dist.new_group(global_ranks, timeout=timeout)
    me = dist.get_rank()
    mine = {}
    for sub in subgroups:
        group = dist.new_group([global_ranks[r] for r in sub], timeout=timeout)
        if me in global_ranks and global_ranks.index(me) in sub:
            mine[tuple(sub)] = group
    if me in global_ranks:
        _LINKS[name] = LinkContext(name, global_ranks.index(me), groups, pg, mine)
        return True
    return False


def link(name: str) -> LinkContext:
    """This process's context of link `name` (LookupError when it is not a member)."""
    ctx = _LINKS.get(name)
    if ctx is None:
        raise LookupError(f"this worker process is not a member of link {name!r} (Controller.link forms links)")
    return ctx


def construct(name: str, cls: type, args: tuple, kwargs: dict, _after: Any = None) -> RankFailure | None:
    import torch

    ctx = _GROUPS[name]
    try:
        inst = cls.__new__(cls)
        inst.rank, inst.world_size, inst.layout = ctx.rank, ctx.layout.world_size, ctx.layout
        inst.group_name, inst.process_group, inst.mesh = name, ctx.process_group, ctx.mesh
        inst.subgroups = ctx.subgroups
        inst.device = (
            torch.device("cuda", torch.cuda.current_device()) if ctx.mesh.device_type == "cuda" else torch.device("cpu")
        )
        inst.__init__(*args, **kwargs)
        ctx.instance = inst
        return None
    except BaseException as e:
        return RankFailure(name, "__init__", ctx.rank, type(e).__name__, str(e), traceback.format_exc())


def destroy(name: str, _after: Any = None) -> None:
    """Drop this process's instance of group `name`, after its `shutdown()` (a failure there is logged)."""
    ctx = _GROUPS.pop(name, None)
    if ctx is not None:
        instance, ctx.instance = ctx.instance, None
        if instance is not None:
            try:
                instance.shutdown()
            except Exception as e:
                _log.warning("shutdown_failed", group=name, error=f"{type(e).__name__}: {e}")


def call(
    name: str,
    method: str,
    rank: int,
    args: tuple,
    kwargs: dict,
    split: tuple[Protocol, Layout] | None,
    step: int | None,
    agree: bool = False,
    keep: bool = True,
    push: tuple[str, str] | None = None,
    _after: Any = None,
) -> Any:
    result = _call(name, method, rank, args, kwargs, split, step, agree, keep)
    if push is not None:  # (the controller's inbox, this task's key): flowactors.transport.pushed
        from flowactors.transport.payload import push as send

        send(push[0], push[1], result)
    return result


def call_rank(
    rank: int,
    keep: bool,
    name: str,
    method: str,
    inputs: tuple,
    split: tuple[Protocol, Layout] | None,
    step: int | None,
    agree: bool = False,
    push: tuple[str, str] | None = None,
    _after: Any = None,
) -> Any:
    """`call` as a fan-out runs it (`flowactors.transport.fanout`): the rank's own fields first, then the inputs
    every rank shares ((args, kwargs), already resolved to this rank's part)."""
    return call(name, method, rank, inputs[0], inputs[1], split, step, agree, keep, push)


def _call(
    name: str,
    method: str,
    rank: int,
    args: tuple,
    kwargs: dict,
    split: tuple[Protocol, Layout] | None,
    step: int | None,
    agree: bool,
    keep: bool,
) -> Any:
    """Run `method` on this rank's instance.

    With `split`, the inputs are the whole call's and are split here with the protocol. With `agree`, every rank
    of the group first says whether it has its inputs (`_agree`), and none runs unless all do. Without `keep`
    this rank's output is not part of the call's value (Protocol.parts): it returns None, or its failure."""
    t0 = time.perf_counter()
    ctx = _GROUPS.get(name)
    failure = None
    try:
        if ctx is None or ctx.instance is None:
            raise RuntimeError(
                f"no instance of group {name!r} lives in this worker process (pid {os.getpid()}); "
                f"it was closed or this worker was restarted"
            )
        args, kwargs = _resolve(args), {k: _resolve_one(v) for k, v in kwargs.items()}
        if split is not None:
            protocol, layout = split
            args, kwargs = protocol.split(args, kwargs, layout)[rank]
    except BaseException as e:
        failure = RankFailure(name, method, rank, type(e).__name__, str(e), traceback.format_exc())
    if agree and ctx is not None:
        failure = _agree(ctx, method, failure)
    try:
        if failure is not None:
            raise _Failed
        out = getattr(ctx.instance, method)(*args, **kwargs)
        if info_enabled():
            _log.info(
                "call", role=name, method=method, rank=rank, step=step, duration_s=round(time.perf_counter() - t0, 6)
            )
        return out if keep else None
    except BaseException as e:
        if failure is None:
            failure = RankFailure(name, method, rank, type(e).__name__, str(e), traceback.format_exc())
        _log.warning(
            "call failed",
            role=name,
            method=method,
            rank=rank,
            step=step,
            error=failure.message if failure.peer else f"{failure.exc_type}: {failure.message}",
        )
        return failure


class _Failed(Exception):
    """Internal: this rank did not run the method (its failure is already recorded)."""


def _agree(ctx: GroupContext, method: str, failure: RankFailure | None) -> RankFailure | None:
    """All-reduce over the group which ranks could not take their inputs; a rank whose own inputs are fine but
    a peer's are not gets a `peer` failure naming them. Every rank calls this at the same point of the same call
    (the calls to a process run in issue order), so it cannot cross another collective."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if ctx.mesh.device_type == "cuda" else "cpu"
    flags = torch.zeros(ctx.layout.world_size, dtype=torch.int32, device=device)
    flags[ctx.rank] = int(failure is not None)
    try:
        dist.all_reduce(flags, group=ctx.process_group)
    except BaseException as e:
        return failure or RankFailure(
            ctx.name,
            method,
            ctx.rank,
            type(e).__name__,
            f"ranks could not agree that every input arrived: {e}",
            traceback.format_exc(),
        )
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if failure is None and failed:
        return RankFailure(
            ctx.name,
            method,
            ctx.rank,
            "InputError",
            f"did not run because rank(s) {failed} of this call could not take their inputs",
            "",
            peer=True,
        )
    return failure


def _is_ref(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) >= 4 and isinstance(v[0], str) and v[0] in _REFS


def _resolve_one(v: Any) -> Any:
    """The value a reference tuple stands for (raising the failure of a rank it depends on); see `CALL_REF`."""
    if _is_ref(v):
        if v[0] == CALL_REF:
            _, group, method, protocol, layout, outputs = v
            return collect(group, method, protocol, layout, *outputs)
        if v[0] == PART_REF:
            _, group, method, ranks, outputs = v
            _raise_failures(group, method, outputs)
            return outputs[0]
        _, parts, index, value = v
        value = _resolve_one(value)
        if not isinstance(value, Batch):
            return value
        try:
            return value.split(parts)[index]
        except ValueError as e:
            raise ValueError(f"{e} (the group has data-parallel size {parts})") from None
    if isinstance(v, (list, tuple)) and any(_is_ref(x) for x in v):
        return type(v)(_resolve_one(x) for x in v)
    return v


def _resolve(args: tuple) -> tuple:
    return tuple(_resolve_one(a) for a in args)


def apply(fn: Any, args: tuple, kwargs: dict) -> Any:
    """A pure function over call results, run where Dask put the data."""
    return fn(*_resolve(args), **{k: _resolve_one(v) for k, v in kwargs.items()})


def collect(group: str, method: str, protocol: Protocol, layout: Layout, *outputs: Any) -> Any:
    """Join the ranks' outputs with the protocol, or raise the first rank's failure."""
    _raise_failures(group, method, outputs)
    return protocol.collect(list(outputs), layout)


def _raise_failures(group: str, method: str, outputs: Any) -> None:
    """Raise a RemoteError for the first failed rank among `outputs`; a rank that failed in its own right is
    named before one that did not run because of it (`RankFailure.peer`)."""
    failures = [o for o in outputs if isinstance(o, RankFailure)]
    if failures:
        from flowactors.errors import RemoteError  # (here, not per call: an import statement costs ~2 us)

        own = [f for f in failures if not f.peer] or failures
        f = own[0]
        raise RemoteError(group, method, f.rank, f.exc_type, f.message, f.traceback, failed_ranks=[x.rank for x in own])


SINGLE = Protocol(
    "single",
    lambda args, kwargs, layout: [(args, kwargs)],
    lambda outputs, layout: outputs[0],
    parts=lambda layout: [[0]],
)
"""The protocol of a one-task result (Controller.apply)."""
