"""A Dask preload for rollout pool workers (`dask worker --resources rollout=1 --preload engines.preload`).

Importing torch, transformers and the engines takes seconds of CPU; a worker that joins a running job would pay
them in its first call, while the trainer and the other replicas hold the cores. Preloaded, they are paid before the
worker registers with the scheduler, so an elastic fleet's join (algorithms.rollout.fleet) takes the time its model
takes to build and load. The embedded cluster's and Slurm's pool workers load it (Controller.resize_pool).
"""

from __future__ import annotations

from typing import Any

import transformers

import engines
import engines.rollout.replica  # noqa: F401
from engines.models.config import SUPPORTED_ARCHITECTURES

# transformers loads each model class on first use, the bulk of building a replica: load the ones we build
for _name in SUPPORTED_ARCHITECTURES:
    getattr(transformers, _name)

__all__ = ["dask_setup"]


def dask_setup(worker: Any = None) -> None:
    """Nothing to do at setup: the imports above are the point."""
