"""A judge model as the reward (judge.path=, engines.judge) in a program: bad judge settings are refused before the
cluster starts. (The judge's scores against transformers: tests/engines/test_judge.py.)"""

from __future__ import annotations

import re

import pytest

from algorithms.grpo import main as grpo


@pytest.mark.parametrize(
    "argv, message",
    [
        (["judge.path=/nonexistent/judge"], r"judge.path: model folder /nonexistent/judge does not exist"),
        (["judge.path=/tmp", "judge.template=no slot"], r"judge.template must contain \{response\}"),
    ],
)
def test_bad_judge_settings_are_one_line_before_the_cluster_starts(capsys, no_cluster, argv, message):
    with pytest.raises(SystemExit) as exit_:
        grpo(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and len(lines) == 2, err
    assert lines[0].startswith("grpo: error: ") and re.search(message, lines[0]), lines[0]
