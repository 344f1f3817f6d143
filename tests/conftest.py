"""Shared fixtures: the tiny model cases (tests/support/models.py), memory freed between tests, one torch thread
and a frozen import-time heap (both only make the suite faster)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Helpers the tests import by name (models, cli_runner, ddp_launch, ...): tests/support/. Scripts the tests start as
# processes live in tests/launch/ and put tests/support/ on their own path.
sys.path.insert(0, str(Path(__file__).parent / "support"))

from models import CASES
from models import Case

# CI runs the same examples every time (reproducible); locally hypothesis keeps exploring new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# The tests' models are tiny: a second torch thread only contends, and on a shared or busy
# machine (or under pytest-xdist) it makes every step several times slower. Subprocesses that
# tests start inherit the setting; an OMP_NUM_THREADS given by the caller is respected.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _collect_and_freeze() -> None:
    """Collect, then move every object still alive (torch's and the test modules' ~300k, modules
    imported lazily, caches) out of the collector's sight: the full collections batchfit runs
    (after each sweep configuration, after a failed trial) then walk only what the running test
    made, which is collected as usual. A test never sees another's garbage either way."""
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    _collect_and_freeze()


@pytest.fixture(params=CASES, ids=lambda case: case.name)
def case(request) -> Case:
    return request.param


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    _collect_and_freeze()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own result cache: none touches the user's, none sees another's."""
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
