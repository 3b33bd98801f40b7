"""A judge model as the reward (engines.judge): its scores on a real cluster equal a direct transformers computation,
row by row, whatever the padding and the data-parallel split; verdicts of several tokens are refused."""

from __future__ import annotations

import pytest
import torch
import transformers

import flowactors as fa
from engines import JudgeRewardWorker, ModelConfig, build_model, build_tokenizer, save_pretrained
from flowactors import Batch, Layout

POLICY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=3)
TEMPLATE = "Q: {prompt} A: {response} Right?"


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=11)
    tok = build_tokenizer(cfg)
    return str(save_pretrained(build_model(cfg, "lm", tok), tok, tmp_path_factory.mktemp("judge")))


def _samples(tok, pairs: list[tuple[str, str]]) -> Batch:
    side = tok.padding_side
    tok.padding_side = "left"
    prompts = tok([p for p, _ in pairs], padding=True, return_tensors="pt").input_ids
    tok.padding_side = "right"
    responses = tok([r for _, r in pairs], padding=True, return_tensors="pt").input_ids
    tok.padding_side = side
    return Batch({"prompts": prompts, "responses": responses})


def test_judge_scores_equal_a_direct_transformers_computation(controller4, judge_dir):
    pairs = [("sum 3+4:", "7"), ("sum 12+30:", "42 and more"), ("sum 1:", ""), ("sum 99+1:", "100")]
    group = fa.ActorGroup(
        controller4,
        JudgeRewardWorker,
        name="judge",
        slots=controller4.slots[:2],
        layout=Layout(dp=2),
        args=(ModelConfig(path=judge_dir), POLICY, TEMPLATE, ("y", "n")),
    )
    try:
        got = group.compute_reward(_samples(build_tokenizer(POLICY), pairs)).result()["rewards"]
    finally:
        group.close()
    model = transformers.AutoModelForCausalLM.from_pretrained(judge_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(judge_dir)
    yes, no = (tok("y", add_special_tokens=False).input_ids[0], tok("n", add_special_tokens=False).input_ids[0])
    want = []
    for p, r in pairs:  # one row at a time: no padding at all
        ids = tok(TEMPLATE.replace("{prompt}", p).replace("{response}", r), return_tensors="pt").input_ids
        with torch.no_grad():
            last = model(ids).logits[0, -1]
        want.append(torch.softmax(last[[yes, no]], -1)[0])
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=0)
    assert got.min() >= 0 and got.max() <= 1 and got.std() > 0  # the rows are judged apart


@pytest.mark.parametrize(
    "verdicts, message",
    [
        ((" yes", " no"), r"the judge's verdict ' yes' is 4 tokens .* choose verdicts of one token"),
        (("Y", "n"), r"the judge's verdict 'Y' is not in its vocabulary"),
    ],
)
def test_verdicts_the_judge_cannot_read_are_refused(controller4, judge_dir, verdicts, message):
    with pytest.raises(fa.RemoteError, match=message):
        fa.ActorGroup(
            controller4,
            JudgeRewardWorker,
            name="judge_bad",
            slots=controller4.slots[:1],
            layout=Layout(dp=1),
            args=(ModelConfig(path=judge_dir), POLICY, TEMPLATE, verdicts),
        )
