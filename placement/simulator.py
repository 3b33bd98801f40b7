"""Latency and memory model of one RLHF iteration (HybridFlow §6 "simulator", Appendix B auto_parallel).

Each model is costed alone on its devices under one parallel config; `search` composes the models with the
paper's d_cost (`iteration_cost`). Every constant comes from `placement.hardware` or the `Workload`.

- **Training and scoring** (the actor's old log-probs, reference, reward, cost, critic values) are compute-bound:
  executed FLOPs over achieved FLOP/s, stretched by the 1F1B pipeline bubble (m + p - 1)/m, plus what Megatron
  does not overlap with compute: tensor-parallel collectives (sequence parallel: the equivalent of two all-reduces
  per layer forward, two backward, two more for the recomputed forward), pipeline sends of each micro-batch's
  activations and, per optimizer update, the distributed optimizer's reduce-scatter of fp32 gradients and
  all-gather of bf16 weights over the data-parallel group.
- **Generation** is memory-bound: each decoding step of a replica reads its weight shard and the KV cache of its
  batch in flight (the batch is limited by the KV memory left over; whole sequences are reserved, so a batch that
  starts always finishes), takes two TP all-reduces per layer, and waits for the engine's host work (per step and
  per running sequence). Prefill is compute-bound. The roofline takes the larger of memory and compute time.
- **The actor's transition** from training (p, t, d) to generation (p_g, t_g) is the 3D-HybridEngine all-gather
  inside each micro-DP group: (t·p − t_g·p_g)/(t_g·p_g·t·p) · M bytes received per rank (HybridFlow Table 2).
- **Links** follow Megatron's rank order (t fastest, then d, then p): a group inside a node uses NVLink; a group
  across nodes shares each node's network with the other groups of its kind on that node (`_link`).

Memory per rank: bf16 weights; for trained models fp32 gradients and the distributed optimizer's fp32 master
weights and Adam moments sharded over data parallelism: 6 + 12/d bytes a parameter of the t·p shard (Megatron-LM's
distributed-optimizer table for bf16 with fp32 gradients). Activations of one micro-batch with full recomputation
(1F1B keeps up to p micro-batches of layer inputs), fp32 logits for the loss, and the actor's KV cache beside its
generation shard M/(t_g·p_g), which contains its training shard (zero redundancy, HybridFlow Table 2).

Deviations, and why: generation runs in equal waves rather than continuous batching (the same throughput to first
order, and an honest KV limit); decoding's pipeline hops are left out (the search keeps p_g = 1, what the runner
accepts); training counts 4 forward-equivalents with `activation_recompute` (the recompute is real work and RLHF
frameworks turn it on for long sequences); the optimizer step itself (a few tens of milliseconds of HBM traffic)
is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from placement.hardware import Hardware
from placement.models import LlamaSpec


@dataclass(frozen=True)
class Role:
    """What a model does in an iteration."""

    name: str
    trains: bool
    generates: bool = False
    lm_head: bool = True
    scores_baseline: bool = False
    """Also scores the ReMax greedy baseline responses."""


ROLES = {
    "actor": Role("actor", trains=True, generates=True),
    "critic": Role("critic", trains=True, lm_head=False),
    "cost_critic": Role("cost_critic", trains=True, lm_head=False),
    "ref": Role("ref", trains=False),
    "reward": Role("reward", trains=False, lm_head=False, scores_baseline=True),
    "cost": Role("cost", trains=False, lm_head=False),
    "teacher": Role("teacher", trains=False),
    "rollout": Role("rollout", trains=False, generates=True),
    # (asynchronous RL's rollout replicas: a pool of their own in a plan, never in a searched algorithm's roles)
}

ALGORITHMS = {
    "ppo": ("actor", "critic", "ref", "reward"),
    "remax": ("actor", "ref", "reward"),
    "safe-rlhf": ("actor", "critic", "cost_critic", "ref", "reward", "cost"),
    "grpo": ("actor", "ref", "reward"),
    "dapo": ("actor", "ref", "reward"),
    "gspo": ("actor", "ref", "reward"),
    "rloo": ("actor", "ref", "reward"),
    "reinforce-pp": ("actor", "ref", "reward"),
    "distill": ("actor", "ref", "reward", "teacher"),
}

STAGES = ("generate", "inference", "train")
"""The generate stage holds the actor's transition and generation; inference every scoring pass (the actor's old
log-probs included); train the optimizer updates."""


def get_role(name: str) -> Role:
    try:
        return ROLES[name]
    except KeyError:
        raise ValueError(f"unknown role {name!r}; roles are {', '.join(ROLES)}") from None


@dataclass(frozen=True)
class Workload:
    """One RLHF iteration; defaults are the paper's (§8.1): 1024 prompts of 1024 tokens, 1024-token responses."""

    prompts_per_step: int = 1024
    prompt_tokens: int = 1024
    response_tokens: int = 1024
    samples_per_prompt: int = 1
    """Responses generated, scored and trained on per prompt (GRPO's group size)."""
    baseline_samples_per_prompt: int = 0
    """Extra responses generated and rewarded but not trained on (ReMax's greedy baseline: 1)."""
    mini_batches_per_step: int = 4
    """Optimizer updates per epoch over the step's samples."""
    epochs_per_step: int = 1
    micro_batch_tokens: int = 8192
    """Tokens one data-parallel replica processes per forward/backward micro-batch."""
    activation_recompute: bool = True

    def __post_init__(self) -> None:
        for field in (
            "prompts_per_step",
            "prompt_tokens",
            "response_tokens",
            "samples_per_prompt",
            "mini_batches_per_step",
            "epochs_per_step",
            "micro_batch_tokens",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"Workload.{field} must be >= 1, got {getattr(self, field)}")
        if self.baseline_samples_per_prompt < 0:
            raise ValueError("Workload.baseline_samples_per_prompt must be >= 0")
        if self.trained_sequences % self.mini_batches_per_step:
            raise ValueError(
                f"Workload: {self.trained_sequences} trained sequences do not split into "
                f"mini_batches_per_step={self.mini_batches_per_step}; pick a divisor"
            )

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @property
    def trained_sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def generated_sequences(self) -> int:
        return self.prompts_per_step * (self.samples_per_prompt + self.baseline_samples_per_prompt)

    def scored_sequences(self, role: Role) -> int:
        return self.generated_sequences if role.scores_baseline else self.trained_sequences


