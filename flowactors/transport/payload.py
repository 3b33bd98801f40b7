"""What a value weighs on the wire, and the rank's end of pushed results (`flowactors.transport.pushed`).

Worker-side code (the call runtime, the direct path's server) imports this module, never the controller's
transports: it needs only the size rule and how to send a small output to the controller's inbox.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PUSH_BYTES", "TOO_LARGE", "payload_bytes", "push"]

PUSH_BYTES = 64 * 1024
"""Outputs up to this size (`payload_bytes`) are pushed; larger ones are fetched through Dask."""

TOO_LARGE = "flowactors.push: too large"
"""What a rank pushes instead of an output over `PUSH_BYTES` (the controller then reads it through Dask)."""


_SCALARS = (bool, float)


def payload_bytes(value: Any) -> int:
    """Bytes `value` would put on the wire: Batch and tensor data counted (Dask's `sizeof` counts neither, and is
    left so: it drives the workers' memory accounting), containers summed, anything else by `sizeof`."""
    if value is None or type(value) in _SCALARS or (type(value) is int and value.bit_length() <= 64):
        return 16  # a reply's most common values, answered without the imports below
    import torch
    from dask.sizeof import sizeof

    from flowactors.batch import Batch

    if isinstance(value, Batch):
        return value.nbytes
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(payload_bytes(v) for v in value)
    return sizeof(value)


def push(address: str, key: str, value: Any) -> None:
    """Worker side: send `value` (or a too-large marker) to the inbox at `address`, without waiting. A failed push
    costs nothing but the fast path: the controller then reads the value through Dask."""
    try:
        from distributed import get_worker
        from distributed.protocol import to_serialize

        worker = get_worker()
        payload = value if payload_bytes(value) <= PUSH_BYTES else TOO_LARGE

        async def send() -> None:
            try:
                await worker.rpc(address).flowactors_push(key=key, value=to_serialize(payload))
            except Exception:
                pass

        worker.loop.add_callback(send)
    except Exception:
        pass
