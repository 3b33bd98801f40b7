"""Worker classes running the megatron engine inside flowactors groups on CPU (importable on worker processes), and
the same engine under a name the algorithms take: `model.engine=tests.engines.megatron_probes:megatron_cpu` (the
registry imports this module on the workers, whose factory applies the shim, then builds the real engine).

The classes apply the test-only CUDA shim (tests/engines/megatron_shim.py) in the worker process before building the
role, which is the only difference from the product's roles. `TorchCritic` is the torch-engine reference for a megatron
critic, with an endpoint to read its weights."""

from __future__ import annotations

import torch

from engines import registry
from engines.roles import ActorWorker, CriticWorker, RewardModelWorker
from flowactors import ONE_TO_ALL, endpoint

MEGATRON_CPU = "tests.engines.megatron_probes:megatron_cpu"


def _shim() -> None:
    import engines.training.megatron.engine  # noqa: F401 - its warning filters, before the shim imports megatron-core
    from tests.engines import megatron_shim

    megatron_shim.apply()


def _build_megatron_cpu(setup):
    _shim()
    return registry.training_engine("megatron").build(setup)


_megatron = registry.training_engine("megatron")
registry.register_training_engine(
    MEGATRON_CPU,
    _build_megatron_cpu,
    pipeline_parallel=True,
    resharding=_megatron.resharding,
    subgroups=_megatron.subgroups,
    fused_pipelines=_megatron.fused_pipelines,
)


class _Shimmed:
    """First in the MRO: redirects megatron-core's CUDA calls before the role builds, and reads the full weights."""

    def __init__(self, *args, **kwargs) -> None:
        _shim()
        super().__init__(*args, **kwargs)

    @endpoint(protocol=ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.full_state_dict()

    @endpoint(protocol=ONE_TO_ALL)
    def implements_training_engine(self) -> bool:
        """The built MegatronEngine has every member of the TrainingEngine interface (attributes included)."""
        from engines.interfaces import TrainingEngine

        return isinstance(self.engine, TrainingEngine)


class ShimmedActor(_Shimmed, ActorWorker):
    """ActorWorker on CPU with megatron-core's CUDA calls redirected (a test shim, named as such)."""


class ShimmedCritic(_Shimmed, CriticWorker):
    """CriticWorker on CPU with megatron-core's CUDA calls redirected."""


class ShimmedRewardModel(_Shimmed, RewardModelWorker):
    """RewardModelWorker on CPU with megatron-core's CUDA calls redirected."""


class TorchCritic(CriticWorker):
    """The torch-engine critic (no dropout before its head, like the megatron value head: engines.models.config)."""

    @endpoint(protocol=ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.full_state_dict()
