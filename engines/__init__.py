"""engines: multi-controller model workers (training, generation, the RLHF roles) over flowactors groups.

Knows nothing about a particular RLHF algorithm: losses come in with update calls.
"""

from engines.generation import HFGenerationEngine, SamplingConfig
from engines.models import ModelConfig, build_model, build_tokenizer, check_model_dir, save_pretrained
from engines.protocols import MINIBATCH, plan_minibatches
from engines.roles import ActorWorker, CriticWorker, RefWorker, RewardModelWorker, RuleRewardWorker
from engines.tokenizer import char_tokenizer
from engines.training import LossFn, OptimConfig, TrainEngine

__all__ = [
    "ModelConfig", "OptimConfig", "SamplingConfig", "build_model", "build_tokenizer", "check_model_dir",
    "save_pretrained", "char_tokenizer", "TrainEngine", "HFGenerationEngine", "LossFn", "MINIBATCH",
    "plan_minibatches", "ActorWorker", "RefWorker", "CriticWorker", "RewardModelWorker", "RuleRewardWorker",
]
