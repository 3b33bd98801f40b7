"""Shared fixtures: real LocalClusters of worker processes on 127.0.0.1, dashboard off."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Worker processes import test-defined worker classes by module name (tests.xxx), so they need the repo root.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def controller4():
    """A 4-slot embedded cluster shared by the tests that only create and call groups."""
    import flowactors as fa

    ctl = fa.Controller.local(4, dashboard=None, collective_timeout_s=120)
    yield ctl
    ctl.close()


@pytest.fixture
def fresh_controller():
    """A private 2-slot cluster for tests that kill or break workers."""
    import flowactors as fa

    ctl = fa.Controller.local(2, dashboard=None, collective_timeout_s=60)
    yield ctl
    ctl.close()
