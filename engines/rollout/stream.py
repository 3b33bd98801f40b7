"""The rollout protocol both generation backends share (hf and vLLM): sampling settings, the output layout, streamed
chunks and long-tail migration.

Output layout (verl's): prompts (B, P) left-padded; responses (B, R) right-padded to exactly `max_new_tokens`;
input_ids = prompts | responses; attention_mask; position_ids; response_mask (1 up to and including EOS);
rollout_log_probs (B, R). `assemble_samples` builds it row-wise, so a subset of rows assembles to the same values.

Streaming (stage fusion, docs/design.md §7): an engine's `stream()` yields the finished rows in chunks of
`chunk_rows`, in the order they finish, each row carrying its index in the call (`ROW_INDEX`); `GenerationStream`
runs a stream in a background thread so a worker can hand the chunks out one call at a time while decoding goes on.

Long-tail migration (RLHFuse; docs/fusion.md): a stream can pause once few rows still run and hand their state over
(`pause_below`) as a tail batch (fields under `TAIL_PREFIX`, `TAIL_STEP`); a receiving stream admits such tails
(`Arrivals`) into its running batch. What a tail holds beyond its tokens is each backend's own (the hf engine's KV
caches and uniforms; vLLM's generator state).

Per-row stop lengths: a `STOP_AT` tensor in the prompt batch ends row i after `stop_at[i]` tokens (EOS still ends
it earlier unless `ignore_eos`); benchmarks shape long-tailed length distributions with it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engines.ops import position_ids_from_mask, response_mask_from_tokens
from flowactors import Batch

__all__ = [
    "SamplingConfig",
    "GenerationStream",
    "Arrivals",
    "ROW_INDEX",
    "STOP_AT",
    "TAIL_PREFIX",
    "TAIL_STEP",
    "assemble_samples",
    "check_stream",
    "chunk_finished",
    "chunk_of",
    "is_tail",
    "row_seeds",
    "share_tails",
    "stop_lengths",
    "stream_chunks",
    "tail_prompts",
]


ROW_INDEX = "row_index"
"""Field of a streamed chunk: each row's index in the call's prompt batch."""


STOP_AT = "stop_at"
"""Optional prompt field: row i stops after stop_at[i] new tokens."""


TAIL_PREFIX = "_tail."


TAIL_STEP = TAIL_PREFIX + "step"
"""Field of a paused decode's state (`stream(pause_below=...)`): the tokens each row has so far, the step it
decodes next (the hf engine's rows of one tail are all at one step; a vLLM tail's may differ)."""


@dataclass
class SamplingConfig:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens (benchmarks with fixed token counts, as vLLM's ignore_eos)."""
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token-id sequences that end a row like EOS, included in the response (a multi-turn rollout's end of a tool
    call: engines.rollout.agent)."""
    dtype: str = ""
    """The generation engine's precision ("bfloat16", "float16", "float32"; "": the trainer's compute dtype):
    the hf engine decodes under autocast to it, vLLM is built in it. Lower than the trainer's, it makes the
    rollout-trainer mismatch the monitor measures."""
    evict_finished: bool = False
    """Drop finished rows from the running batch and KV cache (fast long tails; log-probs may differ in the last
    bit from the full-batch loop, see the module docstring)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(
                f"SamplingConfig.temperature must be > 0 (use greedy=True for argmax), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.dtype not in ("", "bfloat16", "float16", "float32"):
            raise ValueError(f"SamplingConfig.dtype must be bfloat16, float16, float32 or empty, got {self.dtype!r}")
        self.stop_sequences = tuple(tuple(int(t) for t in seq) for seq in self.stop_sequences)
        if any(not seq for seq in self.stop_sequences):
            raise ValueError("SamplingConfig.stop_sequences: an empty stop sequence would end every row at once")


def row_seeds(prompts: Batch, seed: int, seed_offset: int) -> list[int]:
    """Each row's sampling seed: its `seed` field, else seed·1000003 + seed_offset + its index (so rows a:b
    sampled apart with seed_offset=a draw what they draw together)."""
    if "seed" in prompts:
        return [int(s) for s in prompts["seed"].tolist()]
    return [seed * 1_000_003 + seed_offset + i for i in range(len(prompts))]


def check_stream(chunk_rows: int, pause_below: int | None, n_rows: int) -> None:
    """Refuse a `stream` call's chunk size or pause threshold, naming the allowed range."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if pause_below is not None and not 0 < pause_below < n_rows:
        raise ValueError(f"pause_below must be between 1 and the rows to sample - 1 ({n_rows - 1}), got {pause_below}")


def stream_chunks(
    finished: Generator[list[int], None, Any],
    chunk_rows: int,
    chunk: Callable[[list[int]], Batch],
    tail: Callable[[Any], Batch],
) -> Iterator[Batch]:
    """What every engine's `stream` yields: the finished rows a decode loop reports, as chunks of `chunk_rows`
    (`chunk(rows)`), then, if the loop paused, its state for another rank (`tail(paused)`)."""
    chunks = chunk_finished(finished, chunk_rows)
    while True:
        try:
            rows = next(chunks)
        except StopIteration as end:
            paused = end.value
            break
        yield chunk(rows)
    if paused is not None:
        yield tail(paused)


def chunk_of(
    prompts: Batch,
    tokens: torch.Tensor,
    logp: torch.Tensor,
    index: torch.Tensor,
    rows: list[int],
    cfg: SamplingConfig,
    *,
    eos: int,
    pad: int,
) -> Batch:
    """Buffer rows `rows` of a decode loop as a streamed chunk: samples in the output layout plus `row_index`."""
    idx = torch.tensor(rows, dtype=torch.long)
    out = assemble_samples(
        prompts.take(idx),
        tokens[idx],
        logp[idx],
        eos=eos,
        pad=pad,
        ignore_eos=cfg.ignore_eos,
        stop_sequences=cfg.stop_sequences,
    )
    return Batch({**out.tensors, ROW_INDEX: index[idx]}, out.rows, out.meta)


def chunk_finished(finished: Generator[list[int], None, Any], chunk_rows: int) -> Generator[list[int], None, Any]:
    """Group the rows a decode loop reports finished, step by step, into chunks of `chunk_rows` (the last may be
    shorter), in the order they finished: what every engine's `stream` hands out. Returns the loop's own return
    value (a paused loop's state, or None)."""
    pending: list[int] = []
    while True:
        try:
            rows = next(finished)
        except StopIteration as end:
            result = end.value
            break
        pending += rows
        while len(pending) >= chunk_rows:
            yield pending[:chunk_rows]
            pending = pending[chunk_rows:]
    if pending:
        yield pending
    return result


def assemble_samples(
    prompts: Batch,
    tokens: torch.Tensor,
    log_probs: torch.Tensor,
    *,
    eos: int,
    pad: int,
    ignore_eos: bool = False,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
) -> Batch:
    """Prompts plus sampled (or demonstrated) response tokens in the module's output layout.

    The response mask runs up to and including the first EOS or completed stop sequence (or over every token with
    `ignore_eos`, or up to a row's `stop_at`); tokens after it become `pad`. Row-wise ops only: a subset of rows assembles to the same
    values. Shared by every generation engine and by demonstrations for supervised warm starts."""
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    resp_mask = torch.ones_like(tokens) if ignore_eos else response_mask_from_tokens(tokens, eos, stop_sequences)
    stop = stop_lengths(prompts)
    if stop is not None:
        resp_mask = resp_mask * (torch.arange(tokens.shape[1]) < stop[:, None])
    tokens = torch.where(resp_mask.bool(), tokens, torch.full_like(tokens, pad))
    full_mask = torch.cat([mask, resp_mask], dim=1)
    tensors = {
        "prompts": ids,
        "responses": tokens,
        "input_ids": torch.cat([ids, tokens], dim=1),
        "attention_mask": full_mask,
        "position_ids": position_ids_from_mask(full_mask),
        "response_mask": resp_mask,
        "rollout_log_probs": log_probs * resp_mask,
    }
    keep = {k: v for k, v in prompts.tensors.items() if k not in tensors and k not in ("input_ids", "attention_mask")}
    return Batch({**keep, **tensors}, prompts.rows, prompts.meta)


class Arrivals:
    """The paused decodes a receiving loop has been sent (`inbox`: batches, or lists of them sent together; closed
    by None) and not yet admitted."""

    def __init__(self, inbox: "queue.Queue[Batch | None] | None") -> None:
        self.inbox, self.waiting = inbox, []
        self.done = inbox is None

    def collect(self, *, block: bool) -> None:
        """Move what has arrived to `waiting`; with `block`, wait for at least one item (or the close)."""
        while not self.done:
            try:
                item = self.inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self.done = True
            else:  # one paused decode, or several sent together
                self.waiting += [t for t in (item if isinstance(item, list) else [item]) if len(t)]


def share_tails(tails: list[Batch], receivers: int) -> list[list[Batch]]:
    """Paused decodes split over `receivers` receiving ranks: each, in order, to the one with the fewest rows so
    far (the first such on a tie). Deterministic, so every receiving rank works out the same split."""
    shares: list[list[Batch]] = [[] for _ in range(receivers)]
    rows = [0] * receivers
    for tail in tails:
        r = rows.index(min(rows))
        shares[r].append(tail)
        rows[r] += len(tail)
    return shares


def is_tail(item: Batch) -> bool:
    """Whether a streamed item is a paused decode's state (`stream(pause_below=...)`), not a chunk of samples."""
    return TAIL_STEP in item


def tail_prompts(tail: Batch) -> Batch:
    return tail.select(*(k for k in tail.keys() if not k.startswith(TAIL_PREFIX) and k != ROW_INDEX))


def stop_lengths(prompts: Batch) -> torch.Tensor | None:
    if STOP_AT not in prompts:
        return None
    stop = prompts[STOP_AT].long()
    if stop.dim() != 1 or (len(stop) and int(stop.min()) < 1):
        raise ValueError(
            f"prompt field {STOP_AT!r} must hold one length >= 1 per row (the new tokens after which "
            f"the row stops); got shape {tuple(stop.shape)}"
            f"{f', min {int(stop.min())}' if stop.numel() else ''}"
        )
    return stop


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class GenerationStream:
    """A chunk stream decoded in a background thread, handed out in order by `take(k)`.

    Why a thread: a Dask task returns once, so a worker hands out chunks as separate calls, and decoding must go on
    between them. The calling (task) thread blocks in `take` until chunk k is complete; calls to a worker process
    run one at a time, so every later call to it waits behind the stream, and taking the last chunk joins the
    thread: nothing else touches the model while it decodes. The thread runs no collectives.
    """

    def __init__(self, chunks: Iterator[Batch], n_chunks: int, *, name: str = "flowactors-generation") -> None:
        self.n_chunks = n_chunks
        self._chunks = chunks
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._next = 0
        self._error: BaseException | None = None
        # the current CUDA device is per thread: decode on the one the worker pinned, not on device 0
        self._device = (
            torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            for chunk in self._chunks:
                if self._stop.is_set():
                    break
                self._queue.put(chunk)
        except BaseException as e:
            self._queue.put(_Failed(e))
        finally:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()
            self._queue.put(_END)

    @property
    def finished(self) -> bool:
        """Every chunk was taken, or decoding failed; the thread has ended."""
        return (self._next >= self.n_chunks or self._error is not None) and not self._thread.is_alive()

    def take(self, k: int) -> Batch:
        """Chunk k (0, 1, ... in turn), waiting for it; a decoding error is raised here (and by later takes)."""
        if self._error is not None:
            raise self._error
        if k != self._next:
            raise RuntimeError(
                f"generated chunk {k} was asked for, but chunk {self._next} is next; chunks are "
                f"taken in order, once each ({self.n_chunks} in all)"
            )
        item = self._queue.get()
        if isinstance(item, _Failed):
            self._error = item.error
            self._thread.join()
            raise item.error
        if item is _END:
            self._thread.join()
            self._error = RuntimeError(f"generation ended after {k} chunks; {self.n_chunks} were expected")
            raise self._error
        self._next += 1
        if self._next == self.n_chunks:
            self.close()
        return item

    def rest(self) -> list[Batch]:
        """Every item not yet taken, once decoding has ended (a paused stream's last item is its tail state)."""
        if self._error is not None:
            raise self._error
        self._thread.join()
        items = []
        while (item := self._queue.get()) is not _END:
            if isinstance(item, _Failed):
                self._error = item.error
                raise item.error
            items.append(item)
        self._next = self.n_chunks
        return items

    def close(self) -> None:
        """Stop decoding (at the next chunk) and wait for the thread to end."""
        self._stop.set()
        self._thread.join()
