"""`Batch`: the one container for everything that flows between models.

Like verl's `DataProto`, a batch holds named tensors that share a leading (row) dimension, per-row non-tensor
values (decoded text, ids), and step metadata. Unlike it, a batch serializes with msgpack plus raw tensor buffers
(see `flowactors.serialization`), so it never goes through pickle on the data path and tensors are not copied on
the receiving side.

Operations never mutate: `split`, `chunk`, `take`, `concat`, `union` and `pad_to_multiple` return new batches that
share tensor storage where torch allows (views), which keeps DP splits of large batches cheap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Batch"]


class Batch:
    """Named tensors with a shared leading dimension, per-row values and metadata.

    `tensors[name]` has shape `(len(batch), ...)`; `rows[name]` is a list of `len(batch)` msgpack-able values;
    `meta` holds step-level values that do not split (they are copied to every part).
    """

    __slots__ = ("tensors", "rows", "meta")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        rows: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.rows: dict[str, list[Any]] = {k: list(v) for k, v in (rows or {}).items()}
        self.meta: dict[str, Any] = dict(meta or {})
        lengths = {f"tensor {k!r}": int(v.shape[0]) for k, v in self.tensors.items() if v.dim() > 0}
        lengths.update({f"rows {k!r}": len(v) for k, v in self.rows.items()})
        for k, v in self.tensors.items():
            if v.dim() == 0:
                raise ValueError(
                    f"tensor {k!r} is a scalar; batch tensors need a leading row dimension "
                    f"(put step-level values in meta)"
                )
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"batch fields disagree on the number of rows: {lengths}; every tensor's first "
                f"dimension and every per-row list must have the same length"
            )

    # -- inspection -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for r in self.rows.values():
            return len(r)
        return 0

    def __getitem__(self, name: str) -> Any:
        if name in self.tensors:
            return self.tensors[name]
        if name in self.rows:
            return self.rows[name]
        raise KeyError(
            f"batch has no field {name!r}; it has tensors {sorted(self.tensors)} and rows {sorted(self.rows)}"
        )

    def __contains__(self, name: object) -> bool:
        return name in self.tensors or name in self.rows

    def keys(self) -> list[str]:
        return [*self.tensors, *self.rows]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.tensors.items()
        )
        rows = f", rows: {sorted(self.rows)}" if self.rows else ""
        return f"Batch(len={len(self)}, {fields}{rows}, meta={sorted(self.meta)})"

    def equals(self, other: "Batch") -> bool:
        """Exact equality of every field (tensors compared by value and dtype)."""
        return (
            isinstance(other, Batch)
            and self.tensors.keys() == other.tensors.keys()
            and all(
                self.tensors[k].dtype == other.tensors[k].dtype and torch.equal(self.tensors[k], other.tensors[k])
                for k in self.tensors
            )
            and self.rows == other.rows
            and self.meta == other.meta
        )

    # -- reshaping --------------------------------------------------------------------------------------------
    def take(self, indices: Sequence[int] | torch.Tensor) -> "Batch":
        """Rows at `indices`, in that order (select, reorder, and repeat in one primitive)."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        n = len(self)
        if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"row index out of range for a batch of {n} rows")
        ilist = idx.tolist()
        return Batch(
            {k: v.index_select(0, idx) for k, v in self.tensors.items()},
            {k: [v[i] for i in ilist] for k, v in self.rows.items()},
            self.meta,
        )

    def slice(self, start: int, stop: int) -> "Batch":
        """Rows `start:stop` as views (no copy)."""
        return Batch(
            {k: v[start:stop] for k, v in self.tensors.items()},
            {k: v[start:stop] for k, v in self.rows.items()},
            self.meta,
        )

    def split(self, parts: int) -> list["Batch"]:
        """`parts` equal, contiguous parts; a batch that does not divide is an error (pad it first)."""
        self.check_split(parts)
        size = len(self) // parts
        return [self.slice(i * size, (i + 1) * size) for i in range(parts)]

    def check_split(self, parts: int) -> None:
        """Raise what `split(parts)` would raise for this batch, without splitting it."""
        n = len(self)
        if parts < 1:
            raise ValueError(f"cannot split a batch into {parts} parts; parts must be >= 1")
        if n % parts:
            raise ValueError(
                f"batch of {n} rows cannot be split into {parts} equal parts; pad it "
                f"(Batch.pad_to_multiple({parts})) or change the batch size to a multiple of {parts}"
            )

    def chunk(self, size: int) -> list["Batch"]:
        """Contiguous parts of `size` rows (the last may be shorter), e.g. micro-batches."""
        if size < 1:
            raise ValueError(f"chunk size must be >= 1, got {size}")
        return [self.slice(i, min(i + size, len(self))) for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Iterable["Batch"]) -> "Batch":
        """Rows of all batches in order; fields must match. Meta is taken from the first batch."""
        batches = list(batches)
        if not batches:
            raise ValueError("cannot concatenate an empty list of batches")
        first = batches[0]
        for i, b in enumerate(batches[1:], 1):
            if b.tensors.keys() != first.tensors.keys() or b.rows.keys() != first.rows.keys():
                raise ValueError(
                    f"cannot concatenate batches with different fields: part 0 has "
                    f"{sorted(first.keys())}, part {i} has {sorted(b.keys())}"
                )
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        rows = {k: [x for b in batches for x in b.rows[k]] for k in first.rows}
        return Batch(tensors, rows, first.meta)

    def union(self, *others: "Batch") -> "Batch":
        """Fields of all batches side by side (same rows). A field present twice must be equal in both."""
        out = Batch(self.tensors, self.rows, self.meta)
        for other in others:
            if len(other) != len(out) and (other.tensors or other.rows) and (out.tensors or out.rows):
                raise ValueError(
                    f"cannot union batches of {len(out)} and {len(other)} rows; a union joins "
                    f"fields of the same rows (use Batch.concat to append rows)"
                )
            for k, v in other.tensors.items():
                if k in out.tensors and not (out.tensors[k].shape == v.shape and torch.equal(out.tensors[k], v)):
                    raise ValueError(
                        f"cannot union: both batches have tensor {k!r} with different values; rename one of them"
                    )
                out.tensors[k] = v
            for k, v in other.rows.items():
                if k in out.rows and out.rows[k] != v:
                    raise ValueError(f"cannot union: both batches have rows {k!r} with different values")
                out.rows[k] = list(v)
            out.meta.update(other.meta)
        return out

    def pad_to_multiple(self, multiple: int) -> tuple["Batch", int]:
        """Append copies of the last row until the length divides `multiple`; returns (batch, rows added).

        Padding rows repeat real data (rather than zeros) so every model sees valid inputs; drop them from the
        results with `batch.slice(0, len(batch) - added)`.
        """
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        n = len(self)
        if n == 0:
            raise ValueError("cannot pad an empty batch: it has no row to repeat")
        added = (-n) % multiple
        if not added:
            return self, 0
        return Batch.concat([self, self.take([n - 1] * added)]), added

    # -- field edits ----------------------------------------------------------------------------------------
    def select(self, *names: str) -> "Batch":
        """Only the named fields (tensors or rows)."""
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"batch has no fields {missing}; it has {sorted(self.keys())}")
        return Batch(
            {k: v for k, v in self.tensors.items() if k in names},
            {k: v for k, v in self.rows.items() if k in names},
            self.meta,
        )

    def with_meta(self, **meta: Any) -> "Batch":
        return Batch(self.tensors, self.rows, {**self.meta, **meta})
