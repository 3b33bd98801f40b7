"""Resource pools, placement plans and HybridFlow's auto device mapping (docs/design.md §5; HybridFlow §4.1, §6).

Pure Python: nothing here imports torch, Dask or the rest of flowactors, so plans can be searched and checked on
any machine. See docs/placement.md for how to read a plan.
"""

from placement.hardware import Hardware, a100_80gb, get_hardware, h100, h200
from placement.models import LlamaSpec, llama_7b, llama_13b, llama_34b, llama_70b, parse_model
from placement.plan import ModelPlan, Plan, PlanError, validate
from placement.pools import ResourcePool, Slot, pools_for_plan, slots_from_addresses
from placement.search import AutoMapper, SearchResult, allocations, auto_map, device_counts, set_partitions
from placement.simulator import ALGORITHMS, ROLES, Parallel, Role, Simulator, Workload, iteration_cost

__all__ = [
    "ALGORITHMS",
    "ROLES",
    "AutoMapper",
    "Hardware",
    "LlamaSpec",
    "ModelPlan",
    "Parallel",
    "Plan",
    "PlanError",
    "ResourcePool",
    "Role",
    "SearchResult",
    "Simulator",
    "Slot",
    "Workload",
    "a100_80gb",
    "allocations",
    "auto_map",
    "device_counts",
    "get_hardware",
    "h100",
    "h200",
    "iteration_cost",
    "llama_13b",
    "llama_34b",
    "llama_70b",
    "llama_7b",
    "parse_model",
    "pools_for_plan",
    "set_partitions",
    "slots_from_addresses",
    "validate",
]
