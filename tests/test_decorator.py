"""@executable_batch_size: both forms, every argument, the sizes tried, the floor, the memory of
what worked, the probe's search, and errors that are not OOM."""

from __future__ import annotations

import pytest
import torch

import batchfit as bf

ROW_BYTES = 1024  # one row of 256 float32


def allocate(device: bf.SimulatedDevice, batch_size: int) -> float:
    """A real allocation of ``batch_size`` rows against the device's capacity (OOM past it)."""
    with device.measuring():
        activations = torch.zeros(batch_size, ROW_BYTES // 4)
        return float(activations.sum())


def edge(device: bf.SimulatedDevice) -> int:
    size = 1
    while True:
        try:
            allocate(device, size + 1)
        except torch.OutOfMemoryError:
            return size
        size += 1


def test_the_bare_form_halves_from_128_and_passes_every_argument_through():
    device = bf.SimulatedDevice("40KiB")
    calls = []

    @bf.executable_batch_size
    def train(batch_size, data, *, epochs=1, **extra):
        """Train."""
        calls.append((batch_size, data, epochs, extra))
        allocate(device, batch_size)
        return batch_size

    assert train("d", epochs=3, seed=7) == 32
    assert train.history == [(128, "oom"), (64, "oom"), (32, "ok")]
    assert calls[-1] == (32, "d", 3, {"seed": 7})
    assert train.__name__ == "train" and train.__doc__ == "Train."
    assert train.batch_size == 32


def test_every_argument_of_the_called_form():
    device = bf.SimulatedDevice("40KiB")

    @bf.executable_batch_size(start=100, max_batch_size=90, min_batch_size=30, backoff=0.75)
    def train(batch_size):
        allocate(device, batch_size)
        return batch_size

    assert train() == 37  # 90 (the cap) -> 67 -> 50 -> 37, each x0.75
    assert train.history == [(90, "oom"), (67, "oom"), (50, "oom"), (37, "ok")]
    assert train() == 37 and train.history[-1] == (37, "ok")  # the next call starts where this one worked


def test_the_floor_is_a_clear_error():
    device = bf.SimulatedDevice("40KiB")

    @bf.executable_batch_size(start=256, min_batch_size=64)
    def train(batch_size):
        allocate(device, batch_size)

    with pytest.raises(bf.NoBatchFitsError, match=r"even at batch size 64 \(the floor, min_batch_size=64\)"):
        train()
    assert train.history == [(256, "oom"), (128, "oom"), (64, "oom")]


def test_with_a_probe_it_searches_up_and_bisects_then_starts_at_the_edge():
    device = bf.SimulatedDevice("40KiB")
    largest = edge(device)
    probed, ran = [], []

    def probe(batch_size):
        probed.append(batch_size)
        allocate(device, batch_size)

    @bf.executable_batch_size(probe=probe, max_batch_size=1000)
    def train(batch_size):
        ran.append(batch_size)
        allocate(device, batch_size)
        return batch_size

    assert train() == largest
    assert probed[:7] == [1, 2, 4, 8, 16, 32, 64]  # up by doubling until 64 fails ...
    assert largest in probed and largest + 1 in probed  # ... then bisection to a confirmed edge
    assert [t.batch_size for t in train.probe_trials] == probed
    assert ran == [largest] and train.history == [(largest, "ok")]
    assert train() == largest and len(probed) == len(train.probe_trials)  # no second search


def test_a_caller_passing_the_batch_size_gets_a_type_error_naming_the_fix():
    @bf.executable_batch_size(start=4)
    def train(batch_size, data):
        return batch_size

    with pytest.raises(TypeError, match=r"got batch_size= from the caller.*call train\(\) without it"):
        train(batch_size=8, data=1)
    with pytest.raises(TypeError, match=r"the other arguments only"):
        train(8, 1)  # one positional argument too many: the caller passed the batch size
    assert train.history == []


def test_other_errors_propagate_at_once_and_are_never_retried():
    calls = []

    @bf.executable_batch_size(start=64)
    def train(batch_size):
        calls.append(batch_size)
        raise ValueError("a bug in the training loop")

    with pytest.raises(ValueError, match="a bug in the training loop"):
        train()
    assert calls == [64]

    @bf.executable_batch_size(start=64)
    def runtime(batch_size):
        calls.append(batch_size)
        raise RuntimeError("CUDA error: device-side assert triggered")  # not an OOM

    with pytest.raises(RuntimeError, match="device-side assert"):
        runtime()
    assert calls == [64, 64]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": 0}, "start must be a positive integer"),
        ({"min_batch_size": 0}, "min_batch_size must be a positive integer"),
        ({"max_batch_size": 2, "min_batch_size": 4}, "must be at least min_batch_size"),
        ({"backoff": 1.0}, r"backoff must be a factor in \(0, 1\)"),
        ({"probe": 3}, "probe must be a callable"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        bf.executable_batch_size(**kwargs)(lambda batch_size: batch_size)
