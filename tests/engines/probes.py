"""Worker classes for engine tests (importable on worker processes)."""

from __future__ import annotations

import torch

from engines.models import ModelConfig, build_model, build_tokenizer
from engines.parallel import parallelize
from engines.training import OptimConfig, TrainEngine
from flowactors import ALL_TO_ALL, ONE_TO_ALL, Batch, Worker, endpoint


def fixed_batch(n: int = 4, width: int = 10, resp: int = 4, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (n, width), generator=g)
    mask = torch.ones(n, width, dtype=torch.long)
    mask[0, :3] = 0  # one left-padded row
    rmask = torch.ones(n, resp, dtype=torch.long)
    rmask[1, -2:] = 0
    return Batch({"input_ids": ids, "attention_mask": mask, "responses": ids[:, -resp:], "response_mask": rmask,
                  "advantages": torch.randn(n, resp, generator=g)})


def pg_loss(outputs, mb):
    return -(outputs["log_probs"] * mb["advantages"]), mb["response_mask"].float(), {}


class ParallelProbe(Worker):
    """Builds the same tiny model under the group's mesh and reports logits, grads and post-update weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        tok = build_tokenizer(cfg)
        self.model = parallelize(build_model(cfg, "lm", tok), self.mesh) if self.world_size > 1 \
            else build_model(cfg, "lm", tok)
        self.engine = TrainEngine(self.model, OptimConfig(lr=1e-2, micro_batch_tokens=20),
                                  dp_group=self.mesh["dp"].get_group(), dp_size=self.layout.dp)

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
        self.engine.update([m for s in shares for m in s.chunk(mb)], pg_loss,
                           lambda b: self.engine.policy_outputs(b, 1.0, False))
        return self.engine.full_state_dict()
