"""Resource pools: named, ordered sets of device slots (HybridFlow §4.1 "ResourcePool").

A slot is one device of the cluster, held by one worker process (`Slot(address, host, device)`). A pool orders its
slots by host, then device, so consecutive slots share a node and a pool cut into consecutive runs keeps tensor
parallel groups on NVLink. Models mapped to the same pool are colocated: their actors live in the same worker
processes and take turns. Models on different pools run concurrently.

`pools_for_plan` turns a `Plan`'s colocated sets into pools on a cluster's slots. It hands out the largest pools
first: pools are whole nodes or powers of two below a node (the sizes `search` proposes), so each pool then starts
on a boundary of its own size and never straddles a node it does not need.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from placement.plan import Plan, PlanError


@dataclass(frozen=True)
class Slot:
    """One device: the worker process that holds it, its host, and its device index on that host."""

    address: str
    host: str
    device: int

    def __post_init__(self) -> None:
        if not self.address or not self.host:
            raise ValueError(f"Slot needs an address and a host, got {self!r}")
        if self.device < 0:
            raise ValueError(f"Slot.device must be >= 0, got {self.device} for {self.address}")


def slots_from_addresses(addresses: Iterable[str]) -> tuple[Slot, ...]:
    """Slots for worker addresses (one device per worker process), e.g. a controller's slot list: the host is the
    address's host name, the device the worker's position among its host's workers in the order given."""
    seen: Counter[str] = Counter()
    slots = []
    for address in addresses:
        host = urlsplit(address).hostname or address
        slots.append(Slot(address, host, seen[host]))
        seen[host] += 1
    return tuple(slots)


def _order(slot: Slot) -> tuple[str, int, str]:
    return (slot.host, slot.device, slot.address)


@dataclass(frozen=True)
class ResourcePool:
    """A named set of slots, ordered by host then device."""

    name: str
    slots: tuple[Slot, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ResourcePool.name must be non-empty")
        slots = tuple(sorted(self.slots, key=_order))
        for what, keys in (("address", [s.address for s in slots]), ("device", [(s.host, s.device) for s in slots])):
            repeated = [k for k, n in Counter(keys).items() if n > 1]
            if repeated:
                raise ValueError(f"pool {self.name!r} lists {what} {repeated[0]} twice; each device joins a pool once")
        object.__setattr__(self, "slots", slots)

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self.slots)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(s.address for s in self.slots)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Distinct hosts, in pool order."""
        return tuple(dict.fromkeys(s.host for s in self.slots))

    def split(self, sizes: Mapping[str, int]) -> dict[str, ResourcePool]:
        """Consecutive runs of slots, one new pool per (name, size), in the order given; slots left over stay
        unused."""
        if any(n < 1 for n in sizes.values()):
            raise ValueError(f"pool sizes must be >= 1, got {dict(sizes)}")
        if sum(sizes.values()) > len(self):
            raise ValueError(
                f"pool {self.name!r} has {len(self)} slots but the split asks for "
                f"{sum(sizes.values())} ({dict(sizes)}); add workers or shrink the pools"
            )
        out, start = {}, 0
        for name, n in sizes.items():
            out[name] = ResourcePool(name, self.slots[start : start + n])
            start += n
        return out

    @classmethod
    def merge(cls, name: str, pools: Iterable[ResourcePool]) -> ResourcePool:
        """One pool holding every slot of `pools`; they must not share a slot."""
        return cls(name, tuple(s for p in pools for s in p.slots))


def pools_for_plan(plan: Plan, cluster: ResourcePool | Iterable[Slot] | Iterable[str]) -> dict[str, ResourcePool]:
    """One pool per colocated set of `plan`, keyed by `plan.pool_of(role)` names, cut from the cluster's slots
    (a pool, slots, or worker addresses)."""
    if not isinstance(cluster, ResourcePool):
        slots = list(cluster)
        if all(isinstance(s, str) for s in slots):
            slots = list(slots_from_addresses(slots))
        cluster = ResourcePool("cluster", tuple(slots))
    sizes = plan.pools()
    if sum(sizes.values()) > len(cluster):
        raise PlanError(
            f"the plan needs {sum(sizes.values())} device slots but the cluster has {len(cluster)}: "
            f"start more workers or shrink the pools {sizes}"
        )
    # largest first (whole nodes to the big pools); asynchronous RL's replicas last, so that a link from the
    # trainer to them (flowactors.Controller.link) runs over ascending world ranks
    largest_first = dict(sorted(sizes.items(), key=lambda kv: (kv[0] == "rollout", -kv[1])))
    pools = cluster.split(largest_first)
    return {name: pools[name] for name in sizes}
