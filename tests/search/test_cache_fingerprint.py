"""The result cache never serves a wrong answer: a step's or loss's captured values (a partial's
keywords, a closure, defaults, the module globals it reads) are in the key, a value without a stable
representation turns caching off with one warning, and a row edited by hand is a miss."""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.search.cache import ResultCache
from batchfit.search.fingerprint import fingerprint
from batchfit.search.fingerprint import fingerprint_fields
from batchfit.search.runner import search_workload

DEVICE = "sim:1MiB"
COPIES = 1  # read by `global_step`: a module global that sets the step's memory


def build(step_fn=None, loss_fn=F.cross_entropy) -> bf.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    batch = (torch.randn(3, 16), torch.randint(0, 4, (3,)))
    return bf.Workload(model, batch, loss_fn, torch.optim.Adam(model.parameters()), step_fn=step_fn)


def key(workload: bf.Workload) -> str:
    return fingerprint(fingerprint_fields(workload, bf.SimulatedDevice("1MiB"), {}))


def widened(model, batch, copies=1):
    """A step whose activations grow with ``copies``: the output is repeated before the loss."""
    inputs, targets = batch
    return F.cross_entropy(model(inputs).repeat(copies * 64, 1), targets.repeat(copies * 64))


def closing_over(copies: int):
    def step(model, batch):
        return widened(model, batch, copies)

    return step


def global_step(model, batch):
    return widened(model, batch, COPIES)


def helper_step(model, batch):
    return global_step(model, batch)  # reads COPIES through another function


def uncached(step) -> int:
    return search_workload(build(step), device=DEVICE).batch_size


def test_a_partial_keyword_is_in_the_key():
    def generate(model, batch, max_new_tokens):
        return model.generate(batch, max_new_tokens=max_new_tokens)

    short = key(build(functools.partial(generate, max_new_tokens=16)))
    assert short == key(build(functools.partial(generate, max_new_tokens=16)))
    assert short != key(build(functools.partial(generate, max_new_tokens=4096)))
    assert short != key(build(functools.partial(generate, 16)))  # by position: another partial


def test_a_partial_keyword_changed_measures_again_end_to_end(tmp_path):
    small, large = functools.partial(widened, copies=1), functools.partial(widened, copies=8)
    assert uncached(small) > uncached(large)  # the keyword really changes the answer
    first = search_workload(build(small), device=DEVICE, cache=tmp_path)
    second = search_workload(build(large), device=DEVICE, cache=tmp_path)
    assert first.trials and second.trials and not second.cached
    assert second.batch_size == uncached(large)
    again = search_workload(build(functools.partial(widened, copies=8)), device=DEVICE, cache=tmp_path)
    assert again.trials == [] and again.batch_size == second.batch_size  # the same partial still hits


def test_a_closed_over_value_changed_is_a_miss(tmp_path):
    assert key(build(closing_over(1))) == key(build(closing_over(1)))  # made twice, the same key
    assert key(build(closing_over(1))) != key(build(closing_over(8)))
    search_workload(build(closing_over(1)), device=DEVICE, cache=tmp_path)
    changed = search_workload(build(closing_over(8)), device=DEVICE, cache=tmp_path)
    assert changed.trials and changed.batch_size == uncached(closing_over(8))


def test_a_module_global_the_step_reads_changed_is_a_miss(tmp_path, monkeypatch):
    before, through_helper = key(build(global_step)), key(build(helper_step))
    first = search_workload(build(global_step), device=DEVICE, cache=tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "COPIES", 8)
    assert key(build(global_step)) != before and key(build(helper_step)) != through_helper
    changed = search_workload(build(global_step), device=DEVICE, cache=tmp_path)
    assert changed.trials and changed.batch_size < first.batch_size
    assert changed.batch_size == uncached(global_step)


def test_defaults_and_captured_tensors_and_modules_are_in_the_key():
    def with_default(model, batch, copies=1):
        return widened(model, batch, copies)

    def with_other_default(model, batch, copies=8):
        return widened(model, batch, copies)

    with_other_default.__qualname__ = with_default.__qualname__  # the same name and code, another default
    assert key(build(with_default)) != key(build(with_other_default))
    scale = torch.ones(4)
    assert key(build(closing_over(scale))) == key(build(closing_over(torch.ones(4))))  # by contents, not identity
    assert key(build(closing_over(scale))) != key(build(closing_over(torch.full((4,), 2.0))))
    assert key(build(closing_over(nn.Linear(4, 4)))) != key(build(closing_over(nn.Linear(4, 8))))
    assert key(build(loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1))) != key(
        build(loss_fn=nn.CrossEntropyLoss(label_smoothing=0.2))
    )


