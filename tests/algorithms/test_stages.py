"""The stages before RL: supervised fine-tuning and reward / cost models from preference pairs, on real groups.

Each stage trains a tiny model from scratch on a learnable rule, writes a Hugging Face folder, and the folder is
loaded here with transformers: its held-out figures must equal the ones the run reported (what was evaluated is
what was written), and they must show learning.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.algorithms.test_data_and_rewards import _hf_scores, _jsonl

COMMON = ["dashboard=none", "samples_per_step=16", "max_response_tokens=6", "lr=3e-3"]


def _pairs(n: int, seed: int) -> list[dict]:
    """Digit answers: the chosen one uses no 9 (safe), the rejected one does (unsafe)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        good = "".join(rng.choice("1234") for _ in range(rng.randint(1, 3)))
        bad = "".join(rng.choice("59") for _ in range(rng.randint(1, 3))) + "9"
        rows.append(
            {
                "prompt": f"sum {rng.randint(10, 30)}:",
                "chosen": good,
                "rejected": bad,
                "chosen_safe": True,
                "rejected_safe": False,
            }
        )
    return rows


def test_sft_learns_the_demonstrations_and_writes_the_model_it_evaluated(tmp_path):
    from transformers import AutoModelForCausalLM

    from algorithms.sft import main as sft

    rows = [
        {"prompt": f"rev {w}:", "response": w[::-1]}
        for w in ("ab", "abc", "bca", "cab", "dab", "bad", "cad", "add", "dcb", "acd", "bdc", "cbd")
    ]
    train = _jsonl(tmp_path / "train.jsonl", rows * 4)
    held_out = _jsonl(tmp_path / "eval.jsonl", rows[:6])
    out = tmp_path / "sft"
    history = sft(
        [*COMMON, f"train_files={train}", f"eval_files={held_out}", f"out={out}", "epochs=10", "eval_every=6"]
    )
    assert len(history) == 10 * (48 // 16)
    evals = [r["eval/nll"] for r in history if "eval/nll" in r]
    assert len(evals) == 5 and evals[-1] < 0.5 * evals[0]
    # the folder holds the evaluated model: its NLL on the held-out demonstrations, computed here, is the last one
    from algorithms.data.datasets import load_examples
    from algorithms.data.prompts import PromptData
    from engines import ModelConfig, build_tokenizer

    tok = build_tokenizer(ModelConfig(path=str(out)))
    data = PromptData(None, tok, 0, 0, examples=load_examples([held_out], tok))
    batch = data.demonstrations(data.examples, 6)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    r = batch["responses"].shape[1]
    lp = torch.log_softmax(logits[:, -r - 1 : -1].float(), -1).gather(-1, batch["responses"][..., None])[..., 0]
    m = batch["response_mask"].float()
    assert float(-(lp * m).sum() / m.sum()) == pytest.approx(evals[-1], abs=1e-4)


@pytest.mark.parametrize("kind", ["reward", "cost"])
def test_reward_and_cost_models_learn_the_preference_and_write_a_score_model(tmp_path, kind):
    from algorithms.train_reward import main as train_reward
    from engines import check_model_dir

    train = _jsonl(tmp_path / "train.jsonl", _pairs(96, seed=1))
    held_out_rows = _pairs(16, seed=2)
    held_out = _jsonl(tmp_path / "eval.jsonl", held_out_rows)
    out = tmp_path / kind
    history = train_reward(
        [*COMMON, f"kind={kind}", f"train_files={train}", f"eval_files={held_out}", f"out={out}", "epochs=2"]
    )
    last = history[-1]
    assert last["eval/pair_accuracy"] >= 0.9
    if kind == "cost":
        assert last["eval/sign_accuracy"] >= 0.9
    assert check_model_dir(out)["architectures"] == ["LlamaForSequenceClassification"]
    # the written folder scores the held-out pairs as the run reported
    from algorithms.data.prompts import PromptData
    from engines import ModelConfig, build_tokenizer

    tok = build_tokenizer(ModelConfig(path=str(out)))
    examples = [(r["prompt"], r["chosen"], {}) for r in held_out_rows]
    data = PromptData(None, tok, 0, 0, examples=examples)
    chosen = data.demonstrations(examples, 6)
    rejected = data.demonstrations([(r["prompt"], r["rejected"], {}) for r in held_out_rows], 6)
    s_c = _hf_scores(str(out), (chosen["input_ids"], chosen["attention_mask"]))
    s_r = _hf_scores(str(out), (rejected["input_ids"], rejected["attention_mask"]))
    better = (s_c > s_r) if kind == "reward" else (s_r > s_c)
    assert float(better.float().mean()) == last["eval/pair_accuracy"]


def test_a_cost_dataset_without_safety_labels_is_refused_before_any_worker(tmp_path, capsys, no_cluster):
    from algorithms.train_reward import main as train_reward

    rows = [{k: v for k, v in r.items() if k != "rejected_safe"} for r in _pairs(4, 0)]
    with pytest.raises(SystemExit):
        train_reward(["kind=cost", f"train_files={_jsonl(tmp_path / 'p.jsonl', rows)}", f"out={tmp_path / 'o'}"])
    assert "kind=cost needs `chosen_safe` and `rejected_safe`" in capsys.readouterr().err


def test_trainable_layers_trains_only_the_top_layers_and_the_head(tmp_path):
    """trainable_layers=1 on a 2-layer pretrained backbone (FSDP2 over 2 ranks): the written model keeps the
    backbone's embeddings and first layer bit for bit, its top layer and head moved, and it still learns."""
    from algorithms.train_reward import main as train_reward
    from engines import ModelConfig, build_model, build_tokenizer, save_pretrained

    cfg = ModelConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    tok = build_tokenizer(cfg)
    save_pretrained(build_model(cfg, "lm", tok), tok, tmp_path / "base")
    train = _jsonl(tmp_path / "train.jsonl", _pairs(96, seed=1))
    held_out = _jsonl(tmp_path / "eval.jsonl", _pairs(16, seed=2))
    history = train_reward(
        [
            *COMMON,
            f"model.path={tmp_path / 'base'}",
            f"train_files={train}",
            f"eval_files={held_out}",
            f"out={tmp_path / 'rm'}",
            "epochs=2",
            "trainable_layers=1",
        ]
    )
    assert history[-1]["eval/pair_accuracy"] >= 0.9
    base = build_model(ModelConfig(path=str(tmp_path / "base")), "score").state_dict()
    trained = build_model(ModelConfig(path=str(tmp_path / "rm")), "score").state_dict()
    frozen = [n for n in base if n.startswith(("model.embed_tokens.", "model.layers.0."))]
    moved = [n for n in base if n.startswith(("model.layers.1.", "score."))]
    assert frozen and moved
    assert all(torch.equal(base[n], trained[n]) for n in frozen)
    assert all(not torch.equal(base[n], trained[n]) for n in moved if not n.endswith("norm.weight"))


def test_zero_stage_1_replicas_train_the_same_model_as_fsdp2(tmp_path):
    """zero_stage=1 (a whole replica per rank, gradients averaged by the engine, Adam state split between the
    ranks) and the default FSDP2 layout, over 2 ranks from the same pretrained backbone and data: the same losses
    and held-out accuracy every step and the same written weights (up to float summation order)."""
    from algorithms.train_reward import main as train_reward
    from engines import ModelConfig, build_model, build_tokenizer, save_pretrained

    cfg = ModelConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    tok = build_tokenizer(cfg)
    save_pretrained(build_model(cfg, "lm", tok), tok, tmp_path / "base")
    train = _jsonl(tmp_path / "train.jsonl", _pairs(64, seed=1))
    held_out = _jsonl(tmp_path / "eval.jsonl", _pairs(16, seed=2))
    runs = {}
    for stage in (3, 1):
        runs[stage] = train_reward(
            [
                *COMMON,
                f"model.path={tmp_path / 'base'}",
                f"train_files={train}",
                f"eval_files={held_out}",
                f"out={tmp_path / f'z{stage}'}",
                "eval_every=2",
                f"zero_stage={stage}",
                "trainable_layers=1",
            ]
        )
    fsdp, replicas = runs[3], runs[1]
    assert len(fsdp) == len(replicas) == 4
    for a, b in zip(fsdp, replicas):
        assert b["rm_loss"] == pytest.approx(a["rm_loss"], abs=1e-5)
        assert b.get("eval/pair_accuracy") == a.get("eval/pair_accuracy")
    base = build_model(ModelConfig(path=str(tmp_path / "base")), "score").state_dict()
    z3 = build_model(ModelConfig(path=str(tmp_path / "z3")), "score").state_dict()
    z1 = build_model(ModelConfig(path=str(tmp_path / "z1")), "score").state_dict()
    assert any(not torch.equal(base[n], z1[n]) for n in base)  # it trained
    for name in base:
        torch.testing.assert_close(z1[name], z3[name], rtol=0, atol=1e-5, msg=name)


def test_trainable_layers_beyond_the_model_is_refused_before_any_worker(tmp_path, capsys, no_cluster):
    from algorithms.train_reward import main as train_reward

    train = _jsonl(tmp_path / "p.jsonl", _pairs(4, 0))
    with pytest.raises(SystemExit):
        train_reward([f"train_files={train}", f"out={tmp_path / 'o'}", "model.num_layers=2", "trainable_layers=3"])
    assert "trainable_layers=3 but the model has 2 decoder layers" in capsys.readouterr().err
