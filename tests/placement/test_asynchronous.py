"""The cluster-scale estimate of asynchronous RL (placement/asynchronous.py) against its own definition."""

import pytest
import torch

from placement.asynchronous import estimate_async
from placement.hardware import h100
from placement.models import llama_7b
from placement.simulator import Simulator, Workload


def _lengths(n: int, longest: int) -> list[int]:
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return ((longest // 32) * (1 - u) ** -1.0).long().clamp(1, longest).tolist()


def test_the_split_overlaps_generation_with_training_and_picks_the_best_split():
    wl = Workload(prompts_per_step=64, prompt_tokens=512, response_tokens=4096, samples_per_prompt=8)
    sim = Simulator(h100(), wl)
    lengths = _lengths(wl.generated_sequences, wl.response_tokens)
    e = estimate_async(sim, llama_7b(), lengths, gpus=32)
    assert e.sync_iteration_s == pytest.approx(e.generate_s + e.score_s + e.train_s)
    assert e.async_iteration_s == max(e.async_generate_s, e.async_train_s)
    assert 1.0 < e.speedup < 2.0  # overlap can at most hide the shorter side
    assert e.rollout_gpus % 4 == 0 and 0 < e.rollout_gpus < 32
    # the chosen split is no worse than its neighbours
    for other in (e.rollout_gpus - 4, e.rollout_gpus + 4):
        if 0 < other < 32:
            from placement.asynchronous import _generate, _score_and_train
            from placement.simulator import Parallel

            g = _generate(sim, llama_7b(), Parallel(1, 2, other // 2, 1, 2), lengths) + e.sync_s
            s, u = _score_and_train(sim, llama_7b(), Parallel(1, 4, (32 - other) // 4))
            assert max(g, s + u) >= e.async_iteration_s - 1e-9
    with pytest.raises(ValueError, match="must be a multiple of t=4"):
        estimate_async(sim, llama_7b(), lengths, gpus=30)
