"""@executable_batch_size: both forms, every argument, the sizes tried, the floor, the memory of
what worked, the probe's search, and errors that are not OOM."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

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
        ({"start": 4, "min_batch_size": 8}, r"start \(4\) is below min_batch_size \(8\): raise start"),
        ({"min_batch_size": True}, "min_batch_size must be a positive integer"),
        ({"backoff": 1.0}, r"backoff must be a factor in \(0, 1\)"),
        ({"probe": 3}, "probe must be a callable"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        bf.executable_batch_size(**kwargs)(lambda batch_size: batch_size)


def oom_above(limit: int, batch_size: int) -> None:
    """A fake OOM: raise ``torch.OutOfMemoryError`` when ``batch_size`` is above ``limit``."""
    if batch_size > limit:
        raise torch.OutOfMemoryError(f"CUDA out of memory at batch size {batch_size}")


@dataclass  # compares by value, so unhashable: the memory per instance must not need a hash
class Trainer:
    limit: int

    @bf.executable_batch_size(start=64)
    def fit(self, batch_size, epochs=1):
        oom_above(self.limit, batch_size)
        return batch_size, epochs

    @bf.executable_batch_size(start=64)
    @staticmethod
    def static_below(batch_size, limit):
        oom_above(limit, batch_size)
        return batch_size

    @staticmethod
    @bf.executable_batch_size(start=64)
    def static_above(batch_size, limit):
        oom_above(limit, batch_size)
        return batch_size

    @bf.executable_batch_size(start=64)
    @classmethod
    def per_class(cls, batch_size, limit):
        oom_above(limit, batch_size)
        return cls.__name__, batch_size


def test_on_a_method_each_instance_remembers_its_own_size():
    small, large = Trainer(16), Trainer(40)
    assert small.fit(epochs=2) == (16, 2)
    assert small.fit.history == [(64, "oom"), (32, "oom"), (16, "ok")]
    assert large.fit() == (32, 1)  # starts at 64, not at the 16 the other instance settled on
    assert large.fit.history == [(64, "oom"), (32, "ok")]
    assert small.fit() == (16, 1) and small.fit.history[-1] == (16, "ok")
    assert Trainer.fit(large, epochs=3) == (32, 3)  # through the class, the instance first
    assert large.fit.history == [(64, "oom"), (32, "ok"), (32, "ok")]
    assert (small.fit.batch_size, large.fit.batch_size) == (16, 32)
    assert Trainer(16).fit.history == [] and Trainer.fit.history == []
    with pytest.raises(bf.InputTypeError, match=r"got batch_size= from the caller"):
        small.fit(batch_size=8)
    with pytest.raises(bf.InputTypeError, match=r"needs the instance first: call it as instance\.fit"):
        Trainer.fit()


def test_a_method_forgets_an_instance_once_it_is_collected():
    trainer = Trainer(16)
    trainer.fit()
    alive, key, memories = weakref.ref(trainer), id(trainer), Trainer.__dict__["fit"]._memories
    assert memories[key].history == [(64, "oom"), (32, "oom"), (16, "ok")]
    del trainer
    gc.collect()
    assert alive() is None and key not in memories  # a new object with this id starts afresh


def test_instances_without_weak_references_are_a_clear_error():
    class Slotted:
        __slots__ = ("limit",)

        @bf.executable_batch_size(start=64)
        def fit(self, batch_size):
            return batch_size

    with pytest.raises(bf.InputTypeError, match=r"add '__weakref__' to Slotted\.__slots__"):
        Slotted().fit()


def test_staticmethods_in_either_order_and_classmethods_below_it():
    trainer = Trainer(0)
    assert trainer.static_below(20) == 16 and Trainer.static_below(100) == 16  # remembered
    assert Trainer.static_below.history == [(64, "oom"), (32, "oom"), (16, "ok"), (16, "ok")]
    assert trainer.static_above(40) == 32
    assert Trainer.static_above.history == [(64, "oom"), (32, "ok")]
    assert trainer.per_class(20) == ("Trainer", 16)
    assert Trainer.per_class.history == [(64, "oom"), (32, "oom"), (16, "ok")]

    class Sub(Trainer):
        pass

    assert Sub.per_class(100) == ("Sub", 64)  # each class remembers its own size
    assert Sub.per_class.history == [(64, "ok")] and Trainer.per_class.batch_size == 16


def generator(batch_size):
    yield batch_size


async def coroutine(batch_size):
    return batch_size


async def async_generator(batch_size):
    yield batch_size


@pytest.mark.parametrize(
    ("function", "kind"),
    [
        (generator, "a generator function"),
        (coroutine, r"a coroutine function \(async def\)"),
        (async_generator, "an async generator function"),
        (staticmethod(coroutine), r"a coroutine function \(async def\)"),
    ],
)
def test_generators_and_coroutines_are_refused_when_decorated(function, kind):
    with pytest.raises(bf.InputTypeError, match=rf"is {kind}: .*call it from a plain function"):
        bf.executable_batch_size(start=64)(function)


def test_the_default_start_is_raised_to_min_batch_size():
    @bf.executable_batch_size(min_batch_size=200)
    def train(batch_size):
        oom_above(300, batch_size)
        return batch_size

    assert train() == 200 and train.history == [(200, "ok")]

    @bf.executable_batch_size(min_batch_size=200)
    def too_big(batch_size):
        oom_above(100, batch_size)

    with pytest.raises(bf.NoBatchFitsError, match=r"even at batch size 200 \(the floor"):
        too_big()
    assert too_big.history == [(200, "oom")]
