"""Placement plans: which models share devices, how many, and their parallel sizes (HybridFlow §4.1, §6).

A plan is data. Its JSON (or YAML) form is exactly what `python -m placement.automap --json` prints, so a searched
plan can be saved and handed to an algorithm script unchanged:

    {"placement": [["actor", "ref"], ["critic", "reward"]],       # colocated sets, one resource pool each
     "gpus": {"actor": 32, "ref": 32, "critic": 32, "reward": 32},
     "parallel": {"actor": {"train": [p, t, d], "generate": [p_g, t_g], "rollout_engine": "vllm"},
                  "ref": {"train": [p, t, d]}, ...}}

Models in one set live in the same worker processes and take turns; sets run concurrently. For models that only
score, "train" still names their (p, t, d) sharding. A missing "parallel" entry means pure data parallelism
(1, 1, gpus); a missing "generate" means the actor generates with its training (p, t). Asynchronous RL adds a
"rollout" model, the replicas' pool (a set of its own): "train": [1, t, d] is d replicas of t ranks each, and its
"rollout_engine" their generation engine; the actor then trains only.

`validate` checks a plan against a cluster before anything is started, and says what to change.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from placement.hardware import Hardware
from placement.models import LlamaSpec, divides_heads
from placement.simulator import Parallel, Simulator, Workload, get_role

# Keys automap adds for people to read; a plan accepts and ignores them.
_INFORMATIONAL = {
    "engine",
    "engine_note",
    "estimated_iteration_s",
    "stages",
    "search_s",
    "placements_searched",
    "pools",
    "models",
    "ranking",
}


class PlanError(ValueError):
    """A plan that is malformed or does not fit the cluster; the message names the fix."""


@dataclass(frozen=True)
class ModelPlan:
    role: str
    gpus: int
    train: tuple[int, int, int]
    """(p, t, d): pipeline, tensor and data parallel sizes; p·t·d = gpus."""
    generate: tuple[int, int] | None = None
    """(p_g, t_g) for the actor's generation; t_g must divide t and p_g divide p."""
    rollout_engine: str | None = None
    """The actor's generation engine (hf, vllm); None: the run's `rollout_engine` setting."""

    def __post_init__(self) -> None:
        get_role(self.role)
        object.__setattr__(self, "train", tuple(int(x) for x in self.train))
        if self.generate is not None:
            object.__setattr__(self, "generate", tuple(int(x) for x in self.generate))
        if len(self.train) != 3 or min(self.train) < 1:
            raise PlanError(f"{self.role}: train must be three positive sizes [p, t, d], got {list(self.train)}")
        p, t, d = self.train
        if p * t * d != self.gpus:
            raise PlanError(
                f"{self.role}: train sizes p·t·d = {p}·{t}·{d} = {p * t * d} must equal its "
                f"{self.gpus} GPUs; change d to {self.gpus // (p * t) or 1} or the pool size"
            )
        if self.rollout_engine is not None and self.role not in ("actor", "rollout"):
            raise PlanError(f"{self.role}: only the actor and the rollout replicas generate; drop its 'rollout_engine'")
        if self.role == "rollout":  # asynchronous RL's replicas: d replicas of t ranks, generating with those sizes
            if p != 1:
                raise PlanError(
                    f"rollout: the replicas have no pipeline stages; train must be [1, t, d] (d replicas of t "
                    f"ranks), got {list(self.train)}"
                )
            if self.generate is not None and tuple(self.generate) != (1, t):
                raise PlanError(
                    f"rollout: a replica generates with its own sizes; generate must be [1, {t}] or left out, "
                    f"got {list(self.generate)}"
                )
            return
        if self.generate is None:
            return
        if self.role != "actor":
            raise PlanError(f"{self.role}: only the actor generates; drop its 'generate' sizes")
        if len(self.generate) != 2 or min(self.generate) < 1:
            raise PlanError(f"actor: generate must be two positive sizes [p_g, t_g], got {list(self.generate)}")
        p_g, t_g = self.generate
        if t % t_g or p % p_g:
            raise PlanError(
                f"actor: generation sizes (p_g, t_g) = ({p_g}, {t_g}) must divide the training sizes "
                f"(p, t) = ({p}, {t}) so the 3D-HybridEngine can reuse the training shard"
            )

    @property
    def parallel(self) -> Parallel:
        generates = self.role in ("actor", "rollout")
        p_g, t_g = self.generate or ((self.train[0], self.train[1]) if generates else (0, 0))
        return Parallel(*self.train, p_g=p_g, t_g=t_g)