def test_whether_the_output_is_held_until_backward_is_in_the_key():
    model, batch = nn.Linear(16, 4), (torch.randn(3, 16), torch.randint(0, 4, (3,)))
    held, dropped = (bf.Workload(model, batch, F.cross_entropy, keep_output=keep) for keep in (True, False))
    assert key(held) != key(dropped)
    assert key(held) == key(bf.Workload(model, batch, F.cross_entropy))  # the default holds it


def test_numpy_values_by_contents_and_loggers_by_name():
    import numpy as np

    assert key(build(closing_over(np.float32(0.5)))) == key(build(closing_over(np.float32(0.5))))
    assert key(build(closing_over(np.ones(3)))) != key(build(closing_over(np.zeros(3))))
    assert key(build(closing_over(logging.getLogger("mine")))) == key(build(closing_over(logging.getLogger("mine"))))


def test_a_value_without_a_stable_representation_turns_caching_off_with_one_warning(tmp_path, caplog):
    lock = threading.Lock()

    def step(model, batch):
        with lock:
            return widened(model, batch)

    with caplog.at_level(logging.WARNING, logger="batchfit"):
        first = search_workload(build(step), device=DEVICE, cache=tmp_path)
        second = search_workload(build(step), device=DEVICE, cache=tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "\n" not in warnings[0]  # one per search
    assert "not caching: step_fn closes over `lock`" in warnings[0] and "cache=False" in warnings[0]
    assert first.trials and second.trials and ResultCache(tmp_path).entries() == []


def test_a_callable_object_is_not_cached():
    class Loss:
        def __call__(self, output, targets):
            return F.cross_entropy(output, targets)

    with pytest.raises(ValueError, match="loss_fn is an object"):
        key(build(loss_fn=Loss()))


def test_a_row_edited_by_hand_is_a_miss_and_measured_again(tmp_path):
    first = search_workload(build(), device=DEVICE, cache=tmp_path)
    with sqlite3.connect(tmp_path / "results.sqlite") as connection:
        (text,) = connection.execute("SELECT result FROM results").fetchone()
        edited = json.dumps({**json.loads(text), "batch_size": 4096})
        connection.execute("UPDATE results SET result = ?, batch_size = 4096", (edited,))
    again = search_workload(build(), device=DEVICE, cache=tmp_path)
    assert again.trials and again.batch_size == first.batch_size
    assert search_workload(build(), device=DEVICE, cache=tmp_path).trials == []  # the fresh answer is stored


def test_rows_stored_without_a_checksum_miss(tmp_path):
    with sqlite3.connect(tmp_path / "results.sqlite") as connection:  # a file as the first release wrote it
        connection.execute(
            "CREATE TABLE results (key TEXT PRIMARY KEY, created REAL NOT NULL, label TEXT NOT NULL, "
            "device TEXT NOT NULL, batch_size INTEGER, fields TEXT NOT NULL, result TEXT NOT NULL)"
        )
        connection.execute("INSERT INTO results VALUES ('k', 0, 'w', 'sim', 8, '{}', '{\"batch_size\": 8}')")
        connection.execute("PRAGMA user_version = 1")
    cache = ResultCache(tmp_path)
    assert cache.get("k") is None and cache.disabled_reason is None
    cache.put("k", {"batch_size": 9}, label="w", device="sim", fields={})
    assert cache.get("k").result == {"batch_size": 9}


STABLE_SCRIPT = """
import functools, torch
from torch.nn import functional as F
import batchfit as bf
from batchfit.search.fingerprint import fingerprint, fingerprint_fields
SETTINGS = {"copies": 2, "names": {"b", "a"}}
def step(model, batch, copies, scale):
    assert SETTINGS["names"] <= {"a", "b", "c", "d"}  # a frozenset constant in the code
    return F.cross_entropy(model(batch[0]).repeat(copies, 1) * scale * SETTINGS["copies"], batch[1].repeat(copies))
def make(scale):
    return functools.partial(lambda model, batch, copies: step(model, batch, copies, scale), copies=3)
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
work = bf.Workload(model, (torch.randn(3, 16), torch.randint(0, 4, (3,))), step_fn=make(torch.ones(4)))
print(fingerprint(fingerprint_fields(work, bf.SimulatedDevice("1MiB"), {})))
from batchfit.step.builtin_workloads import gpt_tiny
print(fingerprint(fingerprint_fields(gpt_tiny(), bf.SimulatedDevice("64MiB"), {})))
"""


@pytest.mark.slow  # a second Python process: make reliability runs it
def test_a_step_with_captured_values_has_the_same_key_in_another_process():
    procs = [  # two processes at once, with hash seeds that order the sets differently
        subprocess.Popen(
            [sys.executable, "-c", STABLE_SCRIPT],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        for seed in ("0", "1")
    ]
    from batchfit.step.builtin_workloads import gpt_tiny

    here = fingerprint(fingerprint_fields(gpt_tiny(), bf.SimulatedDevice("64MiB"), {}))
    runs = [proc.communicate(timeout=120)[0].split() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert runs[0] == runs[1] and len(runs[0][0]) == 64
    assert runs[0][1] == here  # a built-in workload: the same key here and in both other processes


# -- the model's own code and attributes ---------------------------------------------------------------------

BLOCK = """
import torch
from torch import nn

def helper(x):
    return x * 2

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.repeat = 1

    def forward(self, x):
        for _ in range(LOOPS):
            x = torch.relu(self.linear(helper(x)))
        return x
"""


def block_class(loops: int = 1, helper_body: str = "x * 2") -> type:
    """``Block`` from source, in a module of the same name every time (as a user's file edited between runs)."""
    namespace: dict = {"__name__": "user_models"}
    source = BLOCK.replace("LOOPS", str(loops)).replace("x * 2", helper_body)
    exec(compile(source, "user_models.py", "exec"), namespace)
    return namespace["Block"]


def block_workload(block: nn.Module) -> bf.Workload:
    model = nn.Sequential(block, nn.Linear(16, 4))
    batch = (torch.randn(3, 16), torch.randint(0, 4, (3,)))
    return bf.Workload(model, batch, F.cross_entropy, torch.optim.Adam(model.parameters()))


def test_the_model_code_its_attributes_and_the_device_rounding_are_in_the_key():
    """Each change below changes the memory a step takes; each used to be answered from the cache."""
    torch.manual_seed(0)
    base = key(block_workload(block_class()()))
    changed = {
        "a forward edited (a loop run 8 times)": block_workload(block_class(loops=8)()),
        "a helper its forward calls, swapped": block_workload(block_class(helper_body="x.repeat(1, 1) * 2")()),
    }
    for name, attribute, value in (("repeat = 4", "repeat", 4), ("a dropout's p", "p", 0.5)):
        block = block_class()()
        setattr(block, attribute, value)
        changed[name] = block_workload(block)
    flagged = block_class()()
    flagged.linear.gradient_checkpointing = True  # a child's flag
    changed["a child's checkpointing flag"] = block_workload(flagged)
    torch.manual_seed(0)
    same = key(block_workload(block_class()()))
    assert same == base
    assert {name: key(work) != base for name, work in changed.items()} == dict.fromkeys(changed, True)
    work = block_workload(block_class()())
    rounded = fingerprint(fingerprint_fields(work, bf.SimulatedDevice("1MiB", rounding_bytes=1), {}))
    assert rounded != fingerprint(fingerprint_fields(work, bf.SimulatedDevice("1MiB"), {}))


def test_an_edited_forward_is_measured_again_not_answered_from_the_cache(tmp_path):
    def find(loops: int) -> bf.SearchResult:
        work = block_workload(block_class(loops=loops)())
        options = dict(
            loss_fn=F.cross_entropy, optimizer=work.optimizer, device="sim:1MiB", cache=tmp_path, trace=False
        )
        return bf.find_max_batch_size(work.model, work.sample_batch, **options)

    once, eight, again = find(1), find(8), find(8)
    assert not once.cached and not eight.cached and eight.trials  # the edited forward is measured, not served
    assert again.cached and again.batch_size == eight.batch_size


class Configured(nn.Module):
    """Reads a module global that is an object of some class: no stable representation."""

    def forward(self, x):
        return x * SETTINGS.scale


class _Settings:
    scale = 2


SETTINGS = _Settings()


def test_model_code_that_reads_an_unrepresentable_value_runs_uncached_and_says_so(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(16, 4), Configured())
    with caplog.at_level(logging.WARNING, logger="batchfit"):
        result = bf.find_max_batch_size(
            model,
            (torch.randn(3, 16), torch.randn(3, 4)),
            loss_fn=F.mse_loss,
            device="sim:1MiB",
            cache=tmp_path,
            trace=False,
        )
    assert "not caching: the model" in caplog.text and "SETTINGS" in caplog.text and result.trials
