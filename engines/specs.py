"""The settings of one update or generation call, as typed arguments of the call.

`actor.update_actor(batch, loss_fn, UpdateSpec(...))` and `actor.generate_sequences(prompts, GenerationSpec(...))`
carry what used to travel in `Batch.meta` under string keys, each read with its own default at the far end: a
misspelt key there silently meant "the whole batch". A frozen dataclass names
every setting once, with its one default, documents it where it is declared and refuses a bad value when it is
built, on the controller, before any rank sees it. Batch.meta stays flowactors' per-batch container; engines no
longer read settings from it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UpdateSpec", "GenerationSpec", "generation_spec"]


@dataclass(frozen=True)
class UpdateSpec:
    """How one update call walks its batch."""

    mini_batch_samples: int
    """Samples per optimizer step, global across data-parallel ranks; it must divide the batch and be a multiple
    of the data-parallel size (each DP rank gets an equal share of every mini-batch)."""
    epochs: int = 1
    """Passes over the batch."""
    shuffle_seed: int | None = None
    """None: the batch's order; otherwise a seeded shuffle per epoch (the same mini-batches at every DP size)."""
    lr: float | None = None
    """Learning rate for this call only (e.g. the supervised warm start); None: the engine's schedule."""

    def __post_init__(self) -> None:
        if self.mini_batch_samples < 1:
            raise ValueError(f"UpdateSpec.mini_batch_samples must be >= 1, got {self.mini_batch_samples}")
        if self.epochs < 1:
            raise ValueError(f"UpdateSpec.epochs must be >= 1, got {self.epochs}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"UpdateSpec.lr must be > 0 when given (None: the engine's schedule), got {self.lr}")


@dataclass(frozen=True)
class GenerationSpec:
    """How one generation call samples."""

    greedy: bool = False
    """Argmax decoding instead of sampling (e.g. ReMax's baseline response)."""
    seed: int = 0
    """Base seed when the prompt rows carry no `seed` column: row i of a rank's share draws from seed * 1000003 + i.
    A `seed` column (one per row) makes each sample independent of the data-parallel split."""


def generation_spec(spec: GenerationSpec | None) -> GenerationSpec:
    """A generation call's spec, None meaning GenerationSpec(); a TypeError for anything else."""
    if spec is None:
        return GenerationSpec()
    if not isinstance(spec, GenerationSpec):
        raise TypeError(f"a generation call's spec must be a GenerationSpec (or None), got {type(spec).__name__}")
    return spec