@dataclass(frozen=True)
class Plan:
    placement: tuple[tuple[str, ...], ...]
    """Colocated sets of roles; each set is one resource pool."""
    models: tuple[ModelPlan, ...]

    def __post_init__(self) -> None:
        _check_shape(self.placement)
        object.__setattr__(self, "placement", tuple(tuple(s) for s in self.placement))
        object.__setattr__(self, "models", tuple(self.models))
        roles = [r for s in self.placement for r in s]
        if any(not s for s in self.placement):
            raise PlanError("placement has an empty set; remove it")
        repeated = sorted({r for r in roles if roles.count(r) > 1})
        if repeated:
            raise PlanError(f"placement names {', '.join(repeated)} more than once; each model lives in one set")
        planned = [m.role for m in self.models]
        if sorted(planned) != sorted(roles):
            raise PlanError(
                f"placement has models {sorted(roles)} but sizes are given for {sorted(planned)}; "
                "give each placed model its gpus and parallel sizes"
            )
        for s in self.placement:
            sizes = {r: self.model(r).gpus for r in s}
            if len(set(sizes.values())) > 1:
                raise PlanError(f"colocated models share their pool, so they need the same gpus; got {sizes}")

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for s in self.placement for r in s)

    @property
    def total_gpus(self) -> int:
        return sum(self.pools().values())

    def model(self, role: str) -> ModelPlan:
        for m in self.models:
            if m.role == role:
                return m
        raise KeyError(f"plan has no model {role!r}; it has {', '.join(self.roles)}")

    def pool_of(self, role: str) -> str:
        return next("+".join(s) for s in self.placement if role in s)

    def pools(self) -> dict[str, int]:
        """Pool name ("actor+ref") -> number of device slots."""
        return {"+".join(s): self.model(s[0]).gpus for s in self.placement}

    # -- serialization -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        parallel: dict[str, dict[str, list[int]]] = {}
        for m in self.models:
            parallel[m.role] = {"train": list(m.train)}
            if m.generate is not None:
                parallel[m.role]["generate"] = list(m.generate)
            if m.rollout_engine is not None:
                parallel[m.role]["rollout_engine"] = m.rollout_engine
        return {
            "placement": [list(s) for s in self.placement],
            "gpus": {m.role: m.gpus for m in self.models},
            "parallel": parallel,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        unknown = set(data) - {"placement", "gpus", "parallel"} - _INFORMATIONAL
        if unknown:
            raise PlanError(f"unknown plan keys {sorted(unknown)}; a plan has placement, gpus and parallel")
        for key in ("placement", "gpus"):
            if key not in data:
                raise PlanError(f"plan lacks {key!r}; see docs/placement.md for the format")
        _check_shape(data["placement"])
        gpus, parallel = data["gpus"], data.get("parallel", {})
        models = []
        for role in (r for s in data["placement"] for r in s):
            if role not in gpus:
                raise PlanError(f"plan gives no gpus for {role!r}; add \"{role}\": N under 'gpus'")
            sizes = parallel.get(role, {})
            models.append(
                ModelPlan(
                    role,
                    int(gpus[role]),
                    sizes.get("train", (1, 1, int(gpus[role]))),
                    sizes.get("generate"),
                    sizes.get("rollout_engine"),
                )
            )
        return cls(data["placement"], tuple(models))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        return _require_yaml().safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> Plan:
        return cls.from_dict(_require_yaml().safe_load(text))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise PlanError(f"cannot read plan file {path}: {e.strerror or e}") from None
        try:
            return cls.from_yaml(text) if path.suffix in (".yaml", ".yml") else cls.from_json(text)
        except PlanError as e:
            raise PlanError(f"plan file {path}: {e}") from None
        except Exception as e:
            raise PlanError(
                f"plan file {path} is not a valid plan ({type(e).__name__}: {e}); see docs/placement.md for the format"
            ) from None


def plan_engine(plan: Plan) -> str:
    """The training engine that runs `plan`: "megatron" when a model has pipeline stages (the torch engine has
    none, and the runner refuses such a plan on it before any worker starts), else "torch"."""
    return "megatron" if any(m.train[0] > 1 for m in plan.models) else "torch"


def engine_note(plan: Plan) -> str:
    """One line saying what runs `plan`, and why."""
    piped = [f"{m.role} (p={m.train[0]})" for m in plan.models if m.train[0] > 1]
    if not piped:
        return "p = 1 throughout: runs on either engine (model.engine=torch is the default)"
    return (
        f"pipeline stages for {', '.join(piped)}: run with model.engine=megatron (the torch engine has no "
        "pipeline parallelism)"
    )


def _check_shape(placement: Any) -> None:
    if isinstance(placement, str) or any(isinstance(s, str) for s in placement):
        raise PlanError(
            f'placement must be a list of colocated sets, e.g. [["actor", "ref"], ["critic"]]; got {placement!r}'
        )


def _require_yaml() -> Any:
    """PyYAML, imported only when a YAML plan is read or written: JSON always works without it."""
    try:
        import yaml
    except ImportError:
        raise PlanError("YAML plans need PyYAML (pip install pyyaml); or save the plan as .json") from None
    return yaml


def validate(
    plan: Plan,
    n_slots: int,
    *,
    gpus_per_node: int | None = None,
    models: Mapping[str, LlamaSpec] | None = None,
    hardware: Hardware | None = None,
    workload: Workload | None = None,
) -> None:
    """Check `plan` against a cluster of `n_slots` device slots; raise PlanError listing every problem and its fix.

    With `models`, sizes must divide the attention heads and layers; with `models` and `hardware` as well, every
    colocated set must fit in device memory (weights, gradients, optimizer states, activations, the KV cache)."""
    problems = []
    if plan.total_gpus > n_slots:
        problems.append(
            f"the plan needs {plan.total_gpus} device slots but the cluster has {n_slots}: start "
            f"more workers or shrink the pools {plan.pools()}"
        )
    gpn = gpus_per_node or (hardware.gpus_per_node if hardware else None)
    for m in plan.models:
        cfg = m.parallel
        if gpn and cfg.t > gpn:
            problems.append(
                f"{m.role}: tensor parallel size {cfg.t} exceeds the {gpn} GPUs of a node; tensor "
                "parallelism needs NVLink, use pipeline parallelism (p) across nodes"
            )
        spec = (models or {}).get(m.role)
        if spec is None:
            continue
        # Generation sizes divide the training sizes (ModelPlan), so checking t and p covers t_g and p_g.
        if not divides_heads(spec, cfg.t):
            problems.append(
                f"{m.role}: tensor parallel size {cfg.t} does not divide its {spec.heads} attention "
                f"heads ({spec.kv_heads} key/value heads); pick a divisor"
            )
        if spec.layers % cfg.p:
            problems.append(f"{m.role}: pipeline size {cfg.p} does not divide its {spec.layers} layers; pick a divisor")
    if models is not None and hardware is not None:
        sim = Simulator(hardware, workload)
        for s in plan.placement:
            members = [(models[r], get_role(r), plan.model(r).parallel) for r in s if r in models]
            need = sim.colocated_peak_bytes(members)
            if need > hardware.usable_bytes:
                problems.append(
                    f"pool {'+'.join(s)} needs {need / 2**30:.1f} GiB per device but a {hardware.name} has "
                    f"{hardware.usable_bytes / 2**30:.1f} GiB usable: give it more GPUs, raise t or p, or split "
                    "the set into separate pools"
                )
    if problems:
        raise PlanError("plan does not fit the cluster:\n  - " + "\n  - ".join(problems))
