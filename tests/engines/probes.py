"""Worker classes for engine tests (importable on worker processes)."""

from __future__ import annotations

import torch

from engines.models.config import ModelConfig, build_model, build_tokenizer
from engines.roles import ActorWorker
from engines.training.common import OptimConfig
from engines.training.parallel import parallelize
from engines.training.torch_native import TrainEngine
from flowactors import ALL_TO_ALL, ONE_TO_ALL, Batch, Worker, endpoint


def fixed_batch(n: int = 4, width: int = 10, resp: int = 4, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (n, width), generator=g)
    mask = torch.ones(n, width, dtype=torch.long)
    mask[0, :3] = 0  # one left-padded row
    rmask = torch.ones(n, resp, dtype=torch.long)
    rmask[1, -2:] = 0
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, -resp:],
            "response_mask": rmask,
            "advantages": torch.randn(n, resp, generator=g),
        }
    )


def squared_value_loss(outputs: dict[str, torch.Tensor], mb: Batch):
    """0.5 (V - return)^2 over the response tokens. Reports its masked mean (`vf_loss`) and a constant `vf` = 1,
    which pipeline-parallel tests use to see that every stage gets the last stage's metrics."""
    loss, mask = 0.5 * (outputs["values"] - mb["returns"]) ** 2, mb["response_mask"].float()
    return loss, mask, {"vf": 1.0, "vf_loss": float((loss.detach() * mask).sum() / mask.sum())}


def pg_loss(outputs, mb):
    return -(outputs["log_probs"] * mb["advantages"]), mb["response_mask"].float(), {}


class ParallelProbe(Worker):
    """Builds the same tiny model under the group's mesh and reports logits, grads and post-update weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        tok = build_tokenizer(cfg)
        self.model = (
            parallelize(build_model(cfg, "lm", tok), self.mesh) if self.world_size > 1 else build_model(cfg, "lm", tok)
        )
        self.engine = TrainEngine(
            self.model,
            OptimConfig(lr=1e-2, micro_batch_tokens=20),
            dp_group=self.mesh["dp"].get_group(),
            dp_size=self.layout.dp,
        )

    @endpoint(protocol=ONE_TO_ALL)
    def logits_and_grads(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.model.zero_grad()
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = out.logits
        logits.float().pow(2).mean().backward()
        grads = {}
        for n, p in self.model.named_parameters():
            g = p.grad
            grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        return logits.detach(), grads

    @endpoint(protocol=ALL_TO_ALL)  # rank r gets its own list of mini-batch shares
    def update_then_weights(self, shares: list[Batch]) -> dict[str, torch.Tensor]:
        mb = len(shares[0]) // 2 if len(shares[0]) > 1 else 1
        self.engine.update(
            [m for s in shares for m in s.chunk(mb)], pg_loss, lambda b: self.engine.policy_outputs(b, 1.0, False)
        )
        return self.engine.full_state_dict()


class HybridActorProbe(ActorWorker):
    """The actor with the 3D-HybridEngine, plus a look at what its generation model is bound to."""

    @endpoint(protocol=ONE_TO_ALL)
    def reshard_report(self) -> dict:
        """Reshard once; compare the bound generation weights with the slice of the full weights they must be."""
        from engines.hybrid import expected_generation_state_dict, expected_received_bytes

        hy = self.hybrid
        full = self.engine.full_state_dict()
        hy.generation_model()
        try:
            got = dict(hy.generation_weights())
            want = expected_generation_state_dict(full, hy.geometry, hy.layout, hy.rank)
            flat = hy.train.flat
            lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            report = {
                "names_match": sorted(got) == sorted(want),
                "max_err": max(float((got[k] - want[k]).abs().max()) for k in want),
                "received": hy.stats.received_bytes,
                "expected_received": expected_received_bytes(
                    hy.geometry, hy.layout, hy.rank, "micro-dp", flat.element_size()
                ),
                "redundant": hy.stats.redundant_bytes,
                "gen_param_bytes": hy.stats.gen_param_bytes,
                "model_bytes": hy.geometry.numel * flat.element_size(),
                "bound_to_training_memory": sum(lo <= t.data_ptr() < hi for t in got.values()),
                "extra_generation_bytes": hy.extra_generation_bytes,
                "gen_coord": tuple(hy.layout.gen_coord(hy.rank)),
            }
        finally:
            hy.release()
        # training parameters are still the views of the flat buffer
        report["training_params_in_buffer"] = all(
            lo <= (p.to_local() if hasattr(p, "to_local") else p).data_ptr() < hi
            for p in self.engine.model.parameters()
        )
        return report

    @endpoint(protocol=ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.full_state_dict()

    @endpoint(protocol=ONE_TO_ALL)
    def optimizer_report(self) -> dict:
        """This rank's Adam state bytes, and what a whole replica's would be (two fp32 moments of every local
        parameter shard, and a step each)."""
        params = list(self.engine.model.parameters())
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        return {
            "state_bytes": self.engine.optimizer_state_bytes(),
            "replica_bytes": sum(2 * t.numel() * 4 + 4 for t in local),
            "owners": self.engine.owners,
        }
