"""The result cache: hits with zero trials, a miss for every fingerprint field, concurrent
writers, and damaged or unusable cache files survived."""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
import batchfit._version
from batchfit.errors import InputError
from batchfit.search.cache import ResultCache
from batchfit.search.cache import default_cache_dir
from batchfit.search.fingerprint import fingerprint
from batchfit.search.fingerprint import fingerprint_fields
from batchfit.search.runner import search_workload


def build(
    width: int = 32,
    features: int = 16,
    dtype=torch.float32,
    optimizer=None,
    loss=F.cross_entropy,
    amp_dtype=None,
    mode="train",
    frozen=False,
) -> bf.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, 4)).to(dtype)
    if frozen:
        model[0].weight.requires_grad_(False)
    batch = (torch.randn(3, features, dtype=dtype), torch.randint(0, 4, (3,)))
    make = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3))
    return bf.Workload(model, batch, loss, make(model.parameters()), amp_dtype, mode=mode)


def key(workload: bf.Workload, device=None, **settings) -> str:
    device = device or bf.SimulatedDevice("1MiB")
    return fingerprint(fingerprint_fields(workload, device, {"max_batch_size": None, **settings}))


def test_a_second_identical_search_comes_from_the_cache_with_zero_trials(tmp_path):
    first = search_workload(build(), device="sim:1MiB", cache=tmp_path)
    second = search_workload(build(), device="sim:1MiB", cache=tmp_path)
    assert len(first.trials) >= 2 and not first.cached
    assert second.trials == [] and second.cached["hit"] and second.cached["trials"] == len(first.trials)
    assert (second.batch_size, second.peak_bytes, second.held_bytes) == (
        first.batch_size,
        first.peak_bytes,
        first.held_bytes,
    )
    assert "from the result cache: no trials run now" in second.summary()
    assert search_workload(build(), device="sim:1MiB", cache=False).trials  # no cache: measured again


CHANGES = {
    "model structure": lambda: build(width=48),
    "parameter dtype": lambda: build(dtype=torch.float64),
    "frozen parameters": lambda: build(frozen=True),
    "sample shape": lambda: build(features=24),
    "loss": lambda: build(loss=lambda out, targets: F.cross_entropy(out, targets) * 2),
    "loss wrapped in a partial": lambda: build(loss=functools.partial(F.cross_entropy, label_smoothing=0.1)),
    "loss module": lambda: build(loss=nn.CrossEntropyLoss(label_smoothing=0.1)),
    "optimizer class": lambda: build(optimizer=lambda p: torch.optim.AdamW(p)),
    "optimizer state setting": lambda: build(optimizer=lambda p: torch.optim.Adam(p, amsgrad=True)),
    "amp dtype": lambda: build(amp_dtype="bf16"),
    "mode": lambda: build(mode="eval"),
}


@pytest.mark.parametrize("change", CHANGES, ids=str)
def test_every_workload_field_changes_the_fingerprint(change):
    assert key(CHANGES[change]()) != key(build())


def test_device_settings_and_versions_change_the_fingerprint(monkeypatch):
    base = key(build())
    assert key(build(), device=bf.SimulatedDevice("2MiB")) != base  # capacity
    assert key(build(), device=bf.TraceDevice("1MiB")) != base  # device name and kind
    assert key(build(), max_batch_size=8) != base  # search bounds
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert key(build()) != base
    monkeypatch.undo()
    monkeypatch.setattr(batchfit._version, "__version__", "9.9.9")
    assert key(build()) != base


def test_what_leaves_memory_alone_still_hits():
    base = key(build())
    assert key(build(optimizer=lambda p: torch.optim.Adam(p, lr=0.5))) == base  # the learning rate
    other = build()
    other.sample_batch = (torch.randn(7, 16), torch.randint(0, 4, (7,)))  # other values, other row count
    assert key(other) == base


def test_a_changed_fingerprint_misses_end_to_end(tmp_path):
    search_workload(build(), device="sim:1MiB", cache=tmp_path)
    assert search_workload(build(width=48), device="sim:1MiB", cache=tmp_path).trials
    assert len(ResultCache(tmp_path).entries()) == 2


HAMMER = """
import sys, random
from batchfit.search.cache import ResultCache
cache = ResultCache(sys.argv[1])
me = int(sys.argv[2])
for i in range(150):
    k = f"key-{random.randrange(12)}"
    cache.put(k, {"batch_size": i, "writer": me, "trials": [{"batch_size": i}] * 20}, label=k, device="sim", fields={"i": i})
    entry = cache.get(k)
    assert entry is None or entry.result["trials"][0]["batch_size"] == entry.result["batch_size"], entry
    if i % 50 == 0:
        cache.entries()
assert cache.disabled_reason is None, cache.disabled_reason
"""