@dataclass(frozen=True, slots=True)
class Parallel:
    """Parallel sizes of one model: training (p, t, d) and, for the actor, generation (p_g, t_g)."""

    p: int
    t: int
    d: int
    p_g: int = 0
    t_g: int = 0

    @property
    def devices(self) -> int:
        return self.p * self.t * self.d

    @property
    def train(self) -> tuple[int, int, int]:
        return (self.p, self.t, self.d)

    @property
    def generate(self) -> tuple[int, int] | None:
        return (self.p_g, self.t_g) if self.t_g else None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Simulator:
    """Costs one model under one `Parallel` config on `hardware` for `workload`. Times in seconds, memory in bytes
    per rank."""

    def __init__(self, hardware: Hardware, workload: Workload | None = None) -> None:
        self.hw = hardware
        self.wl = workload or Workload()
        # Decoding time depends on the free memory only through the number of waves; cache on that.
        self._decode = lru_cache(maxsize=None)(self._generation_for_waves)

    # -- communication -----------------------------------------------------------------------------------------
    def _link(self, stride: int, size: int, members_per_node: int = 0) -> tuple[float, float]:
        """(bytes/s per rank, start-up latency) of a group of `size` ranks `stride` apart in the rank order.

        Inside a node: NVLink. Across nodes, a ring carries each rank's volume through every node's network once
        per group, and every GPU of a node belongs to one group of this kind, so the node's network is shared by
        gpus_per_node / (members of one group on the node) groups."""
        hw, gpn = self.hw, self.hw.gpus_per_node
        span = stride * size
        if span <= gpn and gpn % span == 0:
            return hw.nvlink_busbw, hw.nvlink_latency_s
        per_node = members_per_node or max(1, min(size, gpn // stride))
        return hw.network_busbw * per_node / gpn, hw.network_latency_s

    def collective_s(self, volume: float, stride: int, size: int) -> float:
        """One collective in which each rank sends `volume` bytes over the group's links."""
        if size == 1:
            return 0.0
        bandwidth, latency = self._link(stride, size)
        return latency + volume / bandwidth

    def all_reduce_s(self, nbytes: float, size: int, stride: int = 1) -> float:
        """Ring all-reduce of `nbytes` per rank: each rank sends 2(n-1)/n of it."""
        return self.collective_s(2 * (size - 1) / size * nbytes, stride, size) if size > 1 else 0.0

    # -- memory ------------------------------------------------------------------------------------------------
    def static_bytes(self, spec: LlamaSpec, role: Role, cfg: Parallel) -> float:
        """Weights, and for trained models fp32 gradients and the distributed optimizer's states, resident
        between stages: 2 bytes a parameter of the t·p shard, or 6 + 12/d when trained."""
        shard = spec.params(role.lm_head) / (cfg.t * cfg.p)
        if not role.trains:
            return 2 * shard
        return 6 * shard + 12 * shard / cfg.d

    def activation_bytes(self, spec: LlamaSpec, role: Role, cfg: Parallel) -> float:
        """Peak working memory of the model's own training (or, untrained, scoring) pass."""
        replica = self._replica_tokens(role, cfg.d, backward=role.trains)
        tokens = min(replica, self.wl.micro_batch_tokens)
        layer_working = 34 * tokens * spec.hidden / cfg.t  # Korthikanti et al. 2022, flash attention, SP
        logits = 4 * tokens * spec.vocab / cfg.t if role.lm_head else 0.0
        if not role.trains:
            return layer_working + logits
        in_flight = min(cfg.p, _ceil_div(replica, self.wl.micro_batch_tokens))
        per_layer = 2 if self.wl.activation_recompute else 34
        kept = per_layer * tokens * spec.hidden * (spec.layers / cfg.p) * in_flight / cfg.t
        return kept + layer_working + logits

    def generation_extra_bytes(self, spec: LlamaSpec, cfg: Parallel) -> float:
        """Generation shard beyond the resident training shard, which it contains (HybridFlow Table 2)."""
        weights = 2 * spec.params()
        return max(0.0, weights / (cfg.t_g * cfg.p_g) - weights / (cfg.t * cfg.p))

    def kv_bytes_per_sequence(self, spec: LlamaSpec, cfg: Parallel) -> float:
        heads_per_rank = _ceil_div(spec.kv_heads, cfg.t_g)
        return spec.kv_bytes_per_token * self.wl.seq_tokens * heads_per_rank / spec.kv_heads / cfg.p_g

    # -- compute-bound passes ----------------------------------------------------------------------------------
    def _replica_tokens(self, role: Role, d: int, backward: bool) -> int:
        """Tokens one data-parallel replica processes in one pass: its share of a mini-batch when training, of
        every scored sequence when scoring."""
        wl = self.wl
        sequences = wl.trained_sequences // wl.mini_batches_per_step if backward else wl.scored_sequences(role)
        return _ceil_div(sequences, d) * wl.seq_tokens

    def _pass_s(self, spec: LlamaSpec, role: Role, cfg: Parallel, backward: bool) -> float:
        """One 1F1B-pipelined pass (a training mini-batch when `backward`, else the scoring pass)."""
        work, micro = self.pass_work(spec, role, cfg, backward)
        return work * (1 + (cfg.p - 1) / micro)

    def pass_work(self, spec: LlamaSpec, role: Role, cfg: Parallel, backward: bool) -> tuple[float, int]:
        """A pass's busy time per pipeline stage without the 1F1B fill/drain bubble, and its micro-batches: the
        bubble adds (p - 1)/micro of it."""
        hw, wl = self.hw, self.wl
        tokens = self._replica_tokens(role, cfg.d, backward)
        micro = _ceil_div(tokens, wl.micro_batch_tokens)
        passes = (4 if wl.activation_recompute else 3) if backward else 1
        compute = passes * spec.flops_per_token(wl.seq_tokens, role.lm_head) * tokens / (cfg.t * cfg.p * hw.flops_s)
        activations = min(tokens, wl.micro_batch_tokens) * spec.hidden * 2  # one micro-batch, bf16
        collectives = (6 if wl.activation_recompute else 4) if backward else 2  # all-reduce equivalents per layer
        tp = micro * spec.layers / cfg.p * collectives * self.all_reduce_s(activations, cfg.t)
        # Each pipeline hop sends a micro-batch's activations forward (and their gradients back), SP-sharded.
        hops = (2 if backward else 1) * micro
        pp = hops * self.collective_s(activations / cfg.t, cfg.t * cfg.d, cfg.p) if cfg.p > 1 else 0.0
        return compute + tp + pp, micro

    def gradient_sync_s(self, spec: LlamaSpec, role: Role, cfg: Parallel) -> float:
        """Distributed optimizer, once per update: reduce-scatter fp32 gradients and all-gather bf16 weights over
        the data-parallel group (each rank sends (d-1)/d of 4 + 2 bytes a parameter of its shard)."""
        if cfg.d == 1:
            return 0.0
        shard = spec.params(role.lm_head) / (cfg.t * cfg.p)
        return 2 * self.collective_s((cfg.d - 1) / cfg.d * 3 * shard, cfg.t, cfg.d)

    def train_s(self, spec: LlamaSpec, role: Role, cfg: Parallel) -> float:
        """All optimizer updates of one iteration."""
        wl = self.wl
        update = self._pass_s(spec, role, cfg, backward=True) + self.gradient_sync_s(spec, role, cfg)
        return wl.mini_batches_per_step * wl.epochs_per_step * update

    def inference_s(self, spec: LlamaSpec, role: Role, cfg: Parallel) -> float:
        """Scoring pass: the actor's old log-probs, the reference's, the reward and cost scores, critic values."""
        return self._pass_s(spec, role, cfg, backward=False)

    # -- the actor -----------------------------------------------------------------------------------------------
    def transition_bytes(self, spec: LlamaSpec, cfg: Parallel) -> float:
        """Bytes each rank receives when resharding from training to generation (HybridFlow Table 2)."""
        tp, tpg = cfg.t * cfg.p, cfg.t_g * cfg.p_g
        return (tp - tpg) / (tpg * tp) * 2 * spec.params()

    def transition_s(self, spec: LlamaSpec, cfg: Parallel) -> float:
        """3D-HybridEngine resharding: one all-gather inside each micro-DP group, whose t·p/(t_g·p_g) ranks are
        t/t_g ranks of a TP group and p/p_g pipeline stages."""
        nbytes = self.transition_bytes(spec, cfg)
        if nbytes == 0:
            return 0.0
        stages = cfg.p // cfg.p_g
        if stages == 1:
            bandwidth, latency = self._link(cfg.t_g, cfg.t // cfg.t_g)
        else:
            per_node = (cfg.t // cfg.t_g) * max(1, min(stages, self.hw.gpus_per_node // (cfg.t * cfg.d)))
            bandwidth, latency = self._link(cfg.t * cfg.d, stages, members_per_node=per_node)
        return latency + nbytes / bandwidth

    def max_batch(self, spec: LlamaSpec, cfg: Parallel, free_bytes: float) -> int:
        """Sequences one generation replica can hold: the KV memory left after the generation shard."""
        kv_budget = free_bytes - self.generation_extra_bytes(spec, cfg)
        return max(0, int(kv_budget // self.kv_bytes_per_sequence(spec, cfg)))

    def _per_replica(self, cfg: Parallel) -> int:
        """Responses each generation replica (t_g·p_g devices) produces."""
        return _ceil_div(self.wl.generated_sequences, cfg.devices // (cfg.t_g * cfg.p_g))

    def generation_s(self, spec: LlamaSpec, cfg: Parallel, free_bytes: float) -> float | None:
        """Generate all responses with `free_bytes` per rank free for generation; None if no sequence fits."""
        batch = self.max_batch(spec, cfg, free_bytes)
        if batch < 1:
            return None
        return self._decode(spec, cfg, _ceil_div(self._per_replica(cfg), batch))

    def generation_batch(self, spec: LlamaSpec, cfg: Parallel, free_bytes: float) -> int:
        """Sequences in flight per replica under the equal-waves schedule of `generation_s` (0 if none fits)."""
        batch, per_replica = self.max_batch(spec, cfg, free_bytes), self._per_replica(cfg)
        return _ceil_div(per_replica, _ceil_div(per_replica, batch)) if batch else 0

    def decode_step_s(self, spec: LlamaSpec, cfg: Parallel, batch: int) -> float:
        """One decoding step of a replica with `batch` sequences in flight at the mean context length."""
        hw, wl = self.hw, self.wl
        ranks = cfg.t_g * cfg.p_g
        context = wl.prompt_tokens + wl.response_tokens / 2
        weights = 2 * spec.matmul_params() / cfg.t_g  # each pipeline stage reads its weights once per step
        kv = batch * context * spec.kv_bytes_per_token * _ceil_div(spec.kv_heads, cfg.t_g) / spec.kv_heads / cfg.p_g
        memory = (weights + kv) / hw.decode_bytes_s
        compute = batch * spec.decode_flops_per_token(context) / (ranks * hw.flops_s)
        tp = 2 * spec.layers * self.all_reduce_s(batch / cfg.p_g * spec.hidden * 2, cfg.t_g)
        host = hw.decode_step_host_s + hw.decode_sequence_host_s * batch
        return max(memory, compute) + tp + host

    def prefill_s(self, spec: LlamaSpec, cfg: Parallel, batch: int) -> float:
        hw, wl = self.hw, self.wl
        tokens = batch * wl.prompt_tokens
        compute = spec.flops_per_token(wl.prompt_tokens) * tokens / (cfg.t_g * cfg.p_g * hw.flops_s)
        return compute + 2 * spec.layers * self.all_reduce_s(tokens * spec.hidden * 2, cfg.t_g)

    def _generation_for_waves(self, spec: LlamaSpec, cfg: Parallel, waves: int) -> float:
        batch = _ceil_div(self._per_replica(cfg), waves)
        step = self.decode_step_s(spec, cfg, batch)
        return waves * (self.prefill_s(spec, cfg, batch) + self.wl.response_tokens * step)

    def colocated_peak_bytes(self, members: list[tuple[LlamaSpec, Role, Parallel]]) -> float:
        """Peak memory per rank of models sharing devices: everyone's resident state, plus the largest working set
        of one stage (colocated models take turns, so their working sets never coexist)."""
        static = sum(self.static_bytes(spec, role, cfg) for spec, role, cfg in members)
        working = [self.activation_bytes(spec, role, cfg) for spec, role, cfg in members]
        working += [
            self.generation_extra_bytes(spec, cfg) + self.kv_bytes_per_sequence(spec, cfg)
            for spec, role, cfg in members
            if role.generates
        ]
        return static + max(working, default=0.0)


def iteration_cost(sets: list[tuple[float, ...]]) -> float:
    """HybridFlow's d_cost: each colocated set's per-stage latency (already summed over its models) runs
    concurrently with the other sets, stage by stage: the iteration is the sum over stages of the slowest set."""
    return sum(max(stage) for stage in zip(*sets)) if sets else 0.0
