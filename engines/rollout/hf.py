"""The transformers generation engine: batched sampling with a KV cache, for machines without vLLM.

A short decode loop over a transformers model rather than `model.generate()`, for three reasons: each row samples
from its own seeded generator, so a sample does not depend on which rows share its batch (a run over 2 DP ranks
then draws the same samples as over 1); the log-probs of the sampled tokens come out of the same logits
(temperature applied, before top-k/top-p filtering, as `compute_log_prob` sees them); and the loop stops when every
row has finished, which is safe because the generation weights are unsharded on each rank (no collectives).
Greedy decoding gives the same tokens as `generate(do_sample=False)` (tested).

The output layout, streaming and the long-tail protocol are shared with the vLLM engine (engines.rollout.stream);
what is this engine's own: a stream can pause once few rows still run and hand each row's state over with its KV
cache and sampling uniforms, and a stream can admit such states into its running batch, each at the step it paused
at. The admitted rows, and the receiver's own rows from then on, decode in another batch than they would have alone:
their tokens come from their own uniforms, their log-probs may differ in the last bit.

`SamplingConfig.evict_finished` drops finished rows from the running batch and its KV cache, so a long tail
decodes only the rows still running: the shrinking half of continuous batching. New prompts are not admitted
mid-loop (every prompt of a call is known when it starts, and their KV caches would be ragged); only migrated rows
join, at their own step. It is
off by default because smaller matmuls round differently: on this machine's CPU kernels the rollout log-probs
then differ from the full-batch loop's in the last bit (the tokens did not, in our checks).
"""

from __future__ import annotations

import queue
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engines.ops import compute_precision, position_ids_from_mask
from engines.rollout.stream import (
    ROW_INDEX,
    TAIL_PREFIX,
    TAIL_STEP,
    Arrivals,
    SamplingConfig,
    assemble_samples,
    check_stream,
    chunk_of,
    row_seeds,
    stop_lengths,
    stream_chunks,
    tail_prompts,
)
from flowactors import Batch

