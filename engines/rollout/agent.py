"""Multi-turn rollouts: episodes in which the model calls tools and reads their answers, run inside the actor.

An `Environment` (engines.rollout.tools builds them) turns a prompt row into an episode: after each model turn that
ends with a tool call (one of its `stop` texts), `step` parses the turn into calls, the calls run, and `observe`
renders their outputs as text that is appended to the episode as context; a turn that ends with EOS (or runs out of
tokens) ends the episode. Rewards are the task's, on the episode's text (the reward role's business).

`EpisodeEngine` wraps a generation engine (hf or vLLM) and keeps its interface, so every path that samples (plain
steps, stage fusion's streams, asynchronous rollout replicas) samples episodes instead of single responses. Each
turn of every ready episode decodes as one batch on the wrapped engine, streamed: as each row finishes, its calls
go to a pool of `tool_workers` threads, so tools run while the rest of the batch decodes, and the episodes whose
tools have answered form the next turn's batch (when none has, it waits for the first). `overlap=False` is the
turn-by-turn loop instead: the whole turn decodes, then its calls run on the pool and all are waited for (with
`tool_workers=1`, one after another).

A tool that raises, hangs past `tool_timeout_s`, a call that does not parse and a call to an unknown tool each
become an error observation the model reads, counted in `tool_errors`; the episode goes on. A hung tool's thread
cannot be killed (Python threads cannot be): it is abandoned, a daemon, and its slot in the pool is freed; tools
that must be killable run in a subprocess (algorithms.environments.sandbox's code execution does).

Samples from a turn are reproducible: each episode's turn k draws from its own seed (the row's seed and k), and the
hf engine's rows do not depend on their batch, so the tokens do not depend on which episodes share a turn's batch
or on when tools answer (log-probs may differ in the last bit between batchings).

Output: the rollout protocol's layout (engines.rollout.stream) with the whole episode after the prompt as the
response (model turns and observations, right-padded to `max_new_tokens`, the episode's token budget):
attention_mask covers every episode token, `response_mask` — the loss mask — only the model's own (observations are
context: no loss, no KL), rollout_log_probs the model's tokens'. Per episode, (B,) fields: EPISODE_FIELDS.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engines.ops import position_ids_from_mask
from engines.rollout.stream import ROW_INDEX, STOP_AT, SamplingConfig, row_seeds, stream_chunks
from flowactors import Batch

__all__ = ["AgentConfig", "Environment", "ToolCall", "EpisodeEngine", "EPISODE_FIELDS", "episode_samples"]

EPISODE_FIELDS = ("turns", "tool_calls", "tool_errors", "tool_seconds", "model_tokens", "tool_tokens")
"""(B,) float fields of every episode batch: model turns, tool calls made, calls that became errors, seconds spent in
tools, tokens the model wrote, tokens of observations."""


@dataclass
class ToolCall:
    """One call parsed from a model turn: `run()` returns the tool's output text; `error` (run None) says why the
    call cannot be made (it did not parse, the tool is unknown)."""

    name: str
    run: Callable[[], str] | None = None
    error: str | None = None


class Environment(Protocol):
    """One episode's environment; a fresh one per episode (from AgentConfig.environment)."""

    stop: tuple[str, ...]
    """Texts that end a model turn besides EOS: the end of a tool call."""

    def reset(self, prompt: str, row: dict[str, Any]) -> None:
        """Start an episode on this prompt (its text and per-row values)."""
        ...

    def step(self, text: str) -> list[ToolCall]:
        """The calls in a model turn that ended with a stop text (a turn that does not parse is a ToolCall with its
        error)."""
        ...

    def observe(self, results: list[tuple[ToolCall, str | None, str | None]]) -> str:
        """The text the model reads next: each call with its output or error (one of the two is None)."""
        ...


