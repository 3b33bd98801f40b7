"""The actor's endpoints of asynchronous RL's weight sync (algorithms.rollout.asynchronous drives them): the
trainer's policy out of the trainer's ranks, into a rollout replica's (docs/asynchronous.md).

A mixin of engines.roles.ActorWorker: it uses the worker's training engine, rank and weights version.
"""

from __future__ import annotations

import time

import torch

from flowactors import ONE_TO_ALL, RANK_ZERO, endpoint

__all__ = ["ReplicaEndpoints"]


class ReplicaEndpoints:
    """policy_weights on the trainer, load_policy on a replica."""

    policy_version: int | None = None
    """The trainer's policy version this replica's weights are (load_policy); None on the trainer itself."""

    @endpoint(protocol=RANK_ZERO)
    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The whole policy (Hugging Face names, unsharded, on CPU) for rollout replicas: every rank takes part in
        the gather, rank 0's copy is the call's result, so it travels from that worker to the replicas."""
        self._end_receiving()
        state = self.engine.full_state_dict()
        return state if self.rank == 0 else {}

    @endpoint(protocol=ONE_TO_ALL)
    def load_policy(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Become a rollout replica of the trainer's policy `version` (asynchronous RL): load `weights`
        (`policy_weights` of the trainer, any layout) into this rank's whole copy; the generation engine takes
        them at the next generate. Returns the bytes received and the seconds it took."""
        t0 = time.perf_counter()
        if self.hybrid is not None:
            raise ValueError("a rollout replica generates from its own weights: build it without rollout_tp")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # whole tensors in, this rank's layout out (plain, replicated or sharded parameters alike); every rank
        # of the replica group calls this, so a layout that distributes tensors may use collectives
        set_model_state_dict(self.engine.model, weights, options=StateDictOptions(full_state_dict=True))
        self.weights_version += 1
        self.policy_version = int(version)
        return {
            "bytes": float(sum(t.numel() * t.element_size() for t in weights.values())),
            "seconds": time.perf_counter() - t0,
        }
