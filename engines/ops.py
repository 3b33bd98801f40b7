"""Token-level tensor ops shared by the engines: response slicing, log-probs, entropy, position ids.

Sequences are laid out as verl does: `input_ids = [left-padded prompt | right-padded response]`, with
`attention_mask` over both and `response_mask` over the response (1 up to and including EOS). The logits at
position t predict token t+1, so the response's log-probs come from positions P-1 .. P+R-2.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "compute_precision",
    "position_ids_from_mask",
    "response_logits",
    "token_log_probs",
    "entropy_from_logits",
    "response_mask_from_tokens",
    "stop_sequence_ends",
]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding (what HF generate uses), so padded and unpadded rows agree."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logits(logits: torch.Tensor, response_len: int) -> torch.Tensor:
    """Logits that predict the last `response_len` tokens."""
    return logits[:, -response_len - 1 : -1]


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), computed in float32."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def top_log_probs(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens' log-probs under softmax(logits / temperature) and their ids, (..., k) each."""
    return F.log_softmax(logits.float() / temperature, dim=-1).topk(k, dim=-1)


def support_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p of the tokens `ids` (..., k) under softmax(logits / temperature): a model's mass on another's
    support (distillation over the teacher's top-k)."""
    return F.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids.long())


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def response_mask_from_tokens(
    responses: torch.Tensor, eos_token_id: int, stop_sequences: tuple[tuple[int, ...], ...] = ()
) -> torch.Tensor:
    """1 for every response token up to and including the first EOS, or the last token of the first completed
    stop sequence (token ids; a multi-turn rollout's tool call ends with one), 0 after it."""
    is_end = (responses == eos_token_id) | stop_sequence_ends(responses, stop_sequences)
    after_end = (is_end.long().cumsum(-1) - is_end.long()) > 0
    return (~after_end).long()


def stop_sequence_ends(tokens: torch.Tensor, stop_sequences: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """(B, T) bool: True where one of `stop_sequences` (token ids) ends at that position."""
    ends = torch.zeros(tokens.shape, dtype=torch.bool)
    for seq in stop_sequences:
        n = len(seq)
        if n == 0 or n > tokens.shape[-1]:
            continue
        hits = (tokens.unfold(-1, n, 1) == torch.tensor(seq, dtype=tokens.dtype)).all(-1)
        ends[..., n - 1 :] |= hits
    return ends


def compute_precision(model: torch.nn.Module, dtype: torch.dtype | None) -> Any:
    """Autocast to `dtype` on the model's device type, or a no-op for None/float32."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    param = next(model.parameters(), None)
    device = param.device.type if param is not None else "cpu"
    return torch.autocast(device_type=device, dtype=dtype)
