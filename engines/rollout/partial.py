"""Partial rollouts: a rollout replica's sequences in flight across policy versions (asynchronous RL's
`async_rl.partial_rollout`; algorithms.rollout.asynchronous drives it, docs/asynchronous.md says why).

A replica holds the groups it was given (every sample of a prompt) until all of their samples have finished. Each
call (`PartialRollouts.run`) admits a step's fresh groups, then decodes every unfinished sequence in segments of at
most `segment` new tokens under the replica's current weights, until at least the call's quota of groups has
finished (always one segment at least, so the fleet keeps decoding); it hands out the first `quota` finished
groups, in the order they finished (then in order of admission), and keeps the rest. A new policy version arrives
between calls, so between segments: a sequence that has not finished continues under the new weights.

The KV cache is recomputed, not kept: a segment's prompt is the original prompt plus the tokens so far, prefilled
by the weights that decode it. A kept cache would hold keys and values computed by the old weights, so the new
tokens would be sampled from neither policy and their recorded log-probs would match no model the trainer can
evaluate; the prefill costs one forward pass over the sequence per segment, small next to decoding (slime and
verl's partial rollouts recompute it the same way). Every token records the version that sampled it and its
behaviour log-prob (the engine's, at the sampling temperature), so the loss weighs each token by its own policy.

Multi-turn episodes (an `EpisodeEngine` given as `episodes`): a segment is one model turn of every running
episode, with its tool calls and their observation, so an episode may span versions at turn boundaries; its turn k
draws from its own seed as in a whole episode. A checkpoint keeps each episode's tokens and counters; on restore
its environment is made afresh and reset from the prompt row (the built-in environments keep no state beyond that
and the episode's text).

Deterministic by construction: a sequence's segment k is sampled with a seed derived from its row's seed and k
(segment 0 with the row's own seed, so a sequence that finishes in its first segment is exactly what
`generate_sequences` gives for it), the rows of a segment are in admission order, and a call's output depends only
on the calls before it. Both generation backends serve it unchanged: a segment is an ordinary generate with a
per-row stop length (`STOP_AT`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.fields import POLICY_VERSIONS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from engines.ops import stop_sequence_ends
from engines.rollout.stream import STOP_AT, SamplingConfig, assemble_samples, stop_lengths
from flowactors import Batch

__all__ = ["PartialRollouts", "PROMPT_UID", "SEGMENTS"]

PROMPT_UID = "prompt_uid"
"""Optional prompt field: the id of each row's group across the whole run (the controller's prompt ledger); without
it a replica numbers the groups it is given itself."""

SEGMENTS = "partial_segments"
"""Output field: how many segments each sample took (1: it finished in the call that admitted it)."""


@dataclass
class _Sequence:
    """One sample in flight: its prompt row as given, the tokens so far and what sampled them."""

    prompt: Batch
    limit: int
    """New tokens at most: max_new_tokens, or the row's STOP_AT."""
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0
    done: bool = False
    episode: Any = None
    """Multi-turn: the episode (engines.rollout.agent), which holds the tokens."""


