"""The search settings in one object, the one way every entry point takes them: ``settings=SearchSettings(...)``
runs what the flat keywords (kept as aliases) run, and giving both is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import batchfit as bf
from batchfit.errors import InputError
from batchfit.search.settings import SearchSettings
from batchfit.step.builtin_workloads import gpt_tiny

SETTINGS = SearchSettings(strategy="binary", max_batch_size=64, max_trials=4, trace=False)
KEYWORDS = {"strategy": "binary", "max_batch_size": 64, "max_trials": 4, "trace": False}


def model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    return model, (torch.randn(4, 32), torch.randint(0, 4, (4,)))


def sizes(result) -> list[int]:
    return [trial.batch_size for trial in result.trials]


def test_find_max_batch_size_takes_the_object_or_the_keywords():
    model, batch = model_and_batch()
    common = {"loss_fn": F.cross_entropy, "device": "sim:1MiB"}
    by_object = bf.find_max_batch_size(model, batch, settings=SETTINGS, **common)
    by_keywords = bf.find_max_batch_size(model, batch, **KEYWORDS, **common)
    assert sizes(by_object) == sizes(by_keywords) and len(sizes(by_object)) == 4
    with pytest.raises(InputError, match="give the search settings once: .* the keyword max_trials, not both"):
        bf.find_max_batch_size(model, batch, settings=SETTINGS, max_trials=3, **common)


def test_find_optimal_batch_size_takes_the_object():
    model, batch = model_and_batch()
    common = {"loss_fn": F.cross_entropy, "device": "sim:1MiB", "timed_steps": 1}
    settings = SearchSettings(max_batch_size=16, trace=False)
    by_object = bf.find_optimal_batch_size(model, batch, settings=settings, **common)
    by_keywords = bf.find_optimal_batch_size(model, batch, max_batch_size=16, trace=False, **common)
    assert by_object.largest_batch_size == by_keywords.largest_batch_size == 16
    assert max(p.batch_size for p in by_object.points) <= 16  # the grid under the object's bound (timed: sizes vary)
    with pytest.raises(InputError, match="the keyword strategy, not both"):
        bf.find_optimal_batch_size(model, batch, settings=settings, strategy="grow", **common)


def test_the_microbatcher_and_the_sweep_take_the_object():
    model, _ = model_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batcher = bf.Microbatcher(model, optimizer, loss_fn=F.cross_entropy, settings=SearchSettings(max_trials=3))
    assert batcher.settings.search.max_trials == 3
    with pytest.raises(InputError, match="the keyword margin, not both"):
        bf.Microbatcher(model, optimizer, loss_fn=F.cross_entropy, settings=SearchSettings(), margin="1MiB")
    swept = bf.sweep_grid(gpt_tiny, {"seq_len": [16]}, device="sim:32MiB", cache=False, settings=SETTINGS)
    flat = {name: value for name, value in KEYWORDS.items() if name != "trace"}  # a sweep never traces its search
    keyworded = bf.sweep_grid(gpt_tiny, {"seq_len": [16]}, device="sim:32MiB", cache=False, **flat)
    assert [r["batch_size_used"] for r in swept.records] == [r["batch_size_used"] for r in keyworded.records]
