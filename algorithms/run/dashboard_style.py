"""How the RLHF roles look on the flowactors dashboard page (`flowactors.dashboard`).

flowactors knows nothing about RLHF (docs/design.md §2), so the program tells the page which roles it has; the metrics
it charts are the algorithm's own `key_metrics`. The roles of HybridFlow's Table 4 get fixed colours so a screenshot
reads the same from run to run and from algorithm to algorithm; any other group (a helper such as `fusion`) gets
a palette colour the page picks, never one of these.
"""

from __future__ import annotations

__all__ = ["ROLE_COLORS"]

ROLE_COLORS = {
    "actor": "#4e79a7",
    "critic": "#f28e2b",
    "ref": "#59a14f",
    "reward": "#b07aa1",
    "cost": "#e15759",
    "cost_critic": "#9c755f",
    "rollout": "#76b7b2",
    "teacher": "#edc948",
}
