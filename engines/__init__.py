"""engines: multi-controller model workers (training, generation, the RLHF roles) over flowactors groups.

Knows nothing about a particular RLHF algorithm: losses come in with update calls.

The names below load on first use (PEP 562), so importing a light submodule (e.g. `engines.hybrid`, which needs
only torch) does not pay for transformers in every spawned rank.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HFGenerationEngine": "engines.rollout.hf",
    "SamplingConfig": "engines.rollout.stream",
    "ModelConfig": "engines.models.config",
    "build_model": "engines.models.config",
    "build_tokenizer": "engines.models.config",
    "check_model_dir": "engines.models.config",
    "save_pretrained": "engines.models.config",
    "MINIBATCH": "engines.protocols",
    "plan_minibatches": "engines.protocols",
    "ActorWorker": "engines.roles",
    "CriticWorker": "engines.roles",
    "RefWorker": "engines.roles",
    "TeacherWorker": "engines.roles",
    "RewardModelWorker": "engines.roles",
    "JudgeRewardWorker": "engines.judge",
    "RuleRewardWorker": "engines.roles",
    "GenerationEngine": "engines.interfaces",
    "TrainingEngine": "engines.interfaces",
    "register_generation_engine": "engines.registry",
    "register_training_engine": "engines.registry",
    "GenerationSpec": "engines.specs",
    "UpdateSpec": "engines.specs",
    "char_tokenizer": "engines.models.tokenizer",
    "AgentConfig": "engines.rollout.agent",
    "LossFn": "engines.training.common",
    "OptimConfig": "engines.training.common",
    "TrainEngine": "engines.training.torch_native",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
