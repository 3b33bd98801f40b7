"""LoRA against full-parameter training of the same actor: memory, update time, checkpoint size, generation.

    python benchmarks/lora.py [--json] [--hidden 512] [--layers 4] [--rank 8] [--samples 32] [--response 128]

One process, the torch engine (what every rank of a data-parallel actor runs): a Llama of the given width with
a 32,000-token vocabulary (a real model's embedding and head), trained by one policy-gradient update over
`samples` rows of 32 + `response` tokens, median of `--repeats` updates after a warm-up. Memory is counted, not
sampled: trainable parameters, their gradients and the optimizer state (AdamW, two float32 moments). The checkpoint
is what `checkpoint_state()` holds (full: every weight and its moments; LoRA: the adapters and theirs). Generation:
tokens/s of 32 rows x 64 sampled tokens with the hf engine, from the training model (LoRA's hooks live: what an
unsharded actor samples from) and from the merged plain model (what a sharded actor's gathered copy, an export or
vLLM holds). JSON lines with --json, then a table.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _batch(samples: int, response: int, vocab: int):
    import torch

    from flowactors import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (samples, 32 + response), generator=g)
    mask = torch.ones_like(ids)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, 32:],
            "response_mask": mask[:, 32:],
            "advantages": torch.randn(samples, response, generator=g),
        }
    )


def _pg_loss(out, mb):
    return -(out["log_probs"] * mb["advantages"]), mb["response_mask"].float(), {}


def row(mode: str, args) -> dict:
    import torch
    import transformers

    from engines import OptimConfig, SamplingConfig
    from engines.rollout.hf import HFGenerationEngine
    from engines.training.lora import apply_lora
    from engines.training.torch_native import TrainEngine
    from flowactors import Batch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=args.hidden * 3,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config)
    optim = OptimConfig(lr=1e-4, micro_batch_tokens=8192, lora_rank=args.rank if mode == "lora" else 0)
    if optim.lora:
        apply_lora(model, optim.lora)
    engine = TrainEngine(model, optim, lora_scale=optim.lora.scale if optim.lora else None)
    batch = _batch(args.samples, args.response, config.vocab_size)
    times = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        engine.update([batch], _pg_loss, lambda mb: engine.policy_outputs(mb, 1.0, False))
        times.append(time.perf_counter() - t0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable if p.grad is not None)
    buf = io.BytesIO()
    torch.save(engine.checkpoint_state(), buf)

    gen = HFGenerationEngine(2, 0)
    prompts = Batch(
        {
            "input_ids": batch["input_ids"][:32, :32],
            "attention_mask": batch["attention_mask"][:32, :32],
            "seed": torch.arange(32),
        }
    )
    sampling = SamplingConfig(max_new_tokens=64, ignore_eos=True)

    def tokens_per_s(net) -> float:
        net.eval()
        with torch.no_grad():
            gen.generate(net, prompts, SamplingConfig(max_new_tokens=4, ignore_eos=True))  # warm-up
            t0 = time.perf_counter()
            gen.generate(net, prompts, sampling)
        return 32 * 64 / (time.perf_counter() - t0)

    live = tokens_per_s(model)
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(engine.full_state_dict())
    merged = tokens_per_s(plain)
    return {
        "mode": mode,
        "trainable_params": sum(p.numel() for p in trainable),
        "total_params": sum(p.numel() for p in model.parameters()),
        "grad_mb": grads / 2**20,
        "optimizer_mb": engine.optimizer_state_bytes() / 2**20,
        "checkpoint_mb": buf.getbuffer().nbytes / 2**20,
        "update_s": statistics.median(times[1:]),
        "generate_tokens_per_s": live,
        "generate_merged_tokens_per_s": merged,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line per row before the table")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = [row(mode, args) for mode in ("full", "lora")]
    if args.json:
        for r in rows:
            print(json.dumps(r))
    full = rows[0]
    print(
        f"\n{'mode':5} {'trainable':>11} {'grad MB':>8} {'optim MB':>9} {'ckpt MB':>8} {'update s':>9} "
        f"{'x full':>7} {'gen tok/s':>10} {'merged tok/s':>13}"
    )
    for r in rows:
        print(
            f"{r['mode']:5} {r['trainable_params']:11d} {r['grad_mb']:8.1f} {r['optimizer_mb']:9.1f} "
            f"{r['checkpoint_mb']:8.1f} {r['update_s']:9.3f} {full['update_s'] / r['update_s']:7.2f} "
            f"{r['generate_tokens_per_s']:10.0f} {r['generate_merged_tokens_per_s']:13.0f}"
        )
    return rows


if __name__ == "__main__":
    main()
