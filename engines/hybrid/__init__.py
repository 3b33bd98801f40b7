"""The 3D-HybridEngine's resharding core (HybridFlow §5.4): one actor's weights between its training layout
(p, t, d) and its generation layout (p_g, t_g, d_g, d) on the same ranks.

layout.py  rank and group arithmetic (pure)
shards.py  how Llama/Qwen2 tensors are cut into training and generation shards (pure)
limits.py  what a generation engine accepts, checked before any collective
reshard.py the micro-DP all-gather and the two baselines, with byte and memory accounting
accounting.py  HybridFlow Table 2 and the exact per-rank figures for a real model (pure)
actor.py   the binding to the actor (HybridEngine: a generation model over the resharded weights); it uses the
           runtime, so this package does not import it and spawned ranks that only reshard stay light
"""

from engines.hybrid.accounting import (
    Table2Row,
    expected_gen_param_bytes,
    expected_received_bytes,
    replicated_bytes_missing,
    table2,
)
from engines.hybrid.layout import GenCoord, HybridLayout, TrainCoord
from engines.hybrid.limits import GenerationEngineLimits, transformers_engine_limits, vllm_engine_limits
from engines.hybrid.reshard import GenerationShard, Method, Resharder, ReshardGroups, ReshardStats
from engines.hybrid.shards import (
    ModelGeometry,
    ShardLayout,
    TensorRule,
    TrainShard,
    WeightFormat,
    build_train_shard,
    check_model_fits,
    expected_generation_state_dict,
    generation_pieces,
    generation_tensors,
    merge_generation_shards,
    model_rules,
    shard_layout,
    stage_layers,
)

__all__ = [
    "GenCoord",
    "GenerationEngineLimits",
    "GenerationShard",
    "HybridLayout",
    "Method",
    "ModelGeometry",
    "ReshardGroups",
    "ReshardStats",
    "Resharder",
    "ShardLayout",
    "TensorRule",
    "TrainCoord",
    "Table2Row",
    "TrainShard",
    "WeightFormat",
    "build_train_shard",
    "check_model_fits",
    "expected_gen_param_bytes",
    "expected_generation_state_dict",
    "expected_received_bytes",
    "generation_pieces",
    "generation_tensors",
    "merge_generation_shards",
    "model_rules",
    "replicated_bytes_missing",
    "shard_layout",
    "stage_layers",
    "table2",
    "transformers_engine_limits",
    "vllm_engine_limits",
]
