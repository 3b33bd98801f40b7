"""The transformers generation engine: batched sampling with a KV cache, for machines without vLLM.

A short decode loop over a transformers model rather than `model.generate()`, for three reasons: each row samples
from its own seeded generator, so a sample does not depend on which rows share its batch (a run over 2 DP ranks
then draws the same samples as over 1); the log-probs of the sampled tokens come out of the same logits
(temperature applied, before top-k/top-p filtering, as `compute_log_prob` sees them); and the loop stops when every
row has finished, which is safe because the generation weights are unsharded on each rank (no collectives).
Greedy decoding gives the same tokens as `generate(do_sample=False)` (tested).

Output layout (verl's): prompts (B, P) left-padded; responses (B, R) right-padded to exactly `max_new_tokens`;
input_ids = prompts | responses; attention_mask; position_ids; response_mask (1 up to and including EOS);
rollout_log_probs (B, R).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.ops import position_ids_from_mask, response_mask_from_tokens
from flowactors import Batch

__all__ = ["SamplingConfig", "HFGenerationEngine"]


@dataclass
class SamplingConfig:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens (benchmarks with fixed token counts, as vLLM's ignore_eos)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0 (use greedy=True for argmax), "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


class HFGenerationEngine:
    """Sample responses from a transformers causal LM (`model` is unsharded on this rank)."""

    def __init__(self, eos_token_id: int, pad_token_id: int, max_context: int | None = None) -> None:
        self.eos, self.pad, self.max_context = eos_token_id, pad_token_id, max_context

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, prompts: Batch, cfg: SamplingConfig, *, greedy: bool = False,
                 seed: int = 0) -> Batch:
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        b, p = ids.shape
        if self.max_context is not None and p + cfg.max_new_tokens > self.max_context:
            raise ValueError(f"prompt length {p} + max_new_tokens {cfg.max_new_tokens} exceeds the model's context "
                             f"of {self.max_context} positions; shorten prompts or lower max_new_tokens")
        seeds = prompts["seed"].tolist() if "seed" in prompts else [seed * 1_000_003 + i for i in range(b)]
        # One uniform per row and step, drawn from the row's own generator up front: sampling is then one
        # vectorised inverse-CDF lookup per step, and a row's tokens do not depend on its batch.
        uniforms = torch.stack([torch.rand(cfg.max_new_tokens, generator=torch.Generator().manual_seed(int(s)),
                                           dtype=torch.float64) for s in seeds]) if b else torch.zeros(0, 1)
        model.eval()
        out_tokens = torch.full((b, cfg.max_new_tokens), self.pad, dtype=torch.long)
        out_logp = torch.zeros((b, cfg.max_new_tokens), dtype=torch.float32)
        done = torch.zeros(b, dtype=torch.bool)
        attn = mask.clone()
        pos = position_ids_from_mask(attn)
        cur, cache = ids, None
        for t in range(cfg.max_new_tokens):
            out = model(input_ids=cur, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            logits = out.logits[:, -1].float() / cfg.temperature
            logp = logits.log_softmax(-1)
            if greedy:
                tok = logits.argmax(-1)
            else:
                cdf = _filter(logits, cfg.top_k, cfg.top_p).softmax(-1).double().cumsum(-1)
                tok = (cdf < uniforms[:, t:t + 1] * cdf[:, -1:]).sum(-1).clamp(max=logits.shape[-1] - 1)
            tok = torch.where(done, torch.full_like(tok, self.pad), tok)
            out_tokens[:, t] = tok
            out_logp[:, t] = torch.where(done, torch.zeros(()), logp.gather(-1, tok[:, None])[:, 0])
            if not cfg.ignore_eos:
                done |= tok == self.eos
            if bool(done.all()):
                break
            cur = tok[:, None]
            attn = torch.cat([attn, torch.ones((b, 1), dtype=attn.dtype)], dim=1)  # finished rows are ignored
            pos = pos[:, -1:] + 1
        resp_mask = torch.ones_like(out_tokens) if cfg.ignore_eos else response_mask_from_tokens(out_tokens, self.eos)
        out_tokens = torch.where(resp_mask.bool(), out_tokens, torch.full_like(out_tokens, self.pad))
        full_mask = torch.cat([mask, resp_mask], dim=1)
        tensors = {
            "prompts": ids, "responses": out_tokens, "input_ids": torch.cat([ids, out_tokens], dim=1),
            "attention_mask": full_mask, "position_ids": position_ids_from_mask(full_mask),
            "response_mask": resp_mask, "rollout_log_probs": out_logp * resp_mask,
        }
        keep = {k: v for k, v in prompts.tensors.items() if k not in tensors and k not in ("input_ids",
                                                                                           "attention_mask")}
        return Batch({**keep, **tensors}, prompts.rows, prompts.meta)
