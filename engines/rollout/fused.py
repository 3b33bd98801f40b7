"""The actor's endpoints of stage fusion (RLHFuse; algorithms.rollout.fusion drives them): a rollout handed out in
chunks as rows finish, and long-tail migration of the last running rows between ranks (docs/fusion.md).

A mixin of engines.roles.ActorWorker: it uses the worker's generator, 3D-HybridEngine (`hybrid`), sampling
settings and rank, and `_send_weights` / `_generation_model` / `_release_generation` to bring the generation
weights up to date and to free them.
"""

from __future__ import annotations

import queue
from typing import Any

from engines.rollout.stream import GenerationStream, is_tail, share_tails
from engines.specs import GenerationSpec, generation_spec
from flowactors import MESH, ONE_TO_ALL, Batch, endpoint

__all__ = ["FusedRolloutEndpoints"]


class FusedRolloutEndpoints:
    """start_generation → next_generated_chunk(k)...; with migration, hand_over_tail and finish_tail."""

    _stream: GenerationStream | None = None
    _split_stream = False
    _inbox: queue.Queue | None = None
    _receivers = 1

    @endpoint(protocol=MESH)
    def start_generation(
        self,
        prompts: Batch,
        chunk_samples: int,
        spec: GenerationSpec | None = None,
        migrate_below: int | None = None,
        receivers: int = 1,
    ) -> None:
        """Begin sampling `prompts` (what `generate_sequences` would sample) in a background thread; take the
        samples with `next_generated_chunk(0)`, `(1)`, ... : ceil(rows of this rank / chunk_samples) chunks on
        every rank, each of `chunk_samples` rows except the last, in the order the rows finish. Under the
        3D-HybridEngine the d_g generation replicas each stream their rows (chunk_samples/d_g per chunk) when d_g
        divides both; otherwise every replica samples all rows of the share. `spec` as in generate_sequences.

        `migrate_below=m` (long-tail migration, RLHFuse; unsharded generation, hf or vllm engine): every rank
        from `receivers` on stops decoding once at most m of its rows are still running; ranks 0..receivers-1 go
        on and will admit their rows. Take the (rows - m) // chunk_samples chunks that are sure to exist, then
        `hand_over_tail()` and `finish_tail(...)`."""
        spec = generation_spec(spec)
        if chunk_samples < 1:
            raise ValueError(f"chunk_samples must be >= 1, got {chunk_samples}")
        self._end_stream()  # one left over from a step that stopped early
        if migrate_below is not None and (self.hybrid is not None or not getattr(self.generator, "migrates", False)):
            raise ValueError(
                "long-tail migration moves decoding rows between ranks that each generate with "
                "whole weights, on an engine that can pause and admit them (hf, vllm); drop "
                "rollout_tp, or run without migration (fuse_migrate=False)"
            )
        rows, per_chunk = slice(0, len(prompts)), chunk_samples
        d_g = self.hybrid.micro_size if self.hybrid is not None else 1
        self._split_stream = d_g > 1 and len(prompts) % d_g == 0 and chunk_samples % d_g == 0
        if self._split_stream:  # each generation replica streams its rows; chunk k joins their k-th chunks
            rows, per_chunk = self.hybrid.micro_slice(len(prompts)), chunk_samples // d_g
        model = self._generation_target()  # in the task thread: the decoding thread runs no collective
        migrate: dict[str, Any] = {}
        if migrate_below is not None:  # the first `receivers` ranks receive the other ranks' tails, which pause
            if not 1 <= receivers < self.layout.world_size:
                raise ValueError(
                    f"long-tail migration needs 1 <= receivers < the actor's {self.layout.world_size} "
                    f"ranks (some rank must hand its tail over), got receivers={receivers}"
                )
            self._receivers = receivers
            self._inbox = queue.Queue() if self.rank < receivers else None
            migrate = {"inbox": self._inbox} if self.rank < receivers else {"pause_below": migrate_below}
        chunks = self.generator.stream(
            model,
            prompts.slice(rows.start, rows.stop),
            self.sampling,
            per_chunk,
            greedy=spec.greedy,
            seed=spec.seed,
            row_offset=self.coords[1] * len(prompts) + rows.start,
            seed_offset=rows.start,
            **migrate,
        )
        self._stream = GenerationStream(
            chunks, n_chunks=-(-len(prompts) // chunk_samples), name=f"{self.group_name}-rank{self.rank}-generation"
        )

    @endpoint(protocol=MESH)
    def next_generated_chunk(self, k: int) -> Batch:
        """Chunk k of the running generation, once complete: generated rows plus `row_index`, their index in the
        prompts of `start_generation`. Taking the last chunk waits for the decoding thread to end."""
        if self._stream is None:
            raise RuntimeError(
                f"no generation is running on {self.group_name} rank {self.rank}; call "
                f"start_generation(prompts, chunk_samples) before next_generated_chunk({k})"
            )
        chunk = self._stream.take(k)  # a decoding error is raised here, and by every later chunk call
        if self._stream.finished:
            self._stream = None
            self._release_generation()
        return self.hybrid.gather_micro(chunk) if self._split_stream else chunk

    @endpoint(protocol=ONE_TO_ALL)
    def hand_over_tail(self) -> list[Batch]:
        """Long-tail migration, after `start_generation(migrate_below=...)` and the chunks sure to exist: on a
        handing-over rank, once its decoding paused (or ended), the finished rows not yet taken, then the running
        rows' decode state (KV caches or tokens so far, sampling state); its device is then free. A receiving
        rank, which goes on decoding, returns [] at once."""
        if self._stream is None:
            raise RuntimeError(
                f"no generation is running on {self.group_name} rank {self.rank}; call "
                f"start_generation(prompts, chunk_samples, migrate_below=m) first"
            )
        if self._inbox is not None:
            return []
        try:
            return self._stream.rest()
        finally:
            self._stream = None

    @endpoint(protocol=ONE_TO_ALL)
    def finish_tail(self, handed_over: list[list[Batch]]) -> Batch | None:
        """On a receiving rank: admit its share of the handed-over paused rows (`share_tails`) into its running
        decode and return, once all have finished, every row of its own not yet taken and of its share, each with
        `row_index`; rank 0 also returns the finished rows the other ranks handed over. Every other rank returns
        None at once."""
        if self._inbox is None:
            if self._stream is not None or self.rank == 0:
                raise RuntimeError(
                    f"finish_tail needs the generation of start_generation(..., migrate_below=m) "
                    f"running on {self.group_name} rank {self.rank}, and every handing-over rank's "
                    f"hand_over_tail() first"
                )
            return None
        items = [item for per_rank in handed_over for item in per_rank]
        tails = share_tails([item for item in items if is_tail(item)], self._receivers)[self.rank]
        self._inbox.put(tails)  # together: the ones behind catch up as one
        self._inbox.put(None)
        try:
            rest = ([item for item in items if not is_tail(item)] if self.rank == 0 else []) + self._stream.rest()
        finally:
            self._stream = self._inbox = None
        return Batch.concat([item for item in rest if len(item)])

    def _end_receiving(self) -> None:
        """A migrating step that failed before `finish_tail` leaves the receiving ranks decoding (or waiting for
        tails): end that before anything else uses the model."""
        if self._inbox is not None:
            self._end_stream()

    def _end_stream(self) -> None:
        if self._inbox is not None:
            self._inbox.put(None)  # a receiving decode waiting for tails ends
            self._inbox = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._release_generation()
