"""Per-rank figures of the three resharding methods: HybridFlow Table 2, and the exact values for a real model.

`table2` gives the paper's formulas for a model of M bytes that shards perfectly. A real Llama does not quite:
its norms are replicated on every TP rank (so never exchanged within a stage), and stages differ (stage 0 holds
the embedding, the last stage the final norm and lm_head, middle stages neither). `expected_received_bytes` and
`expected_gen_param_bytes` give what each method must move and hold on a given rank, computed from the shard
layouts by a route independent of the collectives; the tests and the benchmark compare measured figures to both.
On a layout whose stages hold equal sharded payloads (p ≤ 2, untied lm_head), the measured bytes are exactly
`table2` on the sharded bytes M_s plus the replicated bytes of the stages a rank lacks (none when p_g = p).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from engines.hybrid.layout import HybridLayout
from engines.hybrid.reshard import Method
from engines.hybrid.shards import ModelGeometry, shard_layout

__all__ = ["Table2Row", "expected_gen_param_bytes", "expected_received_bytes", "replicated_bytes_missing", "table2"]


@dataclass(frozen=True)
class Table2Row:
    """HybridFlow Table 2, per rank, for a model of M bytes."""

    comm_bytes: Fraction
    peak_param_bytes: Fraction
    redundant_bytes: Fraction


def table2(method: Method, layout: HybridLayout, model_bytes: int) -> Table2Row:
    m = Fraction(model_bytes)
    tp, n, gen = layout.train_tp * layout.train_pp, layout.world_size, layout.gen_tp * layout.gen_pp
    if method == "all":
        return Table2Row(m * (n - 1) / n, m, m / n)
    if method == "tp-pp":
        return Table2Row(m * (tp - 1) / tp, m, m / tp)
    return Table2Row(m * (tp - gen) / (gen * tp), m / gen, Fraction(0))


def _sharded(geometry: ModelGeometry, layout: HybridLayout, stage: int) -> int:
    return shard_layout(geometry, layout.train_pp, stage, layout.train_tp).sharded_numel


def _replicated(geometry: ModelGeometry, layout: HybridLayout, stage: int) -> int:
    return shard_layout(geometry, layout.train_pp, stage, layout.train_tp).replicated_numel


def replicated_bytes_missing(
    geometry: ModelGeometry, layout: HybridLayout, rank: int, method: Method, itemsize: int
) -> int:
    """Bytes of the replicated tensors (norms) of the stages this rank's generation set needs but it lacks."""
    mine = layout.train_coord(rank).pp
    if method == "micro-dp":
        stages = [layout.train_coord(r).pp for r in layout.stage_peers(rank)]
    else:
        stages = list(range(layout.train_pp))
    return itemsize * sum(_replicated(geometry, layout, pp) for pp in stages if pp != mine)


def expected_received_bytes(
    geometry: ModelGeometry, layout: HybridLayout, rank: int, method: Method, itemsize: int
) -> int:
    """Bytes `method` must deliver to `rank`: the sharded payloads it lacks (as the method splits them) plus the
    replicated tensors of the stages it lacks."""
    if method == "micro-dp":
        sources = [r for r in layout.micro_dp_group(rank) if r != rank]
        sharded = sum(_sharded(geometry, layout, layout.train_coord(r).pp) for r in sources)
    elif method == "tp-pp":
        sources = [r for r in layout.model_parallel_group(rank) if r != rank]
        sharded = sum(_sharded(geometry, layout, layout.train_coord(r).pp) for r in sources)
    else:  # "all": rank (pp, dp, tp) sends part dp (of d, as torch.tensor_split cuts) of shard (pp, tp)
        d, sharded = layout.train_dp, 0
        for r in range(layout.world_size):
            c = layout.train_coord(r)
            if r != rank:
                n = _sharded(geometry, layout, c.pp)
                sharded += n // d + (1 if c.dp < n % d else 0)
    return itemsize * sharded + replicated_bytes_missing(geometry, layout, rank, method, itemsize)


def expected_gen_param_bytes(
    geometry: ModelGeometry, layout: HybridLayout, rank: int, method: Method, itemsize: int
) -> int:
    """Bytes of the generation parameter set `method` leaves on `rank` (the local shard included)."""
    if method != "micro-dp":
        return itemsize * geometry.numel
    sharded = sum(_sharded(geometry, layout, layout.train_coord(r).pp) for r in layout.micro_dp_group(rank))
    replicated = sum(_replicated(geometry, layout, layout.train_coord(r).pp) for r in layout.stage_peers(rank))
    return itemsize * (sharded + replicated)
