"""Fixtures of the algorithm-program tests."""

from __future__ import annotations

import pytest

import flowactors as fa


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if a cluster starts: user errors must be found before it does (not as a slow pass)."""

    def started(*args, **kwargs):
        raise AssertionError("the cluster was started before the configuration was checked")

    monkeypatch.setattr(fa.Controller, "local", started)
    monkeypatch.setattr(fa.Controller, "__init__", started)
