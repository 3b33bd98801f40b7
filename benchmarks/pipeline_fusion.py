"""Intra-stage fusion: actor + critic training as one fused pipeline against the two trained one after the other.

    python benchmarks/pipeline_fusion.py --micro-batches 2 4 8

Spawns 2 gloo processes on 127.0.0.1 (pp = 2, one thread each), builds a Llama-shaped actor (lm head) and critic
(value head) as megatron-core GPTModel stages (random weights, float32; megatron-core on CPU needs the test-only
CUDA shim, tests/engines/megatron_shim.py: a measurement on CPU, not a product path), and times one update of
m micro-batches per model, rounds interleaved, in three modes:

- `megatron`: `actor.update` then `critic.update`, megatron's own 1F1B schedule each;
- `1f1b`: the same two 1F1B pipelines run by engines.training.megatron.pipeline_fusion's runner, which also measures how
  long each rank waits for its peer (the bubble, measured);
- `fused`: `fused_update`: the critic's stages run down the ranks, both models in one plan.

A round's time is the slowest rank's; the figure is the median. `bubble` is the measured wait over wall time,
averaged over the ranks, and `plan bubble` the planner's at F = 1, B = 2. Every mode gives the same weights
(tests/engines/test_pipeline_fusion.py).

    python benchmarks/pipeline_fusion.py --ppo

runs PPO end to end instead (`algorithms/ppo.py` on the embedded cluster, 2 slots, every model colocated; actor,
reference and critic with p = 2 on the megatron engine under the same shim), with `fuse_train` off and on in turn,
and prints the median update and step seconds of each run (the first step left out) and the last step's gradient
norms, which agree between the modes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, LAYERS, WIDTH, ROWS_PER_MB = 384, 4, 96, 4


def _models():
    import transformers

    common = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=HIDDEN * 8 // 3,
        vocab_size=1024,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        num_labels=1,
        classifier_dropout=0.0,
    )
    torch.manual_seed(0)
    actor = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    critic = transformers.LlamaForTokenClassification(transformers.LlamaConfig(**common))
    return actor, critic


def _batch(rows: int):
    from flowactors import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (rows, WIDTH), generator=g)
    resp = WIDTH // 2
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "responses": ids[:, -resp:],
            "response_mask": torch.ones(rows, resp, dtype=torch.long),
            "advantages": torch.randn(rows, resp, generator=g),
            "returns": torch.randn(rows, resp, generator=g),
        }
    )


def _pg_loss(outputs, mb):
    return -(outputs["log_probs"] * mb["advantages"]), mb["response_mask"].float(), {}


def _value_loss(outputs, mb):
    return (outputs["values"] - mb["returns"]).square(), mb["response_mask"].float(), {}


def _run(rank: int, world: int, port: int, counts: list[int], rounds: int, out: dict) -> None:
    from tests.ranks import join_world

    join_world(rank, world, port, megatron=True)
    from engines.training.common import OptimConfig
    from engines.training.megatron.engine import MegatronEngine
    from engines.training.megatron.groups import world_groups
    from engines.training.megatron.pipeline_fusion import (
        PipelineJob,
        finalize_grads,
        fused_update,
        plan_pipelines,
        run_plan,
    )

    optim = OptimConfig(lr=1e-5, micro_batch_tokens=ROWS_PER_MB * WIDTH)
    actor_hf, critic_hf = _models()
    actor = MegatronEngine.from_hf_model(actor_hf, optim, pp=2)
    critic_up = MegatronEngine.from_hf_model(critic_hf, optim, pp=2)
    critic_down = MegatronEngine.from_hf_model(critic_hf, optim, pp=2, groups=world_groups(1, 2, True))
    policy = lambda mb: actor.policy_outputs(mb, 1.0, False)  # noqa: E731

    def planned_1f1b(batch) -> float:
        """Each model alone through the runner (1F1B), one after the other; returns the wait share."""
        wall = wait = 0.0
        for engine, loss, outputs in ((actor, _pg_loss, policy), (critic_up, _value_loss, critic_up.value_outputs)):
            run = engine.begin_update()
            engine.zero_grads()
            job = PipelineJob(engine, engine.micro_batches(batch), engine.train_loss_step(loss, outputs))
            timing = run_plan([job], plan_pipelines(2, [len(job.micro_batches)], reverse=[False]))
            finalize_grads(job)
            engine.optimizer_step(run, job.records)
            wall, wait = wall + timing.wall_s, wait + timing.wait_s
        return wait / wall

    results: dict = {}
    for m in counts:
        batch = _batch(m * ROWS_PER_MB)
        times: dict[str, list[float]] = {"megatron": [], "1f1b": [], "fused": []}
        waits: dict[str, list[float]] = {"1f1b": [], "fused": []}
        for r in range(rounds + 1):  # round 0 warms up
            for mode in times:
                dist.barrier()
                t = time.perf_counter()
                if mode == "megatron":
                    actor.update([batch], _pg_loss, policy)
                    critic_up.update([batch], _value_loss, critic_up.value_outputs)
                elif mode == "1f1b":
                    share = planned_1f1b(batch)
                else:
                    _, timings = fused_update(
                        [
                            (actor, [batch], _pg_loss, policy),
                            (critic_down, [batch], _value_loss, critic_down.value_outputs),
                        ]
                    )
                    share = timings[0].bubble_fraction
                elapsed = torch.tensor([time.perf_counter() - t])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if r:
                    times[mode].append(float(elapsed))
                    if mode in waits:
                        waits[mode].append(share)
        results[m] = {"times": times, "waits": waits}
    out[rank] = results
    dist.destroy_process_group()


def ppo_end_to_end(runs: int, steps: int) -> None:
    """PPO with fuse_train off and on, `runs` times each in turn; update and step seconds per run."""
    import json
    import tempfile
    from pathlib import Path

    from algorithms.ppo import main as ppo
    from placement import ModelPlan, Plan
    from tests.engines.megatron_probes import MEGATRON_CPU

    work = Path(tempfile.mkdtemp(prefix="pipeline_fusion_ppo_"))
    plan = Plan(
        placement=[["actor", "ref", "critic", "reward"]],
        models=[
            ModelPlan("actor", 2, (2, 1, 1), (1, 1)),
            ModelPlan("ref", 2, (2, 1, 1)),
            ModelPlan("critic", 2, (2, 1, 1)),
            ModelPlan("reward", 2, (1, 1, 2)),
        ],
    )
    plan.save(work / "plan.json")
    common = [
        "dashboard=none",
        "--plan",
        str(work / "plan.json"),
        "n_slots=2",
        f"model.engine={MEGATRON_CPU}",
        "sft_steps=5",
        "--steps",
        str(steps),
        "model.hidden_size=512",
        "model.num_layers=8",
        "micro_batch_tokens=256",
    ]
    print(
        f"PPO, {steps} steps per run (median of steps 1..), actor / ref / critic p = 2 on megatron, hidden 512, "
        f"8 layers, 2 micro-batches per mini-batch"
    )
    print(
        f"{'run':>3} {'fuse_train':>10} {'update s':>9} {'step s':>7} {'actor grad norm':>16} {'critic grad norm':>17}"
    )
    for run in range(runs):
        for fuse in ("false", "true"):
            metrics = work / f"m_{run}_{fuse}.jsonl"
            ppo([*common, f"fuse_train={fuse}", "--metrics-file", str(metrics)])
            rows = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
            print(
                f"{run:>3} {fuse:>10} {statistics.median(r['update_s'] for r in rows):>9.3f} "
                f"{statistics.median(r['step_s'] for r in rows):>7.3f} {rows[-1]['actor/grad_norm']:>16.6f} "
                f"{rows[-1]['critic/grad_norm']:>17.6f}"
            )


def main(argv: list[str] | None = None) -> None:
    from engines.training.megatron.pipeline_fusion import plan_pipelines
    from tests.ranks import free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ppo", action="store_true", help="PPO end to end with fuse_train off and on")
    parser.add_argument("--runs", type=int, default=2, help="--ppo: runs per mode")
    parser.add_argument("--steps", type=int, default=5, help="--ppo: steps per run")
    args = parser.parse_args(argv)
    if args.ppo:
        ppo_end_to_end(args.runs, args.steps)
        return
    out = mp.Manager().dict()
    mp.spawn(_run, args=(2, free_port(), args.micro_batches, args.rounds, out), nprocs=2, join=True)
    print(
        f"pp = 2, actor + critic {LAYERS} layers × {HIDDEN} hidden, {ROWS_PER_MB} rows × {WIDTH} tokens per "
        f"micro-batch, median of {args.rounds} rounds (slowest rank)"
    )
    print(
        f"{'m':>3} {'megatron s':>11} {'1f1b s':>8} {'fused s':>8} {'fused vs megatron':>18} {'1f1b bubble':>12} "
        f"{'fused bubble':>13} {'plan 1f1b':>10} {'plan fused':>11}"
    )
    for m in args.micro_batches:
        t = {mode: statistics.median(out[0][m]["times"][mode]) for mode in out[0][m]["times"]}
        bubble = {
            mode: statistics.mean([statistics.median(out[r][m]["waits"][mode]) for r in (0, 1)])
            for mode in ("1f1b", "fused")
        }
        alone, fused = plan_pipelines(2, [m], reverse=[False]), plan_pipelines(2, [m, m])
        print(
            f"{m:>3} {t['megatron']:>11.3f} {t['1f1b']:>8.3f} {t['fused']:>8.3f} "
            f"{t['megatron'] / t['fused']:>17.2f}x "
            f"{bubble['1f1b']:>12.1%} {bubble['fused']:>13.1%} {alone.bubble_fraction:>10.1%} "
            f"{fused.bubble_fraction:>11.1%}"
        )


if __name__ == "__main__":
    main()
