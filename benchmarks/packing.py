"""Sequence packing against padding: the scoring and training passes of one PPO step on long-tailed lengths.

    python benchmarks/packing.py [--json] [--samples 128] [--prompt 32] [--max-response 256] [--mean-response 32]

One embedded cluster, one slot; per mode an actor, a reference and a critic (a small Llama, the same weights in
both modes) run PPO's five passes over the same synthetic batch: the actor's and the reference's log-probs, the
critic's values, then one actor update (PPO's clipped loss) and one critic update. Prompts are 4..`prompt` tokens,
responses drawn from an exponential distribution of mean `mean-response`, capped at `max-response` (the long tail
that makes a batch as wide as its longest row). tokens/s = valid (unpadded) tokens x 5 passes / seconds of the
five calls, median of `--repeats`; the last column is the largest difference of the packed actor's log-probs from
the padded ones over the response tokens (they must agree). JSON lines with --json, then a table.
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


def long_tailed_batch(samples: int, prompt: int, max_response: int, mean_response: float, seed: int = 0):
    """[left-padded prompt | right-padded response] rows with PPO's inputs (old log-probs, advantages, values,
    returns) filled with plausible numbers."""
    import torch

    import flowactors as fa

    g = torch.Generator().manual_seed(seed)
    width = prompt + max_response
    ids = torch.randint(3, 40, (samples, width), generator=g)  # inside the character vocabulary
    mask = torch.ones_like(ids)
    p_len = torch.randint(4, prompt + 1, (samples,), generator=g)
    u = torch.rand(samples, generator=g)
    r_len = (-mean_response * torch.log1p(-u)).long().clamp(1, max_response)
    r_len[0] = max_response  # the longest row the batch is padded to
    for i in range(samples):
        mask[i, : prompt - p_len[i]] = 0
        mask[i, prompt + r_len[i] :] = 0
    ids = ids * mask
    resp_mask = mask[:, prompt:].clone()
    randn = lambda: torch.randn(samples, max_response, generator=g) * resp_mask  # noqa: E731
    return fa.Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, prompt:],
            "response_mask": resp_mask,
            "advantages": randn(),
            "returns": randn(),
            "values": randn(),
            "old_log_probs": randn() * 0.1 - 4.0,
        }
    )


def row(ctl, mode: str, batch, args) -> dict:
    import flowactors as fa
    from algorithms.objectives.losses import PolicyLoss, ValueLoss
    from engines import ActorWorker, CriticWorker, ModelConfig, OptimConfig, RefWorker, UpdateSpec

    model = ModelConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=args.hidden * 3,
        max_position_embeddings=512,
        pack_sequences=mode == "packed",
    )
    optim = OptimConfig(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens)
    slots = ctl.slots[:1]
    groups = [
        fa.ActorGroup(ctl, ActorWorker, name=f"actor_{mode}", slots=slots, args=(model, optim)),
        fa.ActorGroup(ctl, RefWorker, name=f"ref_{mode}", slots=slots, args=(model,)),
        fa.ActorGroup(ctl, CriticWorker, name=f"critic_{mode}", slots=slots, args=(model, optim)),
    ]
    actor, ref, critic = groups
    spec = UpdateSpec(mini_batch_samples=len(batch), epochs=1, shuffle_seed=0)
    try:
        times, log_probs = [], None
        for _ in range(args.repeats + 1):  # the first round warms up
            t0 = time.perf_counter()
            lp = actor.compute_log_prob(batch)
            rlp = ref.compute_ref_log_prob(batch)
            values = critic.compute_values(batch)
            if log_probs is None:  # the first round's: before any update, in both modes
                log_probs = lp.result()
            lp.result(), rlp.result(), values.result()
            actor.update_actor(batch, PolicyLoss(), spec).result()
            critic.update_critic(batch, ValueLoss(), spec).result()
            times.append(time.perf_counter() - t0)
    finally:
        for g in groups:
            g.close()
    seconds = statistics.median(times[1:])
    tokens = int(batch["attention_mask"].sum())
    return {
        "mode": mode,
        "tokens_per_s": tokens * 5 / seconds,
        "step_s": seconds,
        "valid_tokens": tokens,
        "padded_tokens": int(batch["attention_mask"].numel()),
        "log_probs": log_probs["old_log_probs"],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line per row before the table")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--max-response", type=int, default=256)
    ap.add_argument("--mean-response", type=float, default=32.0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    import flowactors as fa

    batch = long_tailed_batch(args.samples, args.prompt, args.max_response, args.mean_response)
    ctl = fa.Controller.local(1, dashboard=None, collective_timeout_s=1200, call_timeout_s=3600)
    try:
        rows = [row(ctl, mode, batch, args) for mode in ("padded", "packed")]
    finally:
        ctl.close()
    valid = batch["response_mask"].bool()
    gap = float((rows[1]["log_probs"] - rows[0]["log_probs"])[valid].abs().max())
    for r in rows:
        del r["log_probs"]
        r["max_log_prob_gap"] = gap
    if args.json:
        for r in rows:
            print(json.dumps(r))
    base = rows[0]["tokens_per_s"]
    print(
        f"\n{'mode':8} {'tokens/s':>9} {'x padded':>9} {'step s':>7} {'valid tokens':>13} {'padded tokens':>14} "
        f"{'max |dlogp|':>12}"
    )
    for r in rows:
        print(
            f"{r['mode']:8} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base:9.2f} {r['step_s']:7.2f} "
            f"{r['valid_tokens']:13d} {r['padded_tokens']:14d} {r['max_log_prob_gap']:12.2e}"
        )
    return rows


if __name__ == "__main__":
    main()