@pytest.mark.slow  # a campaign: make reliability runs it
def test_two_processes_hammering_the_cache_leave_it_consistent(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", HAMMER, str(tmp_path), str(n)], stderr=subprocess.PIPE, text=True)
        for n in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        assert "caching is off" not in stderr and "rebuilt" not in stderr
    with sqlite3.connect(tmp_path / "results.sqlite") as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        rows = connection.execute("SELECT key, result FROM results").fetchall()
    assert 1 <= len(rows) <= 12
    for row_key, text in rows:
        result = json.loads(text)
        assert result["writer"] in (0, 1) and result["trials"][0]["batch_size"] == result["batch_size"], row_key


def test_a_garbage_cache_file_is_reported_in_one_line_and_rebuilt(tmp_path, caplog):
    (tmp_path / "results.sqlite").write_bytes(os.urandom(8192))
    with caplog.at_level(logging.WARNING, logger="batchfit"):
        first = search_workload(build(), device="sim:1MiB", cache=tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreadable" in warnings[0] and "rebuilt" in warnings[0]
    assert "\n" not in warnings[0]
    second = search_workload(build(), device="sim:1MiB", cache=tmp_path)
    assert first.trials and second.trials == [] and second.batch_size == first.batch_size


def test_a_truncated_database_is_rebuilt_too(tmp_path):
    search_workload(build(), device="sim:1MiB", cache=tmp_path)
    path = tmp_path / "results.sqlite"
    path.write_bytes(path.read_bytes()[:200])
    again = search_workload(build(), device="sim:1MiB", cache=tmp_path)
    assert again.trials  # the stored answer was lost with the damage; the search measured again
    assert search_workload(build(), device="sim:1MiB", cache=tmp_path).trials == []


def _unwritable_folder(tmp_path):
    """A folder no one may write into, root included: /proc where there is one (root ignores permissions)."""
    if os.path.isdir("/proc") and hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/proc"), lambda: None
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return locked, lambda: locked.chmod(0o700)


def test_an_unwritable_cache_folder_turns_caching_off_without_failing(tmp_path, caplog):
    locked, unlock = _unwritable_folder(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="batchfit"):
            result = search_workload(build(), device="sim:1MiB", cache=locked)
    finally:
        unlock()
    assert result.trials and any("caching is off" in r.getMessage() for r in caplog.records)


def test_a_cache_folder_that_cannot_be_made_turns_caching_off_without_failing(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING, logger="batchfit"):
        result = search_workload(build(), device="sim:1MiB", cache=tmp_path / "file" / "cache")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert result.trials and len(warnings) == 1 and "caching is off for this run" in warnings[0]


def test_a_file_given_as_the_cache_folder_is_a_clear_error_where_the_cache_is_the_point(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file: give a folder"):
        ResultCache(tmp_path / "file")  # what `batchfit cache list|clear` open


@pytest.mark.parametrize("how", ["argument", "environment", "link to a file"])
def test_a_file_as_the_cache_folder_never_stops_a_search(tmp_path, monkeypatch, caplog, how):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    cache = {"argument": tmp_path / "file", "environment": True, "link to a file": tmp_path / "link"}[how]
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path / "file"))
    with caplog.at_level(logging.WARNING, logger="batchfit"):
        result = search_workload(build(), device="sim:1MiB", cache=cache)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert result.trials and len(warnings) == 1 and "is a file" in warnings[0] and "caching is off" in warnings[0]
    assert (tmp_path / "file").read_text() == "x"


def test_cache_dir_on_the_command_line_turns_the_cache_on(tmp_path):
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    command = ["find", "mlp", "--device", "sim:8MiB", "--no-trace", "--cache-dir", str(tmp_path), "--json"]
    first = CliRunner().invoke(app, [*command, str(tmp_path / "first.json")])
    second = CliRunner().invoke(app, [*command, str(tmp_path / "second.json")])
    assert first.exit_code == 0 and second.exit_code == 0, (first.output, second.output)
    assert json.loads((tmp_path / "first.json").read_text())["trials"]
    assert json.loads((tmp_path / "second.json").read_text())["trials"] == []  # answered from the folder given


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("BATCHFIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert default_cache_dir() == tmp_path / "xdg" / "batchfit"


def test_clear_and_entries(tmp_path):
    cache = ResultCache(tmp_path)
    for index in range(3):
        cache.put(f"k{index}", {"batch_size": index}, label=f"w{index}", device="sim", fields={})
    assert [e.label for e in cache.entries()] == ["w0", "w1", "w2"]
    assert cache.clear() == 3 and cache.entries() == [] and cache.get("k1") is None


def test_a_read_only_cache_reads_and_never_writes(tmp_path):
    reader = ResultCache(tmp_path / "cache", read_only=True)
    assert reader.get("k1") is None and not (tmp_path / "cache").exists()  # a reader creates nothing
    writer = ResultCache(tmp_path / "cache")
    writer.put("k1", {"batch_size": 8}, label="mlp", device="sim:1MiB", fields={})
    assert reader.get("k1").result == {"batch_size": 8}
    with pytest.raises(InputError, match="opened read-only: store through its writer"):
        reader.put("k2", {"batch_size": 9}, label="mlp", device="sim:1MiB", fields={})
    with sqlite3.connect(writer.path) as connection:  # a damaged row: a miss for the reader, which leaves it
        connection.execute("UPDATE results SET checksum = 'x' WHERE key = 'k1'")
    assert reader.get("k1") is None
    with sqlite3.connect(writer.path) as connection:
        assert connection.execute("SELECT count(*) FROM results").fetchone() == (1,)