@dataclass
class AgentConfig:
    """How the actor samples episodes instead of single responses (the programs' `rollout.agent.` settings: the
    environment and the default turn count come from the task)."""

    environment: Callable[[Any], Environment] | None = field(default=None, metadata={"setting": False})
    """A fresh environment per episode, given the policy's tokenizer (picklable: a module-level function)."""
    max_turns: int | None = None
    """Model turns per episode; an episode whose last allowed turn calls a tool ends there. None: the task's."""
    max_turn_tokens: int = 0
    """Tokens per model turn (0: what is left of the episode's budget, SamplingConfig.max_new_tokens)."""
    tool_workers: int = 8
    """Tools running at once (threads)."""
    tool_timeout_s: float = 5.0
    """A tool call that has not answered after this many seconds becomes an error observation."""
    overlap: bool = True
    """Run tools while the batch goes on decoding; False: turn by turn, the turn's calls run (tool_workers at a
    time) once the whole batch has decoded its turn, and all are waited for (a baseline)."""

    def __post_init__(self) -> None:
        if (self.max_turns is not None and self.max_turns < 1) or self.tool_workers < 1 or self.max_turn_tokens < 0:
            raise ValueError(
                f"max_turns and tool_workers must be >= 1 (max_turns none: the task's) and max_turn_tokens >= 0; "
                f"got {self.max_turns}, {self.tool_workers}, {self.max_turn_tokens}"
            )
        if not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {self.tool_timeout_s}")


class _Tools:
    """Runs tool calls on at most `workers` threads, each under `timeout` seconds; results land in `done` as
    (episode, call index, output, error, seconds)."""

    def __init__(self, workers: int, timeout: float) -> None:
        self.timeout = timeout
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="flowactors-tool")
        self.done: queue.Queue = queue.Queue()

    def submit(self, episode: int, index: int, call: ToolCall) -> None:
        self.pool.submit(lambda: self.done.put((episode, index, *self.run(call))))

    def run(self, call: ToolCall) -> tuple[str | None, str | None, float]:
        """(output, error, seconds) of one call, waiting at most `timeout`."""
        if call.run is None:
            return None, call.error or "the call could not be made", 0.0
        box: list = []

        def target() -> None:
            try:
                box.append((str(call.run()), None))
            except BaseException as e:
                box.append((None, f"{type(e).__name__}: {e}"))

        t0 = time.perf_counter()
        runner = threading.Thread(target=target, name=f"flowactors-tool-{call.name}", daemon=True)
        runner.start()
        runner.join(self.timeout)
        seconds = time.perf_counter() - t0
        if not box:  # still running: abandoned (a thread cannot be killed), its slot freed
            return None, f"timed out after {self.timeout:g} s", seconds
        return (*box[0], seconds)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Episode:
    prompt_ids: list[int]
    seed: int
    env: Environment
    tokens: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    turns: int = 0
    turn_start: int = 0
    """Where the model's current (last) turn begins in `tokens`."""
    calls: list[ToolCall] = field(default_factory=list)
    results: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    done: bool = False


