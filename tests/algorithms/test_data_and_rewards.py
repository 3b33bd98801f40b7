"""Prompt datasets from files, learned reward and cost models from folders, and evaluation on held-out prompts.

The reward models here are tiny Llama score models saved as real Hugging Face folders; their scores on the
samples a run generated are recomputed in this process with transformers and compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from algorithms.data.datasets import load_examples
from algorithms.run.config import ConfigError
from engines import ModelConfig, build_model, save_pretrained
from engines.models.tokenizer import CHARS, SPECIALS, char_tokenizer

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _digit_rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"prompt": f"sum {10 + (i % 14)}:", "response": "55", "target": 10 + (i % 14)} for i in range(start, start + n)
    ]


def _score_model(path: Path, seed: int, tokenizer=None) -> str:
    tok = tokenizer or char_tokenizer()
    model = build_model(ModelConfig(seed=seed), "score", tok)
    save_pretrained(model, tok, path)
    return str(path)


def _permuted_tokenizer():
    """The character vocabulary with the characters in reverse id order: same texts, other token ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *reversed(CHARS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def _hf_scores(model_dir: str, texts_or_ids, tokenizer=None) -> torch.Tensor:
    """Scores of a saved score model computed here with transformers: the reference."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    if tokenizer is not None:
        enc = tokenizer(texts_or_ids, padding=True, return_tensors="pt")
        ids, mask = enc.input_ids, enc.attention_mask
    else:
        ids, mask = texts_or_ids
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.squeeze(-1).float()


# -- datasets -------------------------------------------------------------------------------------------------------


def test_jsonl_and_parquet_rows_become_prompts_demonstrations_and_row_values(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    plain = _jsonl(tmp_path / "a.jsonl", [{"prompt": "sum 12:", "response": "39", "target": 12, "tags": ["x"]}])
    chat = tmp_path / "b.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "messages": [{"role": "user", "content": "rev ab:"}, {"role": "assistant", "content": "ba"}],
                    "target": "ba",
                }
            ]
        ),
        chat,
    )
    examples = load_examples([plain, str(chat)], tok)
    # lists are not row values (a rule reward reads scalars); the chat's last assistant turn is its demonstration
    assert examples == [("sum 12:", "39", {"target": 12}), ("<u>rev ab:<a>", "ba", {"target": "ba"})]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], r"train_files=.* holds no rows"),
        (
            [{"text": "sum 3:"}],
            r"row 0 of .* has neither a `prompt` .* nor a `messages` column; its columns: \['text'\]",
        ),
        ([{"messages": [{"role": "user", "content": "hi"}]}], r"the policy's tokenizer has no chat template"),
        ([{"prompt": "  "}], r"row 0 of .* has an empty prompt"),
    ],
)
def test_bad_dataset_rows_are_named(tmp_path, rows, message):
    with pytest.raises(ConfigError, match=message):
        load_examples([_jsonl(tmp_path / "d.jsonl", rows)], char_tokenizer())


def test_bad_dataset_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"train_files: .*nope.jsonl does not exist"):
        load_examples([str(tmp_path / "nope.jsonl")], char_tokenizer())
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(ConfigError, match=r"unknown format; use .jsonl .* or .parquet"):
        load_examples([str(tmp_path / "d.csv")], char_tokenizer())
    (tmp_path / "e.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"line 2 of .*e.jsonl is not JSON"):
        load_examples([str(tmp_path / "e.jsonl")], char_tokenizer())


def _error(capsys, argv) -> str:
    from algorithms.ppo import main as ppo

    with pytest.raises(SystemExit) as exit_:
        ppo(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[0]


def test_bad_data_and_model_settings_fail_before_any_worker(capsys, no_cluster, tmp_path):
    no_demos = _jsonl(tmp_path / "p.jsonl", [{"prompt": "sum 3:"}])
    assert "sft_steps=60 needs demonstrations: a `response` column" in _error(capsys, [f"train_files={no_demos}"])
    assert "eval_every=2 needs eval_files" in _error(capsys, ["eval_every=2"])
    assert "reward_model: model folder /no/rm does not exist" in _error(capsys, ["reward_model=/no/rm"])
    lm = tmp_path / "lm"
    save_pretrained(build_model(ModelConfig(), "lm", char_tokenizer()), char_tokenizer(), lm)
    line = _error(capsys, [f"reward_model={lm}"])
    assert "holds ['LlamaForCausalLM'], not a model with a score head" in line
    line = _error(capsys, ["model.num_layers=2", "critic_trainable_layers=3"])
    assert "critic_trainable_layers=3 but the model has 2 decoder layers; give 1..2" in line
    line = _error(capsys, ["model.engine=megatron", "critic_trainable_layers=1"])
    assert "critic_trainable_layers=1 needs model.engine=torch" in line
    assert "critic_trainable_layers=-1 is outside [0, inf)" in _error(capsys, ["critic_trainable_layers=-1"])


def test_critics_get_critic_trainable_layers():
    from algorithms.run.config import GRPOConfig, PPOConfig, SafeRLHFConfig, apply_overrides

    assert PPOConfig().trained["critic"].trainable_layers == 0
    cfg = apply_overrides(SafeRLHFConfig(), ["critic_trainable_layers=2", "critic_lr=3e-4", "zero_stage=1"])
    optim = cfg.trained["critic"]
    assert (optim.trainable_layers, optim.lr, optim.zero_stage) == (2, 3e-4, 1)
    assert (cfg.actor.trainable_layers, cfg.actor.lr, cfg.actor.zero_stage) == (0, 2e-4, 1)  # zero_stage: both
    assert set(GRPOConfig().trained) == {"actor"}


# -- learned reward models ------------------------------------------------------------------------------------------


def test_reward_model_of_another_vocabulary_scores_the_decoded_text(controller4, tmp_path):
    """Token ids are never scored across vocabularies: the worker decodes with the policy's tokenizer and
    re-tokenizes with the reward model's, which gives what the reward model scores on the text itself."""
    import flowactors as fa
    from engines import RewardModelWorker
    from flowactors import Batch

    other = _permuted_tokenizer()
    same_dir, other_dir = _score_model(tmp_path / "same", 3), _score_model(tmp_path / "other", 3, other)
    tok = char_tokenizer()
    prompts = tok(["sum 12:", "sum 7:", "rev ab:", "sum 20:"], padding=True, return_tensors="pt")
    responses = tok(["39", "7", "ba", "992"], padding=True, return_tensors="pt", add_special_tokens=False)
    ids = torch.cat([prompts.input_ids, responses.input_ids], 1)
    mask = torch.cat([prompts.attention_mask, responses.attention_mask], 1)
    batch = Batch(
        {"prompts": prompts.input_ids, "responses": responses.input_ids, "input_ids": ids, "attention_mask": mask}
    )
    texts = ["sum 12:39", "sum 7:7", "rev ab:ba", "sum 20:992"]
    for name, folder, reference in (
        ("rm_same", same_dir, _hf_scores(same_dir, (ids, mask))),
        ("rm_other", other_dir, _hf_scores(other_dir, texts, other)),
    ):
        group = fa.ActorGroup(
            controller4,
            RewardModelWorker,
            name=name,
            slots=controller4.slots[:2],
            args=(ModelConfig(path=folder), ModelConfig()),
        )
        try:
            scores = group.compute_reward(batch).result()["rewards"]
        finally:
            group.close()
        torch.testing.assert_close(scores, reference, atol=1e-5, rtol=1e-5)
    # the ids of one vocabulary read in the other are another text: scoring them directly would be wrong
    assert not torch.allclose(_hf_scores(other_dir, (ids, mask)), _hf_scores(other_dir, texts, other), atol=1e-3)


def test_ppo_on_files_with_a_learned_reward_model_and_held_out_evaluation(tmp_path):
    """A run whose prompts come from a JSONL file, scored by a reward-model folder, evaluated every step on other
    prompts: the step's rewards are the model's scores of its samples, and the last evaluation's greedy reward is
    what the final actor's greedy responses score."""
    import flowactors as fa
    from algorithms.ppo import PPO
    from algorithms.run.config import PPOConfig, apply_overrides
    from algorithms.run.loop import Runner
    from engines import GenerationSpec

    rm = _score_model(tmp_path / "rm", 11)
    train = _jsonl(tmp_path / "train.jsonl", _digit_rows(32))
    held_out = _jsonl(tmp_path / "eval.jsonl", _digit_rows(6, start=100))
    cfg = apply_overrides(
        PPOConfig(),
        [
            "steps=2",
            "sft_steps=2",
            "prompts_per_step=8",
            "mini_batch_samples=8",
            "dashboard=none",
            f"train_files={train}",
            f"eval_files={held_out}",
            "eval_every=1",
            f"reward_model={rm}",
        ],
    )
    with fa.Controller.local(2, dashboard=None) as ctl:
        run = Runner(PPO(cfg), ctl, tmp_path)
        history = run.run()
        batch = run.algo.last_batch.result()
        prompts = run.eval_data.eval_batch()
        greedy = run.roles.actor.generate_sequences(prompts, GenerationSpec(greedy=True))
        greedy_rewards = run.roles.reward.compute_reward(greedy).result()["rewards"]
    assert len(run.data.examples) == 32 and run.data.row_keys == ["target"]
    torch.testing.assert_close(
        batch["rewards"], _hf_scores(rm, (batch["input_ids"], batch["attention_mask"])), atol=1e-5, rtol=1e-5
    )
    assert history[-1]["reward_mean"] == pytest.approx(float(batch["rewards"].mean()), abs=1e-6)
    assert [("eval/reward_greedy" in r, "eval/reward_sampled" in r) for r in history] == [(True, True)] * 2
    assert history[-1]["eval/reward_greedy"] == pytest.approx(float(greedy_rewards.mean()), abs=1e-6)
