"""Test-only workers for the fusion tests (worker processes import them by module name)."""

from __future__ import annotations

import time

import torch

from engines import ActorWorker
from flowactors import MESH, Batch, Worker, endpoint


class FailingReward(Worker):
    """A reward that fails on the chunk holding one row, so one chunk's scoring fails and the others succeed."""

    def __init__(self, bad_row: int) -> None:
        self.bad_row = bad_row

    @endpoint(protocol=MESH)
    def compute_reward(self, batch: Batch) -> Batch:
        if self.bad_row in batch["row_index"].tolist():
            raise ValueError(f"reward model cannot score row {self.bad_row}")
        return Batch({"rewards": torch.zeros(len(batch))})


class SlowDecodeActor(ActorWorker):
    """An actor whose decode steps take at least `step_s`: a long tail that lasts long enough to see scoring of
    the first chunks run beside it, whatever the load of the machine. The hook goes on the model it generates
    with (a data-parallel actor's is a gathered copy of its sharded training model)."""

    def __init__(self, *args, step_s: float = 0.02) -> None:
        super().__init__(*args)
        self.step_s = step_s

    def _generation_model(self) -> torch.nn.Module:
        model = super()._generation_model()
        if not getattr(model, "_slow_decode", False):

            def slow_decode(module, args, kwargs):
                ids = kwargs.get("input_ids")
                if ids is not None and ids.shape[1] == 1:
                    time.sleep(self.step_s)

            model.register_forward_pre_hook(slow_decode, with_kwargs=True)
            model._slow_decode = True
        return model
