"""Multi-turn rollouts with a slow tool: tools running while the batch decodes, against a turn-by-turn loop.

    python benchmarks/agent.py [--json] [--episodes 64] [--tool-ms 50] [--tool-workers 8] [--repeats 3]

One embedded cluster, one slot, one actor (ActorWorker, the hf engine) warm-started on tool_arith's demonstrations
that call the calculator (so most episodes are: a call, the tool's output, the answer). The calculator sleeps
`--tool-ms` first. Three modes sample the same episodes (same seeds; the table checks the tokens are identical):

- `overlap`: as each episode's turn ends, its call goes to a pool of `--tool-workers` threads while the rest of the
  batch decodes; episodes whose tool has answered form the next turn's batch (engines.rollout.agent).
- `turn-by-turn`: the whole batch decodes a turn, then each call runs in turn and is waited for (one tool thread),
  then the next turn.
- `turn-by-turn-pool`: the same, the turn's calls running `--tool-workers` at a time (a synchronous loop with a
  pool: what overlapping adds beyond running tools concurrently).

episodes/s and tokens/s (the model's and the tools' tokens) over the `generate_sequences` call, median of
`--repeats` after one warm-up. JSON lines with --json, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOOL_SECONDS = 0.05


def slow_calculator(expression: str) -> str:
    """A calculator that takes TOOL_SECONDS (a remote API, a sandbox) before it answers.

    Args:
        expression: two integers and one of + - * /.
    """
    from algorithms.data.tasks import calculator

    time.sleep(TOOL_SECONDS)
    return calculator(expression)


def slow_environment(tokenizer):
    from engines.rollout.tools import CompactFormat, Tool, ToolEnvironment

    return ToolEnvironment([Tool(slow_calculator, name_="calc")], CompactFormat(), tokenizer)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line per row before the table")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--tool-ms", type=float, default=50.0)
    ap.add_argument("--tool-workers", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    global TOOL_SECONDS
    TOOL_SECONDS = args.tool_ms / 1000  # travels with the pickled tool (this module runs as __main__)

    import torch

    import flowactors as fa
    from algorithms.data.prompts import PromptData
    from algorithms.data.tasks import get_task
    from algorithms.objectives.losses import SFTLoss
    from engines import (
        ActorWorker,
        GenerationSpec,
        ModelConfig,
        OptimConfig,
        SamplingConfig,
        UpdateSpec,
        build_tokenizer,
    )
    from engines.rollout.agent import AgentConfig

    task, model = get_task("tool_arith"), ModelConfig()
    data = PromptData(task, build_tokenizer(model), 512, 0)
    calls = [ex for ex in data.examples if isinstance(ex[1], tuple) and len(ex[1]) == 3]  # demonstrations with a call
    sampling = SamplingConfig(max_new_tokens=task.max_new_tokens)
    ctl = fa.Controller.local(1, dashboard=None, collective_timeout_s=1200, call_timeout_s=3600)
    rows, tokens = [], {}
    try:
        for mode, overlap, workers in (
            ("turn-by-turn", False, 1),
            ("turn-by-turn-pool", False, args.tool_workers),
            ("overlap", True, args.tool_workers),
        ):
            agent = AgentConfig(slow_environment, max_turns=task.max_turns, tool_workers=workers, overlap=overlap)
            actor = fa.ActorGroup(
                ctl,
                ActorWorker,
                name=f"actor_{mode.replace('-', '_')}",
                slots=ctl.slots[:1],
                args=(model, OptimConfig(lr=3e-3), sampling),
                kwargs={"agent": agent},
            )
            try:
                sft = data.demonstrations(
                    [calls[i % len(calls)] for i in range(args.sft_steps * 32)], task.max_new_tokens
                )
                actor.update_actor(sft, SFTLoss(), UpdateSpec(32, shuffle_seed=0)).result()
                prompts = data.next_batch(args.episodes, 1)
                data.epoch = data.index = 0
                times = []
                for _ in range(args.repeats + 1):  # the first round warms up
                    t0 = time.perf_counter()
                    out = actor.generate_sequences(prompts, GenerationSpec()).result()
                    times.append(time.perf_counter() - t0)
            finally:
                actor.close()
            seconds = statistics.median(times[1:])
            episode_tokens = int(out["attention_mask"][:, out["prompts"].shape[1] :].sum())
            tokens[mode] = out["responses"]
            rows.append(
                {
                    "mode": mode,
                    "episodes_per_s": args.episodes / seconds,
                    "tokens_per_s": episode_tokens / seconds,
                    "seconds": seconds,
                    "tool_calls_mean": float(out["tool_calls"].mean()),
                    "turns_mean": float(out["turns"].mean()),
                    "tool_ms": args.tool_ms,
                    "tool_workers": workers,
                }
            )
    finally:
        ctl.close()
    same = all(torch.equal(tokens["overlap"], t) for t in tokens.values())
    base = rows[0]["episodes_per_s"]
    for r in rows:
        r["speedup"], r["same_episodes"] = r["episodes_per_s"] / base, same
    if args.json:
        for r in rows:
            print(json.dumps(r))
    print(
        f"\n{'mode':17} {'workers':>7} {'episodes/s':>11} {'tokens/s':>9} {'x turn-by-turn':>15} {'s/gen':>7} "
        f"{'calls/ep':>9} {'turns/ep':>9} {'same episodes':>14}"
    )
    for r in rows:
        print(
            f"{r['mode']:17} {r['tool_workers']:7d} {r['episodes_per_s']:11.1f} {r['tokens_per_s']:9.0f} {r['speedup']:15.2f} "
            f"{r['seconds']:7.2f} {r['tool_calls_mean']:9.2f} {r['turns_mean']:9.2f} {str(r['same_episodes']):>14}"
        )
    return rows


if __name__ == "__main__":
    main()
