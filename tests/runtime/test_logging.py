"""One structured event per call, with role, method, rank, step and duration."""

import json

import structlog
from structlog.testing import capture_logs

import flowactors as fa
from flowactors import _runtime
from flowactors.protocols import Layout


class _Echo:
    def ping(self, x):
        return x


def test_each_call_logs_one_event_with_its_coordinates():
    _runtime._GROUPS["log_probe"] = _runtime.GroupContext("log_probe", 1, Layout(dp=2), None, None, instance=_Echo())
    fa.configure_logging("console", "info")
    try:
        with capture_logs() as logs:
            assert _runtime.call("log_probe", "ping", 1, (7,), {}, None, 12) == 7
            failure = _runtime.call("log_probe", "nope", 1, (), {}, None, 12)
    finally:
        _runtime._GROUPS.pop("log_probe")
        fa.configure_logging("console", "warning")
    ok, bad = logs
    assert (ok["event"], ok["role"], ok["method"], ok["rank"], ok["step"]) == ("call", "log_probe", "ping", 1, 12)
    assert ok["duration_s"] >= 0
    assert bad["event"] == "call failed" and bad["log_level"] == "warning"
    assert isinstance(failure, _runtime.RankFailure) and failure.exc_type == "AttributeError"


def test_json_renderer(capsys):
    fa.configure_logging("json", "info")
    try:
        structlog.get_logger("t").info("call", role="actor", method="generate_sequences", rank=0)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert json.loads(line)["method"] == "generate_sequences"
    finally:
        fa.configure_logging("console", "warning")
