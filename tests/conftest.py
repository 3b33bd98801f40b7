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


FAST_MODULES = frozenset(
    {
        "tests/test_layering.py",
        "tests/algorithms/test_core.py",
        "tests/checkpoint/test_store.py",
        "tests/dashboard/test_data.py",
        "tests/engines/test_models_and_generation.py",
        "tests/engines/test_pretrained.py",
        "tests/engines/test_specs_and_registry.py",
        "tests/examples/test_gold_safe_rlhf.py",
        "tests/fusion/test_stream.py",
        "tests/hybrid/test_layout.py",
        "tests/hybrid/test_shards.py",
        "tests/placement/test_asynchronous.py",
        "tests/placement/test_automap.py",
        "tests/placement/test_fusion_estimate.py",
        "tests/placement/test_models.py",
        "tests/placement/test_plan.py",
        "tests/placement/test_pools.py",
        "tests/placement/test_search.py",
        "tests/placement/test_simulator.py",
        "tests/runtime/test_batch.py",
        "tests/runtime/test_logging.py",
        "tests/runtime/test_protocols.py",
    }
)
"""The fast tier (`python -m pytest -m fast`, about a minute on 2 cores): modules that start no Dask cluster and no
worker process, plus every test that asks for `no_cluster` (it fails if a cluster starts). The full run is still
what CI runs; the fast tier is for the edit-test loop."""
_CLUSTER_FIXTURES = frozenset({"controller4", "fresh_controller"})


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = Path(str(item.fspath)).resolve().relative_to(ROOT).as_posix()
        if item.get_closest_marker("slow") or not (module in FAST_MODULES or "no_cluster" in item.fixturenames):
            continue
        if _CLUSTER_FIXTURES & set(item.fixturenames):
            raise pytest.UsageError(
                f"{item.nodeid} starts a cluster, so it cannot be in the fast tier (tests/conftest.py FAST_MODULES)"
            )
        item.add_marker(pytest.mark.fast)
