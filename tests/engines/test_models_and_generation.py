"""Single-process engine checks: HF round trip, generation against transformers, log-prob consistency."""

import json

import pytest
import torch

from engines import (
    HFGenerationEngine,
    ModelConfig,
    SamplingConfig,
    TrainEngine,
    build_model,
    build_tokenizer,
    check_model_dir,
    save_pretrained,
)
from engines.ops import response_mask_from_tokens
from engines.training.parallel import check_divisible
from flowactors import Batch


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    tok = build_tokenizer(cfg)
    return cfg, tok, build_model(cfg, "lm", tok)


def prompts(tok, texts):
    enc = tok(texts, padding=True, return_tensors="pt")
    return Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_save_load_round_trip_is_exact(tmp_path, arch):
    cfg = ModelConfig(arch=arch, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    tok = build_tokenizer(cfg)
    model = build_model(cfg, "lm", tok)
    save_pretrained(model, tok, tmp_path / "m")
    assert check_model_dir(tmp_path / "m")["model_type"] == arch
    loaded = build_model(ModelConfig(path=str(tmp_path / "m")), "lm")
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    # a value head built from the causal-LM folder keeps the backbone and starts its head at zero
    critic = build_model(ModelConfig(path=str(tmp_path / "m")), "score")
    assert torch.equal(critic.score.weight, torch.zeros_like(critic.score.weight))
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_greedy_generation_equals_transformers_generate(tiny):
    cfg, tok, model = tiny
    p = prompts(tok, ["sum 17:", "ab", "hello world"])
    eng = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id)
    out = eng.generate(model, p, SamplingConfig(max_new_tokens=12), greedy=True)
    ref = model.generate(
        input_ids=p["input_ids"],
        attention_mask=p["attention_mask"],
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    ref_resp = ref[:, p["input_ids"].shape[1] :]
    got = out["responses"][:, : ref_resp.shape[1]]
    assert torch.equal(got, ref_resp)


def test_generation_log_probs_equal_compute_log_prob_and_masks(tiny):
    cfg, tok, model = tiny
    p = prompts(tok, ["sum 3:", "x", "abc def", "q"])
    out = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id).generate(
        model, p, SamplingConfig(max_new_tokens=10, temperature=0.8), seed=3
    )
    lp = TrainEngine(model, None, trainable=False).log_probs(out, temperature=0.8)["log_probs"]
    m = out["response_mask"]
    assert torch.allclose(lp * m, out["rollout_log_probs"], atol=1e-5)
    # masks: the prompt's left padding is excluded, the response mask ends at EOS and pads after it
    assert torch.equal(out["attention_mask"][:, : p["input_ids"].shape[1]], p["attention_mask"])
    assert torch.equal(m, response_mask_from_tokens(out["responses"], tok.eos_token_id))
    assert bool((out["responses"][m == 0] == tok.pad_token_id).all())


def test_each_row_samples_independently_of_its_batch(tiny):
    cfg, tok, model = tiny
    texts = ["sum 3:", "x", "abc def", "q"]
    p = prompts(tok, texts)
    p = p.union(Batch({"seed": torch.tensor([11, 12, 13, 14])}))
    eng = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id)
    whole = eng.generate(model, p, SamplingConfig(max_new_tokens=8))
    halves = Batch.concat([eng.generate(model, part, SamplingConfig(max_new_tokens=8)) for part in p.split(2)])
    assert torch.equal(whole["responses"], halves["responses"])


def test_response_mask_stops_after_first_eos():
    r = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8]])
    assert response_mask_from_tokens(r, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_bad_model_inputs_say_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="no weights"):
        check_model_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="supported model types"):
        check_model_dir(tmp_path)
    with pytest.raises(ValueError, match="hidden_size .* divisible by num_heads"):
        ModelConfig(hidden_size=30, num_heads=4)
    cfg = ModelConfig()
    model = build_model(cfg, "lm")
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide"):
        check_divisible(model.config, 3)
    tok = build_tokenizer(cfg)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        HFGenerationEngine(tok.eos_token_id, tok.pad_token_id, max_context=8).generate(
            model, prompts(tok, ["abcdef"]), SamplingConfig(max_new_tokens=4)
        )


def test_tokenizer_without_pad_is_rejected(tmp_path):
    from engines.models.tokenizer import char_tokenizer, load_tokenizer

    tok = char_tokenizer()
    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("pad_token", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "special_tokens_map.json").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="no pad token"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("head", ["value", "score"])
def test_critic_and_reward_heads_from_any_causal_lm_folder_have_no_dropout(tmp_path, head):
    """A folder saved by plain transformers (its config has no classifier_dropout field, like SmolLM2's) loads as a
    value/score model with the backbone's weights and no dropout before the head."""
    import transformers

    tok = build_tokenizer(ModelConfig())
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        pad_token_id=tok.pad_token_id,
    )
    assert "classifier_dropout" not in config.to_dict()
    lm = transformers.LlamaForCausalLM(config)
    lm.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model = build_model(ModelConfig(path=str(tmp_path)), head)
    assert model.config.classifier_dropout == 0.0
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    torch.testing.assert_close(model.model.embed_tokens.weight, lm.model.embed_tokens.weight, atol=0, rtol=0)