__all__ = ["HFGenerationEngine", "cache_argument"]


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

    holds_weights = False
    """It samples from the module each call hands it (engines.interfaces.GenerationEngine)."""
    migrates = True
    """`stream` can pause (`pause_below`) and receive paused decodes (`inbox`): long-tail migration."""

    def __init__(
        self,
        eos_token_id: int,
        pad_token_id: int,
        max_context: int | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`compute_dtype`: autocast dtype of the decoding forwards (a float32-master model sampling in bf16);
        applied inside the decode loop, so also in a streaming thread."""
        self.eos, self.pad, self.max_context = eos_token_id, pad_token_id, max_context
        self.compute_dtype = compute_dtype

    def generate(
        self,
        model: torch.nn.Module,
        prompts: Batch,
        cfg: SamplingConfig,
        *,
        greedy: bool = False,
        seed: int = 0,
        seed_offset: int = 0,
    ) -> Batch:
        """Sample every row. A row without a `seed` column draws from seed·1000003 + seed_offset + its index, so a
        caller that samples rows a:b of a batch separately passes seed_offset=a and gets the same samples."""
        loop = self._start(prompts, cfg, seed=seed, seed_offset=seed_offset)
        for _ in self._steps(model, cfg, loop, greedy=greedy):
            pass
        return self._assemble(prompts, loop.tokens, loop.logp, cfg)

    def stream(
        self,
        model: torch.nn.Module,
        prompts: Batch,
        cfg: SamplingConfig,
        chunk_rows: int,
        *,
        greedy: bool = False,
        seed: int = 0,
        row_offset: int = 0,
        seed_offset: int = 0,
        pause_below: int | None = None,
        inbox: "queue.Queue[Batch | None] | None" = None,
    ) -> Iterator[Batch]:
        """The samples of `generate()` (with the same `seed_offset`), yielded as chunks of `chunk_rows` finished
        rows in the order they finish (rows finishing at the same step by index; the last chunk may be shorter).
        Each chunk has `row_index`: the row's index in `prompts` plus `row_offset` (a data-parallel rank passes its
        share's offset).

        Long-tail migration, the two sides. `pause_below=m`: decoding stops once 1..m rows are still running; the
        finished rows not yet handed out come as a last, shorter chunk, and then the running rows' decode state (a
        batch with a `TAIL_STEP` field, about as large as their KV cache) for another rank to finish. `inbox`: the
        receiving side; decoding goes on while other ranks' paused states arrive in the queue, and each joins the
        running batch (see `_admit_arrivals`); their rows come out in the chunks, with their own `row_index`. The
        stream ends once every row has finished and the queue has delivered None."""
        check_stream(chunk_rows, pause_below, len(prompts))
        loop = self._start(prompts, cfg, seed=seed, seed_offset=seed_offset, row_offset=row_offset)
        steps = self._steps(model, cfg, loop, greedy=greedy, pause_below=pause_below, inbox=inbox)
        return stream_chunks(steps, chunk_rows, lambda rows: self._chunk(loop, rows, cfg), _tail_of)

    def _start(
        self, prompts: Batch, cfg: SamplingConfig, *, seed: int, seed_offset: int, row_offset: int = 0
    ) -> "_Loop":
        """The loop's state before step 0: buffers, each row's sampling uniforms, and the running batch."""
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        b, p = ids.shape
        if self.max_context is not None and p + cfg.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt length {p} + max_new_tokens {cfg.max_new_tokens} exceeds the model's context "
                f"of {self.max_context} positions; shorten prompts or lower max_new_tokens"
            )
        seeds = row_seeds(prompts, seed, seed_offset)
        # One uniform per row and step, drawn from the row's own generator up front: sampling is then one
        # vectorised inverse-CDF lookup per step, and a row's tokens do not depend on its batch.
        uniforms = (
            torch.stack(
                [
                    torch.rand(cfg.max_new_tokens, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64)
                    for s in seeds
                ]
            )
            if b
            else torch.zeros((0, cfg.max_new_tokens), dtype=torch.float64)
        )
        attn = mask.clone()
        return _Loop(
            prompts,
            torch.full((b, cfg.max_new_tokens), self.pad, dtype=torch.long),
            torch.zeros((b, cfg.max_new_tokens), dtype=torch.float32),
            uniforms,
            torch.arange(b) + row_offset,
            stop_lengths(prompts),
            torch.zeros(b, dtype=torch.bool),
            torch.zeros(b, dtype=torch.bool),
            torch.arange(b),
            ids,
            attn,
            position_ids_from_mask(attn),
        )

    @torch.no_grad()
    def _steps(
        self,
        model: torch.nn.Module,
        cfg: SamplingConfig,
        loop: "_Loop",
        *,
        greedy: bool,
        pause_below: int | None = None,
        until: int | None = None,
        inbox: "queue.Queue[Batch | None] | None" = None,
    ) -> Generator[list[int], None, "_Loop | None"]:
        """Decode steps from `loop.t`, filling `loop.tokens` / `loop.logp`; after each step, yield the rows
        (buffer indices) that finished in it. Stops before step `until` (the loop stays resumable), or, with
        `pause_below`, once 1..pause_below rows are still running (returning the loop); with `inbox`, admits the
        paused decodes that arrive there (see `_admit_arrivals`) and ends once the queue delivered None.

        `loop.live` holds the rows of the running batch: every row, unless `evict_finished` drops finished ones.
        A row that finished but stays in the batch keeps decoding, and its outputs are overwritten with pad/0."""
        model.eval()
        cache_arg = cache_argument(model)
        arrivals = Arrivals(inbox)
        end = cfg.max_new_tokens if until is None else min(until, cfg.max_new_tokens)
        while True:
            if not arrivals.done or arrivals.waiting:
                yield from self._admit_arrivals(model, cfg, loop, arrivals, greedy=greedy)
            if not loop.running() or loop.t >= end:
                return None
            t, live, done = loop.t, loop.live, loop.done
            with compute_precision(model, self.compute_dtype):
                out = model(
                    input_ids=loop.cur,
                    attention_mask=loop.attn,
                    position_ids=loop.pos,
                    use_cache=True,
                    **{cache_arg: loop.cache},
                )
            loop.cache = getattr(out, "cache", None) or out.past_key_values
            logits = out.logits[:, -1].float() / cfg.temperature
            logp = logits.log_softmax(-1)
            if greedy:
                tok = logits.argmax(-1)
            else:
                cdf = _filter(logits, cfg.top_k, cfg.top_p).softmax(-1).double().cumsum(-1)
                tok = (cdf < loop.uniforms[live, t : t + 1] * cdf[:, -1:]).sum(-1).clamp(max=logits.shape[-1] - 1)
            was_done = done[live]
            tok = torch.where(was_done, torch.full_like(tok, self.pad), tok)
            loop.tokens[live, t] = tok
            loop.logp[live, t] = torch.where(was_done, torch.zeros(()), logp.gather(-1, tok[:, None])[:, 0])
            now_done = was_done
            if not cfg.ignore_eos:
                now_done = now_done | (tok == self.eos)
                for seq in cfg.stop_sequences:
                    if t + 1 >= len(seq):
                        window = loop.tokens[live, t + 1 - len(seq) : t + 1]
                        now_done = now_done | (window == torch.tensor(seq)).all(-1)
            if loop.stop is not None:
                now_done = now_done | (loop.stop[live] <= t + 1)
            done[live] = now_done
            ended = now_done if t < cfg.max_new_tokens - 1 else torch.ones_like(now_done)
            finished = live[ended & ~loop.reported[live]]
            loop.reported[finished] = True
            loop.t = t + 1
            yield finished.tolist()
            if t == cfg.max_new_tokens - 1:
                done[live] = True  # every row has all its tokens
                continue
            loop.cur = tok[:, None]
            loop.attn = torch.cat([loop.attn, torch.ones((len(live), 1), dtype=loop.attn.dtype)], dim=1)
            loop.pos = loop.pos[:, -1:] + 1
            if cfg.evict_finished and bool(now_done.any()):
                keep = (~now_done).nonzero()[:, 0]
                _select_rows(loop.cache, keep)
                loop.live, loop.cur, loop.attn, loop.pos = live[keep], loop.cur[keep], loop.attn[keep], loop.pos[keep]
            if pause_below is not None and 0 < int((~done).sum()) <= pause_below:
                return loop

    def _admit_arrivals(
        self, model: torch.nn.Module, cfg: SamplingConfig, loop: "_Loop", arrivals: "Arrivals", *, greedy: bool
    ) -> Generator[list[int], None, None]:
        """Join the paused decodes that have arrived to the running batch, at a step boundary.

        Rows join with their KV caches, which must be as long as those of the rows running here, so a decode that
        paused at this step joins at once, those that paused earlier first decode on their own (together, each
        joining them at its step) until this step, yielding the rows that finish meanwhile, and one that paused
        later waits until the batch gets there. When nothing is running, the earliest one joins at its own step;
        with nothing running and nothing waiting, this blocks until more arrive or the queue is closed."""
        while True:
            arrivals.collect(block=not loop.running() and not arrivals.waiting)
            if not loop.running() and arrivals.waiting:
                first = min(arrivals.waiting, key=_step)
                arrivals.waiting.remove(first)
                loop.append(_Loop.of_tail(first), restart=True)
            due = sorted((t for t in arrivals.waiting if _step(t) <= loop.t), key=_step)
            if due:
                arrivals.waiting = [t for t in arrivals.waiting if _step(t) > loop.t]
                yield from self._join(model, cfg, loop, due, greedy=greedy)
            if loop.running() or (arrivals.done and not arrivals.waiting):
                return

    def _join(
        self, model: torch.nn.Module, cfg: SamplingConfig, loop: "_Loop", tails: list[Batch], *, greedy: bool
    ) -> Generator[list[int], None, None]:
        """Bring `tails` (by step, none later than the batch's) up to the batch's step in one batch of their own,
        then join it; the rows that finish on the way are reported as the batch's rows."""
        part, finished = _Loop.of_tail(tails[0]), []
        for later in [*tails[1:], None]:
            until = loop.t if later is None else _step(later)
            finished += [row for rows in self._steps(model, cfg, part, greedy=greedy, until=until) for row in rows]
            if later is not None:
                part.append(_Loop.of_tail(later))
        offset = len(loop.index)
        loop.append(part)
        if finished:
            yield [offset + row for row in finished]

    def _assemble(self, prompts: Batch, out_tokens: torch.Tensor, out_logp: torch.Tensor, cfg: SamplingConfig) -> Batch:
        return assemble_samples(
            prompts,
            out_tokens,
            out_logp,
            eos=self.eos,
            pad=self.pad,
            ignore_eos=cfg.ignore_eos,
            stop_sequences=cfg.stop_sequences,
        )

    def _chunk(self, loop: "_Loop", rows: list[int], cfg: SamplingConfig) -> Batch:
        return chunk_of(loop.prompts, loop.tokens, loop.logp, loop.index, rows, cfg, eos=self.eos, pad=self.pad)


@dataclass
class _Loop:
    """A decode loop's state. Per buffer row: its prompt, tokens and log-probs so far, sampling uniforms,
    `row_index` (`index`), stop length, done and reported flags. Per row of the running batch (`live`: their buffer
    rows): the next input (`cur`), attention mask, positions and KV cache. `t`: the next step."""

    prompts: Batch
    tokens: torch.Tensor
    logp: torch.Tensor
    uniforms: torch.Tensor
    index: torch.Tensor
    stop: torch.Tensor | None
    done: torch.Tensor
    reported: torch.Tensor
    live: torch.Tensor
    cur: torch.Tensor | None = None
    attn: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    cache: Any = None
    t: int = 0

    @classmethod
    def of_tail(cls, tail: Batch) -> "_Loop":
        """A paused decode's state (`_tail_of`), every row running."""
        n, step = len(tail), _step(tail)
        layers = len([k for k in tail.keys() if k.startswith(TAIL_PREFIX + "key.")])
        cache = _dynamic_cache(
            [(tail[f"{TAIL_PREFIX}key.{j}"], tail[f"{TAIL_PREFIX}value.{j}"]) for j in range(layers)]
        )
        prompts = tail_prompts(tail)
        tokens = tail[TAIL_PREFIX + "tokens"].clone()
        return cls(
            prompts,
            tokens,
            tail[TAIL_PREFIX + "logp"].clone(),
            tail[TAIL_PREFIX + "uniforms"],
            tail[ROW_INDEX],
            stop_lengths(prompts),
            torch.zeros(n, dtype=torch.bool),
            torch.zeros(n, dtype=torch.bool),
            torch.arange(n),
            tokens[:, step - 1 : step],
            tail[TAIL_PREFIX + "attn"],
            tail[TAIL_PREFIX + "pos"],
            cache,
            step,
        )

    def running(self) -> bool:
        return bool(len(self.live)) and not bool(self.done[self.live].all())

    def append(self, other: "_Loop", *, restart: bool = False) -> None:
        """Take `other`'s rows into the buffers and its running rows into the running batch, which then runs at
        `other.t`: the rows running here must be at that step too, unless `restart` (nothing runs here; the
        finished rows leave the running batch)."""
        offset = len(self.index)
        self.prompts = Batch.concat([self.prompts, other.prompts])
        for name in ("tokens", "logp", "uniforms", "index", "done", "reported"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.stop = stop_lengths(self.prompts)
        keep = torch.zeros(0, dtype=torch.long) if restart else (~self.done[self.live]).nonzero()[:, 0]
        incoming = (~other.done[other.live]).nonzero()[:, 0]
        if len(keep) and len(incoming) and self.t != other.t:
            raise RuntimeError(f"rows running at step {self.t} cannot join rows at step {other.t}")
        parts = [(self, keep, 0), (other, incoming, offset)]
        parts = [(loop, rows, shift) for loop, rows, shift in parts if len(rows)]
        self.live = torch.cat(
            [torch.zeros(0, dtype=torch.long), *(loop.live[rows] + shift for loop, rows, shift in parts)]
        )
        if not parts:
            self.cur = self.attn = self.pos = self.cache = None
            self.t = max(self.t, other.t)
            return
        self.cur, self.attn, self.pos = (
            torch.cat([getattr(loop, name)[rows] for loop, rows, _ in parts]) for name in ("cur", "attn", "pos")
        )
        layers = [_kv_layers(loop.cache) for loop, _, _ in parts]
        self.cache = _dynamic_cache(
            [
                (
                    torch.cat([ls[j].keys[rows] for ls, (_, rows, _) in zip(layers, parts)]),
                    torch.cat([ls[j].values[rows] for ls, (_, rows, _) in zip(layers, parts)]),
                )
                for j in range(len(layers[0]))
            ]
        )
        self.t = parts[-1][0].t


def _kv_layers(cache: Any) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None or any(not hasattr(layer, "keys") or not hasattr(layer, "values") for layer in layers):
        raise TypeError(
            f"long-tail migration moves rows' KV caches between ranks and needs transformers' "
            f"DynamicCache (layers with keys and values); this model returned {type(cache).__name__}. "
            f"Run without migration (fuse_migrate=False)"
        )
    return layers


def _dynamic_cache(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A transformers DynamicCache holding these (keys, values) per layer."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=pairs)


def _tail_of(loop: _Loop) -> Batch:
    """The running (unfinished) rows of a paused loop, with everything needed to go on decoding them."""
    sel = (~loop.done[loop.live]).nonzero()[:, 0]
    rows = loop.live[sel]
    kv = {}
    for j, layer in enumerate(_kv_layers(loop.cache)):
        kv[f"{TAIL_PREFIX}key.{j}"], kv[f"{TAIL_PREFIX}value.{j}"] = layer.keys[sel].clone(), layer.values[sel].clone()
    part = loop.prompts.take(rows)
    state = {
        TAIL_PREFIX + "tokens": loop.tokens[rows],
        TAIL_PREFIX + "logp": loop.logp[rows],
        TAIL_PREFIX + "uniforms": loop.uniforms[rows],
        TAIL_PREFIX + "attn": loop.attn[sel],
        TAIL_PREFIX + "pos": loop.pos[sel],
        TAIL_STEP: torch.full((len(rows),), loop.t, dtype=torch.long),
        ROW_INDEX: loop.index[rows],
        **kv,
    }
    return Batch({**part.tensors, **state}, part.rows, part.meta)


def _step(tail: Batch) -> int:
    return int(tail[TAIL_STEP][0])


def cache_argument(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in transformers >= 5.20, `past_key_values` before
    (an older model silently ignores the unknown name and decodes every step without its past)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _select_rows(cache: object, keep: torch.Tensor) -> None:
    select = getattr(cache, "batch_select_indices", None)
    if select is None:
        raise TypeError(
            f"evict_finished needs a KV cache that can drop rows (transformers' DynamicCache has "
            f"batch_select_indices); this model returned {type(cache).__name__}. Set "
            f"SamplingConfig.evict_finished=False"
        )
    select(keep)
