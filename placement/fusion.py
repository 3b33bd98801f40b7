"""What RLHFuse's stage fusion would save at cluster scale, estimated with the placement simulator.

The CPU benchmark (`benchmarks/fusion.py`) measures fusion on two slots; this module asks the same question of a
GPU cluster, with the simulator's costs (placement/simulator.py) for one PPO iteration of models colocated on the
same `gpus` devices (RLHFuse's setting: every stage uses every device in turn).

Inter-stage fusion with long-tail migration (RLHFuse §4). Responses have long-tailed lengths (`lengths`, one per
generated sequence). Each generation replica decodes its share with continuous batching, so a decode step costs
`decode_step_s` of the rows still running; unfused, scoring (`inference_s` of every scorer) starts when the slowest
replica ends. Fused: once the running rows fall to `migrate_below` of the batch, they move to as few replicas as
hold them, and the devices freed start scoring the finished samples; when the tail ends, every device scores what
is left. A row moves with its KV cache (`migrate_by="kv"`, what flowactors' hf engine does: its prompt plus the
tokens so far, every layer's keys and values, into the receiving replica over one node's network link), or is
re-prefilled from its tokens there (`migrate_by="prefill"`, what flowactors' vLLM engine does: vLLM keeps its KV
blocks).
Scoring is costed as divisible work (device-seconds of the unfused pass), which ignores that the freed devices
hold a smaller layout of each scorer than the whole cluster does.

Intra-stage fusion (RLHFuse §5). Actor and critic training are each a 1F1B pipeline whose fill and drain leave
(p - 1)/m of the pass idle (m micro-batches). Fused, the two models' micro-batches share one schedule (flowing in
opposite directions, each filling the other's bubbles). Without a planner this module estimates that as one
pipeline over m_actor + m_critic micro-batches (the bubble paid once, on the combined work); given
`fused_pipeline`, the length of the schedule that planner makes (the benchmark passes
engines.training.megatron.pipeline_fusion.plan_pipelines', which the fused training runs, and which plans shorter than
that).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from placement.models import LlamaSpec
from placement.simulator import ROLES, Parallel, Simulator

__all__ = ["FusionEstimate", "estimate_fusion", "decode_timeline"]


@dataclass(frozen=True)
class FusionEstimate:
    """Seconds of one iteration's stages, unfused and fused."""

    generate_s: float
    """Prefill + decode until the slowest replica's last token (unfused)."""
    inference_s: float
    """Every scoring pass after generation (unfused)."""
    fused_generate_inference_s: float
    """Generation and scoring fused with long-tail migration."""
    migrated: int
    """Rows still running when they migrate."""
    tail_replicas: int
    """Replicas the tail migrates to."""
    train_s: float
    """Actor and critic updates, one after the other (each with its pipeline bubble)."""
    fused_train_s: float
    """The same updates on one fused pipeline schedule."""

    @property
    def unfused_s(self) -> float:
        return self.generate_s + self.inference_s + self.train_s

    @property
    def fused_s(self) -> float:
        return self.fused_generate_inference_s + self.fused_train_s

    @property
    def speedup(self) -> float:
        return self.unfused_s / self.fused_s


def decode_timeline(sim: Simulator, spec: LlamaSpec, cfg: Parallel, lengths: Sequence[int]) -> list[float]:
    """Seconds of each decode step, the replicas decoding in parallel: step s costs what the replica with the most
    rows still running at s takes (rows dealt round-robin, continuous batching)."""
    replicas = cfg.devices // (cfg.t_g * cfg.p_g)
    shares = [sorted(lengths[r::replicas]) for r in range(replicas)]
    longest = max(lengths)
    out = []
    for s in range(longest):
        running = max(sum(1 for n in share if n > s) for share in shares)
        out.append(sim.decode_step_s(spec, cfg, running))
    return out


FusedPipeline = Callable[[int, Sequence[int], Sequence[float]], float]
"""(stages, micro-batches per model, one micro-batch's forward + backward seconds on one stage per model) ->
seconds of the fused schedule."""


