"""Batch wire format: a msgpack header plus one raw buffer per tensor, registered with Dask.

Dask moves task results between workers with its `dask_serialize` family when one is registered for the type; a
`Batch` is then sent as `[msgpack header, tensor bytes, ...]` frames and rebuilt with `torch.frombuffer` over the
received frames, so tensors are neither pickled nor copied on arrival. The same frames back `Batch.__reduce_ex__`
(as out-of-band pickle-5 buffers), so a batch nested inside a pickled container still travels as raw buffers.

Tensors on an accelerator are moved to host memory to be sent: the receiver decides where they go next.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import msgpack
import torch
from dask.sizeof import sizeof
from distributed.protocol import dask_deserialize, dask_serialize

from flowactors.batch import Batch

__all__ = ["batch_to_frames", "batch_from_frames"]

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def _packable(value: Any, where: str) -> Any:
    try:
        msgpack.packb(value, use_bin_type=True)
    except TypeError as e:
        raise TypeError(
            f"{where} holds a value msgpack cannot encode ({e}); keep per-row and meta values to "
            f"str/int/float/bool/None/bytes and lists/dicts of them, and put arrays in tensors"
        ) from e
    return value


def batch_to_frames(batch: Batch) -> tuple[dict, list[memoryview | bytes]]:
    """(header, frames): frames[0] is the msgpack description, frames[1:] the tensor bytes, uncopied."""
    specs, buffers = [], []
    for name, t in batch.tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which the batch wire format does not carry")
        t = t.detach().to("cpu").contiguous()
        specs.append([name, dtype, list(t.shape)])
        buffers.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    desc = {"tensors": specs, "rows": _packable(batch.rows, "rows"), "meta": _packable(batch.meta, "meta")}
    return {"format": "flowactors.batch/1"}, [msgpack.packb(desc, use_bin_type=True), *buffers]


class _Received:
    """Bytes of batch tensors deserialized in this process (lets tests prove data skipped the controller)."""

    bytes = 0

    def reset(self) -> None:
        self.bytes = 0


RECEIVED = _Received()


def batch_from_frames(header: dict, frames: list) -> Batch:
    RECEIVED.bytes += sum(len(memoryview(f).cast("B")) for f in frames[1:])
    desc = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    tensors = {}
    for (name, dtype, shape), buf in zip(desc["tensors"], frames[1:]):
        dt = _DTYPES[dtype]
        if len(buf) == 0:
            tensors[name] = torch.empty(shape, dtype=dt)
            continue
        mv = memoryview(buf)
        if mv.readonly:  # torch.frombuffer needs writable memory; received frames normally are
            mv = memoryview(bytearray(mv))
        tensors[name] = torch.frombuffer(mv, dtype=torch.uint8).view(dt).reshape(shape)
    return Batch(tensors, desc["rows"], desc["meta"])


@dask_serialize.register(Batch)
def _dask_serialize(batch: Batch) -> tuple[dict, list]:
    return batch_to_frames(batch)


@dask_deserialize.register(Batch)
def _dask_deserialize(header: dict, frames: list) -> Batch:
    return batch_from_frames(header, frames)


@sizeof.register(torch.Tensor)
def _sizeof_tensor(tensor: torch.Tensor) -> int:
    """What Dask counts a tensor as in its memory accounting (the host memory it manages, and may spill), transfer
    logs and dashboard: its bytes in host memory (Dask has no rule for torch and would count the Python object, 80
    bytes; a device's memory is not the host's)."""
    held = tensor.numel() * tensor.element_size() if tensor.device.type == "cpu" else 0
    return sys.getsizeof(tensor) + held


@sizeof.register(Batch)
def _sizeof(batch: Batch) -> int:
    """A Batch as Dask counts it: its tensors (`_sizeof_tensor`) and its rows' and meta's objects."""
    return sum(map(_sizeof_tensor, batch.tensors.values())) + sizeof(batch.meta) + sizeof(batch.rows)


def _from_pickle(header: dict, *frames: Any) -> Batch:
    return batch_from_frames(header, list(frames))


def _reduce_ex(self: Batch, protocol: int) -> tuple:
    header, frames = batch_to_frames(self)
    if protocol >= 5:
        frames = [frames[0], *(pickle.PickleBuffer(f) for f in frames[1:])]
    else:
        frames = [bytes(f) for f in frames]
    return _from_pickle, (header, *frames)


Batch.__reduce_ex__ = _reduce_ex  # type: ignore[method-assign]
