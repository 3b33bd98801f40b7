import json
import re
import subprocess
import sys

import pytest

from placement import ALGORITHMS
from placement.automap import main


def test_json_output_has_the_documented_keys(capsys):
    argv = [
        "--model",
        "actor=13b",
        "--model",
        "critic=70b",
        "--model",
        "ref=13b",
        "--model",
        "reward=70b",
        "--gpus",
        "64",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"placement", "gpus", "parallel", "estimated_iteration_s", "stages", "search_s"} <= out.keys()
    assert sorted(r for s in out["placement"] for r in s) == ["actor", "critic", "ref", "reward"]
    assert sum(out["pools"][p]["gpus"] for p in out["pools"]) == 64
    assert len(out["parallel"]["actor"]["train"]) == 3 and len(out["parallel"]["actor"]["generate"]) == 2
    assert set(out["stages"]) == {"generate", "inference", "train"}
    assert out["estimated_iteration_s"] == pytest.approx(sum(out["stages"].values()))
    assert out["ranking"][0]["estimated_iteration_s"] == out["estimated_iteration_s"]
    assert sum(out["ranking"][1]["gpus"]) == 64  # the runner-up, with its own best allocation
    assert out["parallel"]["actor"]["generate"][0] == 1  # p_g = 1: the search proposes no pipelined decoding
    assert out["engine"] == ("megatron" if any(v["train"][0] > 1 for v in out["parallel"].values()) else "torch")


def test_plans_say_which_engine_runs_them(capsys, tmp_path):
    assert main(["--algorithm", "ppo", "--size", "13b", "--gpus", "64"]) == 0
    table = capsys.readouterr().out
    assert "engine: megatron (pipeline stages for actor (p=" in table and "model.engine=megatron" in table
    assert main(["--algorithm", "ppo", "--size", "13b", "--gpus", "64", "--engine", "torch", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "torch" and all(v["train"][0] == 1 for v in out["parallel"].values())


def test_the_runner_refuses_a_megatron_plan_on_the_torch_engine_as_marked(tmp_path, capsys):
    # The mark and the runner agree: a plan marked megatron is refused on the default torch engine before any
    # worker starts, with the fix named; a plan marked torch passes that check.
    roles = pytest.importorskip("algorithms.run.plan")
    from algorithms.run.config import RLConfig

    piped, flat = tmp_path / "piped.json", tmp_path / "flat.json"
    assert main(["--algorithm", "ppo", "--size", "13b", "--gpus", "64", "--save", str(piped)]) == 0
    assert main(["--algorithm", "ppo", "--size", "13b", "--gpus", "64", "--engine", "torch", "--save", str(flat)]) == 0
    with pytest.raises(roles.ConfigError, match="model.engine=megatron"):
        roles.check_before_start(RLConfig(plan=str(piped)))
    try:
        roles.check_before_start(RLConfig(plan=str(flat)))
    except roles.ConfigError as e:  # batch sizes may not suit its data-parallel sizes; pipelines are not the issue
        assert "pipeline" not in str(e)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_algorithm_shorthands_fill_their_roles(algorithm, capsys):
    assert main(["--algorithm", algorithm, "--size", "7b", "--gpus", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["gpus"]) == sorted(ALGORITHMS[algorithm])


def test_remax_generates_its_greedy_baseline_too(capsys):
    main(["--algorithm", "grpo", "--gpus", "16", "--json"])
    grpo = json.loads(capsys.readouterr().out)
    main(["--algorithm", "remax", "--gpus", "16", "--json"])
    remax = json.loads(capsys.readouterr().out)  # same roles and sizes, twice the responses to generate
    assert remax["stages"]["generate"] > 1.5 * grpo["stages"]["generate"]


def test_model_overrides_and_hardware(capsys):
    assert main(["--algorithm", "ppo", "--model", "critic=13b", "--gpus", "16", "--gpu", "h200", "--json"]) == 0
    h200 = json.loads(capsys.readouterr().out)
    main(["--algorithm", "ppo", "--model", "critic=13b", "--gpus", "16", "--json"])
    a100 = json.loads(capsys.readouterr().out)
    assert h200["estimated_iteration_s"] < a100["estimated_iteration_s"] / 2


def test_table(capsys):
    assert main(["--algorithm", "ppo", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "15 placements searched" in out
    assert "actor+critic+ref+reward" in out and "iteration" in out


def test_errors_say_what_to_fix(capsys):
    assert main(["--model", "actor=12b", "--gpus", "8"]) == 2
    assert "unknown model size '12b'" in capsys.readouterr().err
    assert main(["--algorithm", "ppo", "--size", "70b", "--gpus", "16"]) == 2
    assert "no placement of actor, critic, ref, reward fits on 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "policy=7b", "--gpus", "8"])
    assert "unknown role 'policy'" in capsys.readouterr().err


def test_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-m", "placement.automap", "--algorithm", "grpo", "--gpus", "8", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["placement"] == [["actor", "ref", "reward"]]


@pytest.mark.parametrize("name", ["safe_rlhf", "safe-rlhf", "Safe_RLHF"])
def test_algorithm_accepts_the_program_name_with_underscores(name, capsys):
    assert main(["--algorithm", name, "--gpus", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["gpus"]) == sorted(ALGORITHMS["safe-rlhf"])


def test_unknown_algorithm_lists_the_accepted_names(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--algorithm", "dpo", "--gpus", "16"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown algorithm 'dpo'" in err
    assert all(name in err for name in ("grpo", "ppo", "remax", "safe_rlhf", "safe-rlhf"))


def _columns(lines: list[str]) -> list[tuple[int, int]]:
    """(start, end) of each column of a text table: stretches of text that every line leaves apart by 2+ spaces."""
    width = max(map(len, lines))
    used = "".join("x" if any(c < len(line) and line[c] != " " for line in lines) else " " for c in range(width))
    return [m.span() for m in re.finditer(r"x(?: ?x)*", used)]


def test_table_columns_stay_aligned_with_long_pool_names(capsys):
    assert main(["--algorithm", "safe_rlhf", "--gpus", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("pool "))
    table = lines[top : lines.index("", top)]
    rows = [[row[a:b].strip() for a, b in _columns(table)] for row in table]
    # every header is a column of its own and every row has a cell (or blank) under each
    assert rows[0] == [
        "pool",
        "gpus",
        "model",
        "train p,t,d",
        "gen p,t",
        "engine",
        "generate s",
        "transit s",
        "infer s",
        "train s",
        "peak GiB",
    ]
    pools = [r[0] for r in rows[1:] if r[0]]
    assert max(map(len, pools)) > 34, f"this case should have a pool name longer than the old 34 columns: {pools}"
    assert sorted(r[2] for r in rows[1:]) == sorted(ALGORITHMS["safe-rlhf"])
    for r in rows[1:]:
        assert re.fullmatch(r"\d+,\d+,\d+", r[3]), r
        assert r[5] == ("megatron (p>1)" if r[3].split(",")[0] != "1" else "any"), r
        assert all(re.fullmatch(r"-|\d+\.\d+|", x) for x in r[6:]), r
    assert sum(int(r[1]) for r in rows[1:] if r[1]) == 16