class EpisodeEngine:
    """A generation engine that samples whole episodes (module docstring); `inner` does the decoding. Weight
    loading and every other attribute go to `inner`."""

    migrates = False
    """Long-tail migration moves single-response decodes; episodes are not migrated."""

    def __init__(self, inner: Any, tokenizer: Any, agent: AgentConfig) -> None:
        if agent.environment is None or agent.max_turns is None:
            raise ValueError("an episode engine needs AgentConfig.environment and max_turns (a task gives both)")
        self.inner, self.tokenizer, self.agent = inner, tokenizer, agent
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        self._stops: dict[tuple[str, ...], tuple[tuple[int, ...], ...]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(
        self,
        model: torch.nn.Module | None,
        prompts: Batch,
        cfg: SamplingConfig,
        *,
        greedy: bool = False,
        seed: int = 0,
        seed_offset: int = 0,
    ) -> Batch:
        """One episode per prompt row, in row order."""
        run = _Run(self, model, prompts, cfg, greedy=greedy, seed=seed, seed_offset=seed_offset)
        for _ in run.episodes():
            pass
        return run.samples(list(range(len(prompts))))

    def stream(
        self,
        model: torch.nn.Module | None,
        prompts: Batch,
        cfg: SamplingConfig,
        chunk_rows: int,
        *,
        greedy: bool = False,
        seed: int = 0,
        row_offset: int = 0,
        seed_offset: int = 0,
        **migration: Any,
    ) -> Iterator[Batch]:
        """The episodes of `generate`, in chunks of `chunk_rows` in the order they end, each row with `row_index`
        (its index in `prompts` plus `row_offset`)."""
        if any(v is not None for v in migration.values()):
            raise ValueError("long-tail migration is not built for multi-turn episodes; run without fuse_migrate")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        run = _Run(self, model, prompts, cfg, greedy=greedy, seed=seed, seed_offset=seed_offset)

        def chunk(rows: list[int]) -> Batch:
            out = run.samples(rows)
            return Batch({**out.tensors, ROW_INDEX: torch.tensor(rows) + row_offset}, out.rows, out.meta)

        return stream_chunks(run.episodes(), chunk_rows, chunk, lambda _: Batch({}))

    # -- partial rollouts (engines.rollout.partial): episodes advanced a turn at a time, across calls ------------
    def begin(self, prompts: Batch) -> list[_Episode]:
        """One episode per prompt row, its environment reset, not started (the row's `seed` column seeds it)."""
        return _Run(self, None, prompts, SamplingConfig(), greedy=False, seed=0, seed_offset=0).episodes_

    def advance(
        self, model: torch.nn.Module | None, episodes: list[_Episode], cfg: SamplingConfig, *, greedy: bool = False
    ) -> None:
        """One model turn of each of `episodes` (as one batch), then its tool calls and their observation; an
        episode that ends is marked `done`. Turn k of an episode draws from its own seed, as in `generate`, so an
        episode advanced call by call under the same weights is the episode `generate` samples."""
        run = _Run(self, model, Batch(), cfg, greedy=greedy, seed=0, seed_offset=0, episodes=episodes)
        tools = _Tools(self.agent.tool_workers, self.agent.tool_timeout_s)
        waiting: set[int] = set()
        try:
            for finished in run._turn(list(range(len(episodes)))):
                for i in finished:
                    if run._end_turn(i) is not None:
                        run._submit(tools, waiting, i)
            while waiting:
                run._collect(tools, waiting, [], block=True)
        finally:
            tools.close()

    def episode_batch(self, prompts: Batch, episodes: list[_Episode], cfg: SamplingConfig) -> Batch:
        """`episodes` (of `prompts`' rows, in order) in the output layout."""
        return _samples(prompts, episodes, cfg.max_new_tokens, self.pad)

    def stop_sequences(self, stops: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        if stops not in self._stops:
            self._stops[stops] = tuple(tuple(self.tokenizer(s, add_special_tokens=False).input_ids) for s in stops)
        return self._stops[stops]


class _Run:
    """The episodes of one generate/stream call."""

    def __init__(
        self,
        engine: EpisodeEngine,
        model: Any,
        prompts: Batch,
        cfg: SamplingConfig,
        *,
        greedy: bool,
        seed: int,
        seed_offset: int,
        episodes: list[_Episode] | None = None,
    ) -> None:
        """`episodes`: go on with these (started elsewhere) instead of starting one per prompt row."""
        self.engine, self.model, self.prompts, self.cfg, self.greedy = engine, model, prompts, cfg, greedy
        self.agent = engine.agent
        self.episodes_: list[_Episode] = list(episodes or [])
        if episodes is None:
            tok = engine.tokenizer
            ids, mask = prompts["input_ids"], prompts["attention_mask"]
            texts = tok.batch_decode([row[m.bool()] for row, m in zip(ids, mask)], skip_special_tokens=True)
            seeds = row_seeds(prompts, seed, seed_offset)
            for i, (row, m) in enumerate(zip(ids, mask)):
                env = self.agent.environment(tok)
                env.reset(texts[i], {k: v[i] for k, v in prompts.rows.items()})
                self.episodes_.append(_Episode(row[m.bool()].tolist(), seeds[i], env))
        self.stops = engine.stop_sequences(tuple(self.episodes_[0].env.stop)) if self.episodes_ else ()

    # -- the loop ------------------------------------------------------------------------------------------------

    def episodes(self) -> Generator[list[int], None, None]:
        """Run every episode to its end, yielding the episodes (indices) each time some end."""
        tools = _Tools(self.agent.tool_workers, self.agent.tool_timeout_s)
        waiting: set[int] = set()  # episodes whose tools are running
        try:
            ready = list(range(len(self.episodes_)))
            while ready or waiting:
                nxt: list[int] = []
                if ready:
                    for finished in self._turn(ready):
                        ended = []
                        for i in finished:
                            calls = self._end_turn(i)
                            if calls is None:
                                ended.append(i)
                            elif self.agent.overlap:
                                self._submit(tools, waiting, i)
                        ended += self._collect(tools, waiting, nxt, block=False)
                        if ended:
                            yield ended
                    if not self.agent.overlap:  # turn by turn: the turn's calls on the pool, all waited for
                        for i in ready:
                            if not self.episodes_[i].done:
                                self._submit(tools, waiting, i)
                        ended = []
                        while waiting:
                            ended += self._collect(tools, waiting, nxt, block=True)
                        if ended:
                            yield ended
                if waiting and not nxt:
                    ended = self._collect(tools, waiting, nxt, block=True)
                    if ended:
                        yield ended
                ready = nxt
        finally:
            tools.close()

    def _submit(self, tools: _Tools, waiting: set[int], i: int) -> None:
        waiting.add(i)
        for k, call in enumerate(self.episodes_[i].calls):
            tools.submit(i, k, call)

    def _collect(self, tools: _Tools, waiting: set[int], ready: list[int], *, block: bool) -> list[int]:
        """Take the tool results that have arrived (with `block`, wait until one episode's calls have all
        answered); an episode whose calls have all answered reads its observation and joins `ready`, or ends
        (returned)."""
        ended: list[int] = []
        while True:
            try:
                i, k, out, err, s = tools.done.get(block=block)
            except queue.Empty:
                return ended
            ep = self._result(i, k, out, err, s)
            if len(ep.results) == len(ep.calls):
                waiting.discard(i)
                (ready if self._observe(i) else ended).append(i)
                block = False

    def _turn(self, ready: list[int]) -> Iterator[list[int]]:
        """Decode one turn of the `ready` episodes as a batch, yielding the episodes as their turns end."""
        cfg, eps = self.cfg, [self.episodes_[i] for i in ready]
        budget = [cfg.max_new_tokens - len(ep.tokens) for ep in eps]
        if self.agent.max_turn_tokens:
            budget = [min(b, self.agent.max_turn_tokens) for b in budget]
        contexts = [ep.prompt_ids + ep.tokens for ep in eps]
        width = max(map(len, contexts))
        ids = torch.full((len(eps), width), self.engine.pad, dtype=torch.long)
        mask = torch.zeros((len(eps), width), dtype=torch.long)
        for r, ctx in enumerate(contexts):
            ids[r, width - len(ctx) :] = torch.tensor(ctx)
            mask[r, width - len(ctx) :] = 1
        seeds = torch.tensor([(ep.seed * 1_000_003 + ep.turns) % (2**62) for ep in eps])
        batch = Batch({"input_ids": ids, "attention_mask": mask, "seed": seeds, STOP_AT: torch.tensor(budget)})
        turn_cfg = dataclasses.replace(cfg, max_new_tokens=max(budget), stop_sequences=self.stops)
        for chunk in self.engine.inner.stream(self.model, batch, turn_cfg, 1, greedy=self.greedy):
            rows = chunk[ROW_INDEX].tolist()
            for j, r in enumerate(rows):
                keep = chunk["response_mask"][j].bool()
                ep = self.episodes_[ready[r]]
                ep.turn_start = len(ep.tokens)
                ep.tokens += chunk["responses"][j][keep].tolist()
                ep.logp += chunk["rollout_log_probs"][j][keep].tolist()
                ep.model += [1] * int(keep.sum())
                ep.turns += 1
            yield [ready[r] for r in rows]

    def _end_turn(self, i: int) -> list[ToolCall] | None:
        """After episode i's turn: its calls, or None when the episode ended (EOS, no stop text, out of turns or
        tokens)."""
        ep = self.episodes_[i]
        turn = ep.tokens[ep.turn_start :]
        called = any(tuple(turn[-len(s) :]) == s for s in self.stops) if turn else False
        if not called or ep.turns >= self.agent.max_turns or len(ep.tokens) >= self.cfg.max_new_tokens:
            ep.done = True
            ep.calls = []
            return None
        text = self.engine.tokenizer.decode(turn, skip_special_tokens=True)
        ep.calls = list(ep.env.step(text)) or [ToolCall("?", error="no tool call found")]
        ep.results = {}
        return ep.calls

    def _result(self, i: int, k: int, out: str | None, err: str | None, seconds: float) -> _Episode:
        ep = self.episodes_[i]
        ep.results[k] = (out, err)
        ep.tool_calls += 1
        ep.tool_errors += err is not None
        ep.tool_seconds += seconds
        return ep

    def _observe(self, i: int) -> bool:
        """Append episode i's observation; False when the episode ends (no tokens left for the model)."""
        ep = self.episodes_[i]
        text = ep.env.observe([(call, *ep.results[k]) for k, call in enumerate(ep.calls)])
        obs = self.engine.tokenizer(text, add_special_tokens=False).input_ids
        room = self.cfg.max_new_tokens - len(ep.tokens)
        obs = obs[:room]
        ep.tokens += obs
        ep.model += [0] * len(obs)
        ep.logp += [0.0] * len(obs)
        ep.calls, ep.results = [], {}
        if len(ep.tokens) >= self.cfg.max_new_tokens:
            ep.done = True
        return not ep.done

    # -- output ----------------------------------------------------------------------------------------------------

    def samples(self, rows: list[int]) -> Batch:
        part = self.prompts.take(torch.tensor(rows, dtype=torch.long))
        return _samples(part, [self.episodes_[i] for i in rows], self.cfg.max_new_tokens, self.engine.pad)


def _samples(prompts: Batch, eps: list[_Episode], width: int, pad: int) -> Batch:
    return episode_samples(
        prompts,
        [ep.tokens for ep in eps],
        [ep.model for ep in eps],
        [ep.logp for ep in eps],
        width,
        pad=pad,
        counts={
            "turns": [ep.turns for ep in eps],
            "tool_calls": [ep.tool_calls for ep in eps],
            "tool_errors": [ep.tool_errors for ep in eps],
            "tool_seconds": [ep.tool_seconds for ep in eps],
        },
    )


def episode_samples(
    prompts: Batch,
    tokens: list[list[int]],
    model_mask: list[list[int]],
    logp: list[list[float]],
    width: int,
    *,
    pad: int,
    counts: dict[str, list[float]] | None = None,
) -> Batch:
    """Episodes in the rollout layout (module docstring): each row's episode tokens after its prompt, right-padded
    to `width`; `model_mask` 1 on the model's own tokens (the response_mask), 0 on observations. Also lays out
    multi-turn demonstrations for the supervised warm start."""
    b = len(tokens)
    resp = torch.full((b, width), pad, dtype=torch.long)
    valid = torch.zeros((b, width), dtype=torch.long)
    loss = torch.zeros((b, width), dtype=torch.long)
    lp = torch.zeros((b, width), dtype=torch.float32)
    for r in range(b):
        n = min(len(tokens[r]), width)
        resp[r, :n] = torch.tensor(tokens[r][:n], dtype=torch.long)
        valid[r, :n] = 1
        loss[r, :n] = torch.tensor(model_mask[r][:n], dtype=torch.long)
        lp[r, :n] = torch.tensor(logp[r][:n], dtype=torch.float32)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    full_mask = torch.cat([mask, valid], dim=1)
    model_tokens = loss.sum(-1).float()
    tensors = {
        "prompts": ids,
        "responses": resp,
        "input_ids": torch.cat([ids, resp], dim=1),
        "attention_mask": full_mask,
        "position_ids": position_ids_from_mask(full_mask),
        "response_mask": loss,
        "rollout_log_probs": lp * loss,
        "model_tokens": model_tokens,
        "tool_tokens": valid.sum(-1).float() - model_tokens,
    }
    for name in EPISODE_FIELDS:
        if name not in tensors:
            tensors[name] = torch.tensor((counts or {}).get(name, [0.0] * b), dtype=torch.float32)
    keep = {k: v for k, v in prompts.tensors.items() if k not in tensors and k not in ("input_ids", "attention_mask")}
    return Batch({**keep, **tensors}, prompts.rows, prompts.meta)