class PartialRollouts:
    """The groups one replica rank holds (see the module docstring). `episodes`: the multi-turn engine whose
    episodes these are (None: single responses)."""

    def __init__(self, sampling: SamplingConfig, *, eos: int, pad: int, episodes: Any = None) -> None:
        self.sampling, self.eos, self.pad, self.episodes = sampling, eos, pad, episodes
        self.groups: dict[int, list[_Sequence]] = {}
        """uid -> its samples, in order of admission."""
        self.ready: list[int] = []
        """uids whose samples have all finished, in the order they finished."""
        self.next_uid = 0
        self.first_ready: float | None = None  # when (time.monotonic) the first group finished here

    # -- the calls --------------------------------------------------------------------------------------------------
    def admit(self, prompts: Batch) -> None:
        """Take a step's fresh prompt rows (grouped by their `group` field, or one group each)."""
        if not len(prompts):
            return
        groups = prompts["group"].tolist() if "group" in prompts else list(range(len(prompts)))
        uids = prompts[PROMPT_UID].tolist() if PROMPT_UID in prompts else [self.next_uid + g for g in groups]
        stop = stop_lengths(prompts)
        episodes = self.episodes.begin(prompts) if self.episodes is not None else [None] * len(prompts)
        for i, uid in enumerate(uids):
            if uid in self.groups and self.groups[uid][0].segments:
                raise ValueError(f"prompt group {uid} is already in flight on this replica; a group is admitted once")
            limit = self.sampling.max_new_tokens if stop is None else min(int(stop[i]), self.sampling.max_new_tokens)
            self.groups.setdefault(int(uid), []).append(_Sequence(prompts.take([i]), limit, episode=episodes[i]))
        self.next_uid = max(self.next_uid, max(int(u) for u in uids) + 1)

    def run(self, generate: Callable[[Any], Any], version: int, quota: int, segment: int) -> Batch:
        """Decode segments under policy `version` until `quota` groups have finished (one segment at least); the
        first `quota` finished groups, laid out as `generate_sequences`' samples (`group` renumbered 0..quota-1).
        `generate`: a generate over a prompt batch (single responses), or, for episodes, what advances a list of
        them by a turn (EpisodeEngine.advance with the model bound)."""
        if segment < 1 or quota < 0:
            raise ValueError(f"a partial rollout needs segment >= 1 and quota >= 0, got {segment} and {quota}")
        ran = False
        while not ran or len(self.ready) < quota:
            if not self.running():
                raise ValueError(
                    f"this replica holds {len(self.ready)} finished groups and nothing in flight, but the call asks "
                    f"for {quota}: give it at least as many prompt groups as it hands out"
                )
            self._segment(generate, version, segment)
            ran = True
        return self.hand_out(quota)

    def decode(self, generate: Callable[[Any], Any], version: int, segment: int) -> bool:
        """One segment of every unfinished sequence under policy `version` (streaming rollouts call this in a
        loop); False when nothing is in flight."""
        if segment < 1:
            raise ValueError(f"a partial rollout needs segment >= 1, got {segment}")
        if not self.running():
            return False
        self._segment(generate, version, segment)
        return True

    def hand_out(self, quota: int | None = None) -> Batch:
        """The first `quota` finished groups (None: all of them), in the order they finished, laid out as
        `generate_sequences`' samples (`group` renumbered from 0); they leave this replica."""
        n = len(self.ready) if quota is None else quota
        out, self.ready = self.ready[:n], self.ready[n:]
        return self._assemble([self.groups.pop(uid) for uid in out])

    def held(self) -> list[int]:
        """The uids of the groups this rank holds (in flight or finished and not yet handed out)."""
        return list(self.groups)

    def running(self) -> bool:
        """Whether any sequence is unfinished."""
        return any(not s.done for g in self.groups.values() for s in g)

    # -- one segment --------------------------------------------------------------------------------------------------
    def _segment(self, generate: Callable[[Any], Any], version: int, segment: int) -> None:
        rows = [s for g in self.groups.values() for s in g if not s.done]
        if self.episodes is not None:
            before = [len(s.episode.tokens) for s in rows]
            generate([s.episode for s in rows])
            for s, n in zip(rows, before):
                s.versions += [int(version)] * (len(s.episode.tokens) - n)
                s.segments += 1
                s.done = s.episode.done
            self._collect()
            return
        prompts = [torch.cat([_prompt_ids(s.prompt), torch.tensor(s.tokens, dtype=torch.long)]) for s in rows]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
        seeds = torch.tensor([_seed(s) for s in rows], dtype=torch.long)
        stop = torch.tensor([min(segment, s.limit - len(s.tokens)) for s in rows], dtype=torch.long)
        out = generate(Batch({"input_ids": ids, "attention_mask": mask, "seed": seeds, STOP_AT: stop}))
        lengths = out[RESPONSE_MASK].sum(-1).tolist()
        for i, s in enumerate(rows):
            n = int(lengths[i])
            s.tokens += out["responses"][i, :n].tolist()
            s.log_probs += out[ROLLOUT_LOG_PROBS][i, :n].tolist()
            s.versions += [int(version)] * n
            s.segments += 1
            end = self._end(s.tokens)
            if end is not None or len(s.tokens) >= s.limit:
                keep = min(end or s.limit, s.limit)
                del s.tokens[keep:], s.log_probs[keep:], s.versions[keep:]
                s.done = True
        self._collect()

    def _collect(self) -> None:
        for uid, group in self.groups.items():
            if uid not in self.ready and all(s.done for s in group):
                self.ready.append(uid)
                if self.first_ready is None:
                    self.first_ready = time.monotonic()

    def _end(self, tokens: list[int]) -> int | None:
        """The length up to and including the first EOS or completed stop sequence (across segments); None."""
        if self.sampling.ignore_eos or not tokens:
            return None
        t = torch.tensor(tokens)[None]
        ends = (t == self.eos) | stop_sequence_ends(t, self.sampling.stop_sequences)
        hit = ends[0].nonzero()
        return int(hit[0, 0]) + 1 if len(hit) else None

    # -- the output ---------------------------------------------------------------------------------------------------
    def _assemble(self, groups: list[list[_Sequence]]) -> Batch:
        rows = [s for g in groups for s in g]
        if not rows:
            return Batch()
        prompts = _concat_left_padded([s.prompt for s in rows])
        width = self.sampling.max_new_tokens
        extra = {
            "group": torch.tensor([g for g, grp in enumerate(groups) for _ in grp]),
            SEGMENTS: torch.tensor([s.segments for s in rows]),
        }
        if self.episodes is not None:
            out = self.episodes.episode_batch(prompts, [s.episode for s in rows], self.sampling)
            versions = torch.zeros((len(rows), width), dtype=torch.long)
            for i, s in enumerate(rows):
                versions[i, : len(s.versions[:width])] = torch.tensor(s.versions[:width], dtype=torch.long)
            tensors = {**out.tensors, **extra, POLICY_VERSIONS: versions * out["attention_mask"][:, -width:]}
            return Batch(tensors, out.rows, out.meta)
        tokens = torch.full((len(rows), width), self.pad, dtype=torch.long)
        logp = torch.zeros((len(rows), width))
        versions = torch.zeros((len(rows), width), dtype=torch.long)
        for i, s in enumerate(rows):
            n = len(s.tokens)
            tokens[i, :n], logp[i, :n], versions[i, :n] = (
                torch.tensor(s.tokens),
                torch.tensor(s.log_probs),
                torch.tensor(s.versions),
            )
        lengths = torch.tensor([len(s.tokens) for s in rows])
        given = prompts.tensors.get(STOP_AT)
        out = assemble_samples(
            Batch({**prompts.tensors, STOP_AT: lengths}, prompts.rows, prompts.meta),
            tokens,
            logp,
            eos=self.eos,
            pad=self.pad,
            ignore_eos=True,  # the lengths say where each sample ended
        )
        tensors = {k: v for k, v in out.tensors.items() if k != STOP_AT}
        if given is not None:
            tensors[STOP_AT] = given
        tensors.update(extra)
        tensors[POLICY_VERSIONS] = versions * out[RESPONSE_MASK]
        return Batch(tensors, out.rows, out.meta)

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything held, as plain values and tensors (a checkpoint keeps it; `load_state_dict` restores it)."""
        return {
            "next_uid": self.next_uid,
            "ready": list(self.ready),
            "groups": [[uid, [_plain_sequence(s) for s in group]] for uid, group in self.groups.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_uid = int(state["next_uid"])
        self.ready = [int(u) for u in state["ready"]]
        self.groups = {int(uid): [self._sequence(s) for s in group] for uid, group in state["groups"]}

    def _sequence(self, d: dict[str, Any]) -> _Sequence:
        s = _sequence(d)
        if d.get("episode") is not None:
            if self.episodes is None:
                raise ValueError("this checkpoint's partial rollouts are multi-turn episodes; resume the same task")
            (s.episode,) = self.episodes.begin(s.prompt)  # a fresh environment, reset from the prompt row
            for k, v in d["episode"].items():
                setattr(s.episode, k, v)
        return s


def _prompt_ids(prompt: Batch) -> torch.Tensor:
    return prompt["input_ids"][0][prompt["attention_mask"][0].bool()]


def _seed(s: _Sequence) -> int:
    base = int(s.prompt["seed"][0]) if "seed" in s.prompt else 0
    return base if s.segments == 0 else (base * 1_000_003 + s.segments) % 2**62


def _concat_left_padded(batches: list[Batch]) -> Batch:
    """One-row prompt batches of possibly different widths, left-padded to the widest (pad id 0 under a zero mask,
    as the engines ignore it)."""
    width = max(int(b["input_ids"].shape[1]) for b in batches)
    padded = []
    for b in batches:
        extra = width - int(b["input_ids"].shape[1])
        if extra:
            pad = {k: torch.nn.functional.pad(b[k], (extra, 0)) for k in ("input_ids", "attention_mask")}
            b = Batch({**b.tensors, **pad}, b.rows, b.meta)
        padded.append(b)
    return Batch.concat(padded)


def _plain_sequence(s: _Sequence) -> dict[str, Any]:
    return {
        "prompt": {"tensors": dict(s.prompt.tensors), "rows": dict(s.prompt.rows), "meta": dict(s.prompt.meta)},
        "limit": s.limit,
        "tokens": list(s.tokens),
        "log_probs": list(s.log_probs),
        "versions": list(s.versions),
        "segments": s.segments,
        "done": s.done,
        "episode": None if s.episode is None else {k: _copy(v) for k, v in vars(s.episode).items() if k != "env"},
    }


def _copy(v: Any) -> Any:
    return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v


def _sequence(d: dict[str, Any]) -> _Sequence:
    p = d["prompt"]
    prompt = Batch({k: torch.as_tensor(v) for k, v in p["tensors"].items()}, p["rows"], p["meta"])
    return _Sequence(
        prompt,
        int(d["limit"]),
        [int(x) for x in d["tokens"]],
        [float(x) for x in d["log_probs"]],
        [int(x) for x in d["versions"]],
        int(d["segments"]),
        bool(d["done"]),
    )