def estimate_fusion(
    sim: Simulator,
    specs: Mapping[str, LlamaSpec],
    cfgs: Mapping[str, Parallel],
    lengths: Sequence[int],
    *,
    migrate_below: float = 0.1,
    migrate_by: str = "kv",
    fused_pipeline: FusedPipeline | None = None,
) -> FusionEstimate:
    """Estimate one PPO iteration (actor, critic, ref, reward colocated on the same devices; `cfgs["actor"]` with
    its generation sizes) unfused and fused (see the module docstring; `fused_pipeline` plans the fused update
    when the actor and critic have the same (p, t, d), p > 1, as fuse_train requires)."""
    actor, a_cfg = specs["actor"], cfgs["actor"]
    if not a_cfg.t_g:
        raise ValueError("the actor's Parallel needs its generation sizes (p_g, t_g)")
    devices = {c.devices for c in cfgs.values()}
    if len(devices) != 1:
        raise ValueError(f"every model must be colocated on the same devices, got sizes {sorted(devices)}")
    if not 0 < migrate_below < 1:
        raise ValueError(f"migrate_below must be a fraction in (0, 1), got {migrate_below}")
    if migrate_by not in ("kv", "prefill"):
        raise ValueError(f"migrate_by must be 'kv' (move the KV caches) or 'prefill' (re-prefill), got {migrate_by!r}")
    if len(lengths) != sim.wl.generated_sequences or min(lengths) < 1 or max(lengths) > sim.wl.response_tokens:
        raise ValueError(
            f"lengths must be {sim.wl.generated_sequences} response lengths in 1..."
            f"{sim.wl.response_tokens} (the workload's)"
        )
    gpus = devices.pop()
    replicas = gpus // (a_cfg.t_g * a_cfg.p_g)
    per_replica = -(-len(lengths) // replicas)

    steps = decode_timeline(sim, actor, a_cfg, lengths)
    prefill = sim.prefill_s(actor, a_cfg, per_replica)
    generate = prefill + sum(steps)
    scorers = [("actor", "actor"), ("ref", "ref"), ("reward", "reward"), ("critic", "critic")]
    inference = sum(sim.inference_s(specs[m], ROLES[role], cfgs[m]) for m, role in scorers)

    # migration: the first step at which the running rows are at most migrate_below of the batch
    total = len(lengths)
    running = [sum(1 for n in lengths if n > s) for s in range(len(steps))]
    at = next((s for s, r in enumerate(running) if r <= migrate_below * total), len(steps))
    migrated = running[at] if at < len(steps) else 0
    if migrated == 0:
        fused_gi, tail_replicas = generate + inference, 0
    else:
        tail_replicas = min(replicas, -(-migrated // per_replica))  # as few as hold the rows at the batch size
        tail_cfg = a_cfg  # same layout per replica; fewer replicas decode the tail
        tail_rows = -(-migrated // tail_replicas)
        context = sim.wl.prompt_tokens + at
        if migrate_by == "prefill":
            move = sim.prefill_s(actor, tail_cfg, tail_rows) * context / sim.wl.prompt_tokens
        else:  # each receiving replica takes its rows' caches in over one node's link
            move = tail_rows * context * actor.kv_bytes_per_token / sim.hw.network_busbw
        tail = move + sum(sim.decode_step_s(actor, tail_cfg, -(-r // tail_replicas)) for r in running[at:] if r)
        freed = gpus - tail_replicas * a_cfg.t_g * a_cfg.p_g
        work = inference * gpus  # device-seconds of scoring
        done_work = work * (total - migrated) / total  # the finished samples' share, available at migration
        during = min(done_work, freed * tail)
        fused_gi = prefill + sum(steps[:at]) + tail + (work - during) / gpus

    train = fused_train = 0.0
    passes = sim.wl.mini_batches_per_step * sim.wl.epochs_per_step
    a_work, a_micro = sim.pass_work(actor, ROLES["actor"], a_cfg, backward=True)
    c_work, c_micro = sim.pass_work(specs["critic"], ROLES["critic"], cfgs["critic"], backward=True)
    sync = sim.gradient_sync_s(actor, ROLES["actor"], a_cfg) + sim.gradient_sync_s(
        specs["critic"], ROLES["critic"], cfgs["critic"]
    )
    p = max(a_cfg.p, cfgs["critic"].p)
    train = passes * (a_work * (1 + (a_cfg.p - 1) / a_micro) + c_work * (1 + (cfgs["critic"].p - 1) / c_micro) + sync)
    c_cfg = cfgs["critic"]
    if fused_pipeline is not None and (a_cfg.p, a_cfg.t, a_cfg.d) == (c_cfg.p, c_cfg.t, c_cfg.d) and a_cfg.p > 1:
        fused_pass = fused_pipeline(p, [a_micro, c_micro], [a_work / a_micro, c_work / c_micro])
    else:
        fused_pass = (a_work + c_work) * (1 + (p - 1) / (a_micro + c_micro))
    fused_train = passes * (fused_pass + sync)
    return FusionEstimate(
        generate_s=generate,
        inference_s=inference,
        fused_generate_inference_s=fused_gi,
        migrated=migrated,
        tail_replicas=tail_replicas,
        train_s=train,
        fused_train_s=fused_train,
    )
