"""The torch-native training engine: forward passes for scoring and loss-driven updates.

One interface for every role (docs/design.md §4): `log_probs`, `values` and `scores` run forward passes in micro-batches
without gradients; `update` runs mini-batch steps where the algorithm supplies the loss. The engine owns
micro-batching (by a token budget), gradient accumulation, clipping, AdamW and the LR schedule.

Mixed precision. A trainable model given in bfloat16/float16 is trained with float32 parameters (the optimizer's
master weights, as Megatron keeps "main params") and computes in its low-precision dtype under autocast: steps
smaller than half a bf16 ulp would otherwise round away (an RL learning rate of 1e-6 on weights of ~0.1 moves
nothing). Frozen models (reference, reward) keep their low-precision weights.

Loss aggregation is token-mean over the whole mini-batch across data-parallel ranks: each micro-batch's summed
token loss is divided by the mini-batch's global token count (one all-reduce), and multiplied by the DP size
because FSDP2 averages gradients over ranks. The update is therefore the same whatever the DP size or the
micro-batch split, which is what makes a dp=2 run reproduce a dp=1 run.

Optimizer state over DP (ZeRO-1). A model whose DP ranks hold whole replicas (the 3D-HybridEngine's actor, whose
parameters stay in Megatron's layout for resharding) would otherwise keep the full Adam state on every replica.
With `sync_grads` each parameter has one owner among the DP ranks (greedy by size): gradients are reduced to it,
it alone keeps the parameter's Adam moments and steps it, and broadcasts the result (Megatron's distributed
optimizer does the same per flat-buffer range; here per parameter, which keeps every parameter a (D)Tensor and the
checkpoint in model space). The optimizer state per rank is then about 1/d of the replica's; the update equals the
unsharded one (same gradient sum, same AdamW per element, the norm summed over owners). Checkpoints are written in
the unsharded optimizer's format (`get_state_dict`'s), each owner writing its parameters' state, so they load under
any DP size, sharded or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from engines.fields import TEACHER_TOP_IDS
from engines.ops import (
    compute_precision,
    entropy_from_logits,
    position_ids_from_mask,
    response_logits,
    support_log_probs,
    token_log_probs,
    top_log_probs,
)
from engines.training.common import LossFn, OptimConfig, token_mean
from engines.training.lora import is_adapter
from engines.training.packing import pack, packed_micro_batches
from flowactors import Batch

__all__ = ["TrainEngine", "assign_owners"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def assign_owners(model: torch.nn.Module, dp_size: int) -> dict[str, int]:
    """ZeRO-1 ownership: each trainable parameter to one DP rank, largest first to the least loaded (ties: the lower
    rank), so every rank keeps about 1/dp_size of the optimizer state. Global shapes only, so every rank of every TP
    and DP coordinate computes the same map."""
    params = sorted(
        ((n, p.numel()) for n, p in model.named_parameters() if p.requires_grad), key=lambda x: (-x[1], x[0])
    )
    load = [0] * dp_size
    owners = {}
    for name, numel in params:
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += numel
    return owners


class TrainEngine:
    """A (possibly sharded) transformers model with its optimiser. `dp_group` is the data-parallel group."""

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig | None,
        *,
        dp_group: Any = None,
        dp_size: int = 1,
        trainable: bool = True,
        sync_grads: bool = False,
        shard_optimizer: bool = True,
        compute_dtype: torch.dtype | None = None,
        pack_sequences: bool = False,
        pad_token_id: int = 0,
        lora_scale: float | None = None,
    ) -> None:
        """`compute_dtype`: autocast dtype of forward passes (bfloat16/float16), for a model whose float32
        parameters are the master weights; a plain trainable model given in low precision is converted here.
        `pack_sequences`: forward passes over packed rows (engines.training.packing), micro-batches by valid
        tokens; `pad_token_id` fills the bins' tails. `lora_scale`: the model carries LoRA adapters
        (engines.training.lora) with this scale: checkpoints hold only the trainable tensors (adapters, a critic's
        head) and their optimizer state, and `full_state_dict` gives the merged plain model.
        `sync_grads`: DP ranks hold whole replicas (no FSDP) and the engine reduces their gradients;
        `shard_optimizer` then shards the optimizer state over them (ZeRO-1, see the module docstring)."""
        low = [p for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
        if trainable and low:
            from torch.distributed.tensor import DTensor

            if any(isinstance(p, DTensor) for p in low):
                raise ValueError(
                    "a sharded model in low precision has no float32 master weights to train: build it "
                    "in float32 before parallelizing and pass compute_dtype (the roles do)"
                )
            compute_dtype = compute_dtype or low[0].dtype
            model.float()
        self.compute_dtype = compute_dtype
        self.model = model
        self.pack_sequences, self.pad_token_id = pack_sequences, pad_token_id
        self.lora_scale = lora_scale
        self.cfg = optim or OptimConfig()
        self.dp_group, self.dp_size = dp_group, dp_size
        # sync_grads: DP ranks hold whole replicas (no FSDP), so the engine averages gradients over dp_group itself
        self.sync_grads = sync_grads and dp_size > 1
        self.optimizer = None
        self.scheduler = None
        self.owners: dict[str, int] | None = None
        """ZeRO-1: parameter name → the DP rank (in dp_group) that keeps its optimizer state and steps it."""
        self._owner_ranks: list[tuple[torch.nn.Parameter, int]] = []
        """ZeRO-1: (parameter, its owner's global rank) in the model's order, the same on every rank, so the
        collectives over them pair up."""
        if trainable:
            params = list(model.parameters())
            if self.sync_grads and shard_optimizer:
                self.owners = assign_owners(model, dp_size)
                mine = dist.get_rank(dp_group)
                params = [p for n, p in model.named_parameters() if self.owners.get(n) == mine]
                self._owner_ranks = [
                    (p, dist.get_global_rank(dp_group, self.owners[n]))
                    for n, p in model.named_parameters()
                    if n in self.owners
                ]
            self.optimizer = torch.optim.AdamW(
                params, lr=self.cfg.lr, betas=self.cfg.betas, eps=self.cfg.eps, weight_decay=self.cfg.weight_decay
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        else:
            model.requires_grad_(False)

    def _lr_factor(self, step: int) -> float:
        return self.cfg.lr_factor(step)

    # -- forward passes ---------------------------------------------------------------------------------------
    def micro_batches(self, batch: Batch) -> list[Batch]:
        if self.pack_sequences:
            return packed_micro_batches(batch, self.cfg.micro_batch_tokens)
        width = int(batch["input_ids"].shape[1])
        rows = max(1, self.cfg.micro_batch_tokens // max(1, width))
        return batch.chunk(rows) if len(batch) else []

    def autocast(self) -> Any:
        """The forward passes' precision context (a no-op for float32 compute)."""
        return compute_precision(self.model, self.compute_dtype)

    def _forward(self, mb: Batch) -> Any:
        mask = mb["attention_mask"]
        pos = mb["position_ids"] if "position_ids" in mb else position_ids_from_mask(mask)
        return self._run(mb["input_ids"], mask, pos)

    def _run(self, input_ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor) -> Any:
        with self.autocast():
            return self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False)

    def _response_outputs(self, mb: Batch) -> torch.Tensor:
        """The head's per-token outputs (B, R, ...) at the positions that predict each response token."""
        if not self.pack_sequences:
            return response_logits(self._forward(mb).logits, mb["responses"].shape[1])
        packed = pack(mb, self.pad_token_id)
        return packed.gather(self._run(packed.input_ids, None, packed.position_ids).logits, packed.response_index)

    def policy_outputs(
        self, mb: Batch, temperature: float, with_entropy: bool, top_k: int = 0
    ) -> dict[str, torch.Tensor]:
        """Per response token: `log_probs` of the sampled token, `entropy`; with `top_k`, the k most likely tokens
        (`top_log_probs`, `top_ids`); where the batch carries a teacher's top-k ids, this model's log-probs of
        them (`support_log_probs`: on-policy distillation's loss)."""
        logits = self._response_outputs(mb)
        out = {"log_probs": token_log_probs(logits, mb["responses"], temperature)}
        if with_entropy:
            out["entropy"] = entropy_from_logits(logits, temperature)
        if top_k:
            out["top_log_probs"], out["top_ids"] = top_log_probs(logits, top_k, temperature)
        if TEACHER_TOP_IDS in mb:
            out["support_log_probs"] = support_log_probs(logits, mb[TEACHER_TOP_IDS], temperature)
        return out

    def value_outputs(self, mb: Batch) -> dict[str, torch.Tensor]:
        # (B, R, 1) from a token-classification head
        return {"values": self._response_outputs(mb).squeeze(-1).float()}

    @torch.no_grad()
    def log_probs(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False, top_k: int = 0) -> Batch:
        self.model.eval()
        outs = [self.policy_outputs(mb, temperature, with_entropy, top_k) for mb in self.micro_batches(batch)]
        return Batch({k: torch.cat([o[k] for o in outs]) for k in outs[0]}) if outs else Batch()

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        return torch.cat([self.value_outputs(mb)["values"] for mb in self.micro_batches(batch)])

    @torch.no_grad()
    def scores(self, batch: Batch) -> torch.Tensor:
        """One scalar per sequence from a sequence-classification head (read at the last non-pad token)."""
        self.model.eval()
        return torch.cat([self.score_outputs(mb)["scores"] for mb in self.micro_batches(batch)])

    def score_outputs(self, mb: Batch) -> dict[str, torch.Tensor]:
        """`scores` of one micro-batch, with gradients (training a reward or cost model)."""
        if not self.pack_sequences:
            return {"scores": self._forward(mb).logits.squeeze(-1).float()}
        # the head pools one position per bin; its per-token output, caught on the way, holds every row's
        packed = pack(mb, self.pad_token_id)
        caught: list[torch.Tensor] = []
        hook = self.model.score.register_forward_hook(lambda _m, _i, out: caught.append(out))
        try:
            self._run(packed.input_ids, None, packed.position_ids)
        finally:
            hook.remove()
        return {"scores": packed.gather(caught[-1], packed.last_index).squeeze(-1).float()}

    # -- updates ----------------------------------------------------------------------------------------------
    def update(
        self, mini_batches: list[Batch], loss_fn: LossFn, outputs_fn: Callable[[Batch], dict[str, torch.Tensor]]
    ) -> dict[str, float]:
        """One optimizer step per mini-batch; returns metrics averaged over the steps (token-weighted)."""
        if self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer (trainable=False); it cannot update")
        self.model.train()
        sums: dict[str, float] = {}
        tokens = 0.0
        norms = []
        for mini in mini_batches:
            global_tokens = torch.tensor([float(mini["response_mask"].sum())], dtype=torch.float64)
            if self.dp_size > 1:
                dist.all_reduce(global_tokens, group=self.dp_group)
            denom = max(float(global_tokens), 1.0)
            # the optimizer's parameters (FSDP2 may leave others registered); under ZeRO-1 the rest were dropped
            self.optimizer.zero_grad(set_to_none=True)
            for mb in self.micro_batches(mini):
                token_loss, weight, metrics = loss_fn(outputs_fn(mb), mb)
                ((token_loss * weight).sum() / denom * self.dp_size).backward()
                w = float(mb["response_mask"].sum())
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * w
                tokens += w
            if self.owners is not None:
                self._reduce_grads_to_owners()
                norms.append(self._clip(over=self.dp_group))
                self.optimizer.step()
                self._broadcast_from_owners()
            else:
                if self.sync_grads:
                    self._average_grads()
                norms.append(self._clip())
                self.optimizer.step()
            self.scheduler.step()
        out = token_mean(sums, tokens, self.dp_group if self.dp_size > 1 else None)
        out["grad_norm"] = sum(norms) / max(len(norms), 1)
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    def set_lr(self, lr: float) -> None:
        """Set the peak learning rate the schedule scales (e.g. warm start and RL use different rates)."""
        self.scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = lr * self._lr_factor(self.scheduler.last_epoch)

    def _average_grads(self) -> None:
        """Mean of the replicas' gradients (what FSDP2's reduce-scatter gives), all tensors in flight at once."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        locals_ = [_local(g) for g in grads]
        works = [dist.all_reduce(g, group=self.dp_group, async_op=True) for g in locals_]
        for work in works:
            work.wait()
        for g in locals_:
            g.div_(self.dp_size)

    def _reduce_grads_to_owners(self) -> None:
        """Sum every gradient on its owner (all in flight at once) and average it there; the other ranks drop
        theirs, so after the step only owners hold gradients and optimizer state."""
        me = dist.get_rank()
        owned = [(p, src) for p, src in self._owner_ranks if p.grad is not None]
        works = [dist.reduce(_local(p.grad), dst=src, group=self.dp_group, async_op=True) for p, src in owned]
        for work in works:
            work.wait()
        for p, src in owned:
            if src == me:
                _local(p.grad).div_(self.dp_size)
            else:
                p.grad = None

    def _broadcast_from_owners(self) -> None:
        """Every owner's stepped parameters to the other replicas (in place: the hybrid engine's parameters are
        views of its training buffer)."""
        works = [
            dist.broadcast(_local(p.data), src=src, group=self.dp_group, async_op=True) for p, src in self._owner_ranks
        ]
        for work in works:
            work.wait()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shard under ZeRO-1)."""
        if self.optimizer is None:
            return 0
        return sum(
            _local(v).numel() * v.element_size()
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )

    def _clip(self, over: Any = None) -> float:
        """Global gradient norm over all parameters (sharded DTensors and plain tensors alike), then clip.
        `over`: a group whose ranks each hold some of the gradients (ZeRO-1 owners): their squares are summed."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64)
        for group in ([g for g in grads if isinstance(g, DTensor)], [g for g in grads if not isinstance(g, DTensor)]):
            if group:
                n = torch.nn.utils.get_total_norm([g.float() for g in group])  # a bf16 norm rounds to ~0.4 %
                squares = squares + (n.full_tensor() if isinstance(n, DTensor) else n).double() ** 2
        if over is not None:
            dist.all_reduce(squares, group=over)
        elif not grads:
            return 0.0
        norm = float(squares.sqrt())
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            coef = self.cfg.grad_clip / (norm + 1e-6)
            for g in grads:
                g.mul_(coef)
        return norm

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's shards for torch.distributed.checkpoint: "model", and when training "optim" and
        "scheduler" (the LR schedule's position). Under ZeRO-1 "optim" holds this rank's parameters' state in the
        unsharded optimizer's layout (see the module docstring)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        opt = self.optimizer
        model_sd, optim_sd = get_state_dict(
            self.model, opt if opt is not None and self.owners is None else [], options=self._state_options()
        )
        state = {"model": model_sd}
        if opt is not None:
            state["optim"] = optim_sd if self.owners is None else self._owned_optim_state()
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def _owned_optim_state(self) -> dict[str, Any]:
        """{"state": {name: AdamW state}} for the parameters this rank owns (zeros and step 0 before the first
        step, as `get_state_dict` gives), and "param_groups" naming every parameter, as the unsharded optimizer
        writes them."""
        state = {}
        mine = {id(p) for p in self.optimizer.param_groups[0]["params"]}
        for name, param in self.model.named_parameters():
            if id(param) not in mine:
                continue
            held = self.optimizer.state.get(param) or {}
            state[name] = {
                "step": held.get("step", torch.zeros((), dtype=torch.float32)),
                "exp_avg": held.get("exp_avg", torch.zeros_like(param.data)),
                "exp_avg_sq": held.get("exp_avg_sq", torch.zeros_like(param.data)),
            }
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return {"state": state, "param_groups": [{**group, "params": names}]}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Apply a `checkpoint_state()` dict that torch.distributed.checkpoint has filled in place."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        opt = self.optimizer
        sharded = self.owners is not None
        set_state_dict(
            self.model,
            opt if opt is not None and not sharded else [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}) if not sharded else {},
            options=self._state_options(loading=True),
        )
        if sharded and opt is not None:
            by_name = dict(self.model.named_parameters())
            for name, held in state["optim"]["state"].items():
                opt.state[by_name[name]] = dict(held)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def frozen_state(self) -> dict[str, Any]:
        """{"model": this rank's shards of the frozen tensors}, named as any model's checkpoint names them: an
        adapted model's base, loaded from the checkpoint of the model it was adapted from."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {"model": {k: v for k, v in get_model_state_dict(self.model).items() if k not in trainable}}

    def load_frozen_state(self, state: dict[str, Any]) -> None:
        """Apply a `frozen_state()` dict that torch.distributed.checkpoint has filled in place."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=False))

    def _state_options(self, loading: bool = False) -> Any:
        """Checkpoints of an adapted model hold its trainable tensors only; its frozen base comes from elsewhere
        (`load_frozen_state`), so loading leaves those keys alone (torch.distributed.checkpoint has already
        refused a checkpoint that lacks any key asked for)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        adapted = self.lora_scale is not None
        return StateDictOptions(ignore_frozen_params=adapted, strict=not (adapted and loading))

    def full_state_dict(self, merged: bool = True, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded parameters on CPU (every rank of the group must call this: it all-gathers); with LoRA, the
        merged plain model's (`merged=False`: the base and the adapters apart; `adapters_only`: the adapters
        alone, gathering nothing else)."""
        out = {}
        for name, t in self.model.state_dict().items():
            if adapters_only and not is_adapter(name):
                continue
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            # a copy in every case: on CPU, `.cpu()` of a plain parameter (or of a DTensor's full tensor on a mesh
            # of one) is the parameter itself, which a later update or load would change under a kept result
            out[name] = t.detach().to("cpu", copy=True)
        if self.lora_scale is not None and merged and not adapters_only:
            from engines.training.lora import merged_state_dict

            out = merged_state_dict(out, self.lora_scale)
        return out
