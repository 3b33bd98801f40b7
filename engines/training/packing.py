"""Sequence packing: forward passes over rows of different lengths without padding.

A padded micro-batch spends compute on every pad token: `[left-padded prompt | right-padded response]` rows are as
wide as the batch's longest, so on a long-tailed length distribution most of a forward pass is padding. Packing
lays the valid tokens of several rows end to end in *bins* as wide as the batch (first-fit decreasing), with
position ids restarting at 0 for each row; transformers then builds a block-diagonal causal mask from those
positions (a new sequence wherever the position does not step by one; attention_mask must be None), so every row
sees only its own tokens, exactly as in its padded row. Bins are no wider than a padded row, so attention costs
no more per token than padding does, while micro-batches are chosen by *valid* tokens, so each forward pass holds
as many real tokens as the budget allows.

The outputs come back in the padded layout the losses read: (B, R) over the response (positions past a row's
response, which padding would fill with values at pad tokens, hold the row's last valid output and are masked
by `response_mask` downstream), and one position per row for a score head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.ops import position_ids_from_mask
from flowactors import Batch

__all__ = ["Packed", "pack", "packed_micro_batches", "check_packable"]


@dataclass
class Packed:
    """One micro-batch's rows packed into bins, and where each row's outputs lie in them."""

    input_ids: torch.Tensor
    """(bins, width) token ids; a bin's unused tail is pad tokens forming a sequence of their own."""
    position_ids: torch.Tensor
    """(bins, width) positions, 0 at each row's first valid token."""
    response_index: torch.Tensor | None
    """(B, R) flat indices into bins × width of the outputs that predict each response token (None: no
    responses, a score-only batch)."""
    last_index: torch.Tensor
    """(B,) flat index of each row's last non-pad token (where a score head reads)."""

    def gather(self, out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """`out` (bins, width, ...) at the flat `index` (any shape) → index.shape + out's trailing dims."""
        flat = out.reshape(-1, *out.shape[2:])
        return flat[index.reshape(-1)].reshape(*index.shape, *out.shape[2:])


def pack(mb: Batch, pad_token_id: int, width: int | None = None) -> Packed:
    """Pack `mb`'s valid tokens (attention_mask == 1) into bins of `width` (default: the batch's width)."""
    ids, mask = mb["input_ids"], mb["attention_mask"].bool()
    pos = mb["position_ids"] if "position_ids" in mb else position_ids_from_mask(mb["attention_mask"])
    rows, total = ids.shape
    width = width or total
    lengths = mask.sum(-1).tolist()
    if max(lengths, default=0) > width:
        raise ValueError(f"a row of {max(lengths)} tokens does not fit a bin of {width}")
    # first-fit decreasing: the longest rows open bins, the short ones fill their tails
    fill: list[int] = []
    place = [0] * rows  # flat start of each row
    for r in sorted(range(rows), key=lambda r: (-lengths[r], r)):
        b = next((b for b, used in enumerate(fill) if used + lengths[r] <= width), None)
        if b is None:
            b = len(fill)
            fill.append(0)
        place[r] = b * width + fill[b]
        fill[b] += lengths[r]
    bins = max(len(fill), 1)
    out_ids = torch.full((bins * width,), pad_token_id, dtype=ids.dtype)
    out_pos = torch.zeros(bins * width, dtype=pos.dtype)
    for b, used in enumerate(fill):  # a bin's pad tail: positions of a sequence of its own
        out_pos[b * width + used : (b + 1) * width] = torch.arange(width - used)
    for r in range(rows):
        n = lengths[r]
        out_ids[place[r] : place[r] + n] = ids[r][mask[r]]
        out_pos[place[r] : place[r] + n] = pos[r][mask[r]]
    start = torch.tensor(place, dtype=torch.long)
    length = torch.tensor(lengths, dtype=torch.long)
    # the last non-pad token, where transformers' sequence-classification heads read a padded row
    rank = mask.long().cumsum(-1) - 1  # each position's index among its row's valid tokens
    last = torch.where(mask & (ids != pad_token_id), rank, -1).amax(-1) if rows else length
    last_index = start + torch.where(last < 0, length - 1, last)
    response_index = None
    if "responses" in mb:
        resp = mb["responses"].shape[1]
        prompt = mask[:, : total - resp].sum(-1)  # valid prompt tokens per row
        # logits at position t predict token t+1: the response's come from prompt-1 .. prompt+R-2, clamped
        # inside the row's own tokens for the pad positions past its response
        offsets = (prompt.unsqueeze(1) - 1 + torch.arange(resp)).clamp(max=(length - 1).unsqueeze(1))
        response_index = start.unsqueeze(1) + offsets
    return Packed(out_ids.view(bins, width), out_pos.view(bins, width), response_index, last_index)


def packed_micro_batches(batch: Batch, budget: int) -> list[Batch]:
    """Consecutive rows whose valid tokens sum to at most `budget` (a row longer than it goes alone)."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    out, start, used = [], 0, 0
    for r, n in enumerate(lengths):
        if r > start and used + n > budget:
            out.append(batch.slice(start, r))
            start, used = r, 0
        used += n
    if len(batch):
        out.append(batch.slice(start, len(batch)))
    return out


def check_packable(model: torch.nn.Module) -> None:
    """Refuse a model whose attention cannot separate packed rows: transformers builds the block-diagonal mask from
    position ids in `create_causal_mask`, so the decoder must build its mask there, with an attention
    implementation that takes such a mask."""
    import inspect

    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None) or "eager"
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        source = ""
    if "create_causal_mask" not in source:
        raise ValueError(
            f"pack_sequences: {type(model).__name__}'s attention cannot take packed rows (its decoder "
            f"does not build its mask with transformers' create_causal_mask, which separates rows by "
            f"position ids); set pack_sequences=false"
        )
    if attn not in ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"):
        raise ValueError(
            f"pack_sequences: attention implementation {attn!r} of {type(model).__name__} cannot take "
            f"packed rows; use sdpa or eager, or set pack_sequences=false"
        )
