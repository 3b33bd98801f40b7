"""The actor's generation step with and without the 3D-HybridEngine, on one embedded cluster, in one run.

    python benchmarks/hybrid_actor.py --slots 4 --rows 32 --new-tokens 16

One TP = slots actor per mode, same model and prompts: "gather" (FSDP2 / DTensor TP; every rank gathers the whole
model and samples every row of its share: the all-gather baseline), and "hybrid t_g" for each t_g dividing the
TP size (Megatron-layout shards resharded inside micro-DP groups; each of the d_g generation replicas samples its
part of the rows under TP = t_g). Rounds interleave the modes; the figure is the median round. Prints one JSON
object per mode and a table: generate_sequences seconds and their ratio to "gather", bytes received and parameter
bytes held per rank for generation (the hybrid engine's own accounting; the gather path holds the whole model),
and what a rank holds beyond its training memory while generating.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> list[dict]:
    import torch

    import flowactors as fa
    from engines import ActorWorker
    from engines.hybrid import ModelGeometry
    from engines.models.config import ModelConfig, build_model, build_tokenizer
    from engines.rollout.stream import SamplingConfig
    from engines.specs import GenerationSpec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", action="store_true", help="print one JSON object per mode before the table")
    args = ap.parse_args(argv)
    t = args.slots
    cfg = ModelConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=8,
        intermediate_size=args.hidden * 3,
        pad_vocab_to=8,
        seed=0,
    )
    tok = build_tokenizer(cfg)
    model_bytes = sum(v.numel() * v.element_size() for v in build_model(cfg, "lm", tok).state_dict().values())
    geometry = ModelGeometry.from_hf_config(build_model(cfg, "lm", tok).config)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    enc = tok([f"sum {i * 37 % 1000}:" for i in range(args.rows)], padding=True, return_tensors="pt")
    prompts = fa.Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
    spec = GenerationSpec(seed=1)

    modes = {"gather": None, **{f"hybrid t_g={g}": g for g in range(1, t + 1) if t % g == 0}}
    rows: list[dict] = []
    with fa.Controller.local(t, dashboard=None) as ctl:
        groups = {
            name: fa.ActorGroup(
                ctl,
                ActorWorker,
                name=f"bench_{i}",
                layout=fa.Layout(tp=t),
                args=(cfg, None, sampling),
                kwargs={"rollout_tp": g},
            )
            for i, (name, g) in enumerate(modes.items())
        }
        times: dict[str, list[float]] = {name: [] for name in modes}
        outputs = {}
        for round_ in range(args.rounds + 1):  # round 0 warms up and is not counted
            for name, group in groups.items():
                start = time.perf_counter()
                outputs[name] = group.generate_sequences(prompts, spec).result()
                if round_:
                    times[name].append(time.perf_counter() - start)
        stats = {name: group.reshard_stats().result() for name, group in groups.items()}
        for group in groups.values():
            group.close()
    same = all(torch.equal(o["responses"], outputs["gather"]["responses"]) for o in outputs.values())
    base = statistics.median(times["gather"])
    for name in modes:
        st = stats[name]
        row = {
            "mode": name,
            "ranks": t,
            "model_bytes": model_bytes,
            "seconds": statistics.median(times[name]),
            "received_bytes_per_rank": [s["received_bytes"] for s in st] if st[0] else [model_bytes * (t - 1) // t] * t,
            "gen_param_bytes_per_rank": [s["gen_param_bytes"] for s in st] if st[0] else [model_bytes] * t,
            "redundant_bytes_per_rank": [s["redundant_bytes"] for s in st] if st[0] else [model_bytes // t] * t,
            "extra_bytes_during_generation_per_rank": [s["extra_generation_bytes"] for s in st]
            if st[0]
            else [model_bytes] * t,
            "bytes": "measured" if st[0] else "formula (the gather path does not count its bytes)",
            "same_tokens_as_gather": same,
        }
        rows.append(row)
        if args.json:
            print(json.dumps(row))
    print(
        f"\nactor TP={t}, {args.rows} rows x {args.new_tokens} new tokens, model {model_bytes / 2**20:.1f} MiB "
        f"({geometry.num_layers} layers); median of {args.rounds} rounds; tokens identical across modes: {same}"
    )
    print(
        f"{'mode':<14}{'generate s':>11}{'vs gather':>10}{'recv MiB/rank':>15}{'gen params MiB/rank':>21}"
        f"{'redundant MiB':>15}{'extra held MiB':>16}"
    )
    for row in rows:
        print(
            f"{row['mode']:<14}{row['seconds']:>11.3f}{row['seconds'] / base:>9.2f}x"
            f"{max(row['received_bytes_per_rank']) / 2**20:>15.2f}{max(row['gen_param_bytes_per_rank']) / 2**20:>21.2f}"
            f"{max(row['redundant_bytes_per_rank']) / 2**20:>15.2f}"
            f"{max(row['extra_bytes_during_generation_per_rank']) / 2**20:>16.2f}"
        )
    print(
        "gather: bytes by formula, not counted: every rank receives (t-1)/t of the model and holds a whole copy "
        "beside its training shard"
    )
    return rows


if __name__ == "__main__":
    main()
