"""End-to-end GRPO throughput: flowactors against TRL's GRPOTrainer on the same tiny configuration, in one run.

    python benchmarks/e2e.py [--json] [--steps 12]

The configuration of the TRL baseline (../shared/ref/peers/trl_grpo_cpu.py): a 340 k-parameter Llama (hidden 128,
2 layers, 4 heads), a character tokenizer, 8 prompts x 4 samples, 16-token prompts, exactly 32 new tokens,
beta 0.04, fp32, the "fraction of digits" reward. Tokens per second = (prompt + response tokens per step) / step
time, median over the steps after the first two. `controller_share` is the fraction of step time in which no
worker was computing (the single controller's overhead plus Dask's scheduling). TRL runs only when installed.
`--compare-open` adds `fa-open`: the same run on an embedded cluster without the run's credentials (docs/security.md).

flowactors runs the actor over 2 data-parallel ranks under the 3D-HybridEngine (`rollout_tp=1`: whole replicas,
gradients averaged, Adam state sharded ZeRO-1, generation from the rank's own replica) rather than FSDP2, whose
per-layer all-gathers and reduce-scatters in every decode step and backward dominate at 340 k parameters (~17 %
more tokens/s on the 2-core machine). The settings TRL shares (model, batch, lengths, loss) are the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = [
    "task=digits",
    "sft_steps=0",
    "prompts_per_step=8",
    "samples_per_prompt=4",
    "mini_batch_samples=32",
    "max_new_tokens=32",
    "ignore_eos=true",
    "kl_coef=0.04",
    "actor_lr=1e-4",
    "model.hidden_size=128",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.intermediate_size=256",
    "model.max_position_embeddings=128",
    "dashboard=none",
    "rollout_tp=1",
]


def flowactors_row(steps: int, secure: bool = True) -> dict:
    """Throughput from a plain run; the controller share from a second, profiled run (the task-stream plugin
    that measures it slows the scheduler, so it must not distort the throughput figure). `secure=False`: the
    embedded cluster without the run's credentials (row `fa-open`)."""
    from algorithms.grpo import main

    settings = [*SETTINGS, f"secure={str(secure).lower()}"]
    history = main(["--steps", str(steps), *settings])[2:]
    profiled = main(["--steps", "6", *settings, "profile_controller=true"])[2:]
    return {
        "system": "flowactors" if secure else "fa-open",
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in history), 1),
        "controller_share": round(statistics.median(r["controller_share"] for r in profiled), 4),
        "step_s": round(statistics.median(r["step_s"] for r in history), 4),
    }


def trl_row(steps: int, python: str) -> dict | None:
    """TRL in `python` (its own environment if TRL's pins differ from ours)."""
    probe = subprocess.run([python, "-c", "import trl, datasets"], capture_output=True)
    if probe.returncode:
        print(
            f"# trl not importable by {python}: no trl row (pip install trl==1.16.0 datasets, or --trl-python)",
            file=sys.stderr,
        )
        return None
    script = ROOT.parent / "shared" / "ref" / "peers" / "trl_grpo_cpu.py"
    if not script.exists():
        print(f"# {script} not found: no trl row", file=sys.stderr)
        return None
    out = subprocess.run(
        [python, str(script), "grpo"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "STEPS": str(steps)},
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT"))
    fields = dict(kv.split("=", 1) for kv in line.split()[1:])
    return {
        "system": "trl",
        "tokens_per_s": float(fields["tok_per_s"]),
        "controller_share": None,
        "step_s": float(fields["median_step_s"]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--trl-python", default=sys.executable, help="interpreter of an environment with trl installed")
    p.add_argument(
        "--compare-open",
        action="store_true",
        help="also a run on an embedded cluster without the run's credentials (secure=false): the cost "
        "of TLS and the direct path's handshake end to end",
    )
    args = p.parse_args(argv)
    opened = [flowactors_row(args.steps, secure=False)] if args.compare_open else []
    rows = [r for r in (flowactors_row(args.steps), *opened, trl_row(args.steps, args.trl_python)) if r]
    if args.json:
        for r in rows:
            print(json.dumps(r))
    base = next((r["tokens_per_s"] for r in rows if r["system"] == "trl"), None)
    print(f"\n{'system':<12} {'tokens/s':>10} {'step s':>8} {'controller share':>17} {'vs trl':>8}")
    for r in rows:
        share = f"{r['controller_share']:.1%}" if r["controller_share"] is not None else "-"
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{r['system']:<12} {r['tokens_per_s']:>10.1f} {r['step_s']:>8.3f} {share:>17} {ratio:>8}")


if __name__ == "__main__":
    main()
