"""Shared fixtures: the linear-scan ground truth, and memory freed between tests."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

import batchfit as bf
from batchfit.search.prober import Prober

sys.path.insert(0, str(Path(__file__).parent))

from models import CASES
from models import Case

# CI runs the same examples every time (reproducible); locally hypothesis keeps exploring new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

_TRUE_EDGES: dict[str, int] = {}


def linear_scan_edge(case: Case) -> int:
    """The true largest fitting batch size: probe 1, 2, 3, ... until the first failure."""
    if case.name not in _TRUE_EDGES:
        device = bf.SimulatedDevice(case.capacity)
        with Prober(case.build(), device, limit_bytes=device.capacity_bytes()) as prober:
            size = 1
            while prober.probe(size).fits:
                size += 1
        _TRUE_EDGES[case.name] = size - 1
    return _TRUE_EDGES[case.name]


@pytest.fixture(params=CASES, ids=lambda case: case.name)
def case(request) -> Case:
    return request.param


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own result cache: none touches the user's, none sees another's."""
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
