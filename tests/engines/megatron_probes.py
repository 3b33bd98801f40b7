"""Worker classes running the megatron engine inside flowactors groups on CPU (importable on worker processes).

They apply the test-only CUDA shim (tests/engines/megatron_shim.py) in the worker process before building the role,
which is the only difference from the product's ActorWorker."""

from __future__ import annotations

import torch

from engines.roles import ActorWorker
from flowactors import ONE_TO_ALL, endpoint


class ShimmedActor(ActorWorker):
    """ActorWorker on CPU with megatron-core's CUDA calls redirected (a test shim, named as such)."""

    def __init__(self, *args, **kwargs) -> None:
        from tests.engines import megatron_shim

        megatron_shim.apply()
        super().__init__(*args, **kwargs)

    @endpoint(protocol=ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.full_state_dict()
