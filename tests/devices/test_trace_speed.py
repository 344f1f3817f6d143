"""The trace's shortcut for element-wise ops (``fake_values._elementwise_answer``): the same fake
tensors, storages and bytes as the fake kernels, the same trials and edge, the same errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchfit as bf
from batchfit.devices import fake_values
from batchfit.devices.trace import TraceDevice
from batchfit.search.lines_first import LinesFirst
from batchfit.search.runner import search_workload
from models import cnn_bn
from models import dict_model
from models import mlp_tuple
from models import transformer


def _kernels_only(monkeypatch) -> None:
    monkeypatch.setattr(fake_values, "_elementwise_answer", lambda *args: None)


def _layout(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, tensor.untyped_storage().nbytes())


def _same_storage(one: torch.Tensor, other: torch.Tensor) -> bool:
    return one.untyped_storage()._cdata == other.untyped_storage()._cdata


def _conv_sgd() -> bf.Workload:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Hardswish(), nn.Flatten(), nn.Linear(4 * 36, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return bf.Workload(model, (torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))), nn.CrossEntropyLoss(), optimizer)


def _gelu_adamw() -> bf.Workload:
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.SiLU(), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), amsgrad=True)
    return bf.Workload(model, (torch.randn(4, 8), torch.randn(4, 2)), nn.MSELoss(), optimizer)


def _fake_trials(build) -> tuple:
    tracer = TraceDevice("64MiB")
    strategy = LinesFirst(tracer.counter)
    result = search_workload(build(), device=tracer, steps=2, trace=False, strategy=strategy)
    trials = [(t.batch_size, t.fits, t.peak_bytes, t.phase_peak_bytes, t.timeline) for t in result.trials]
    return strategy.edge, strategy.method, trials


@pytest.mark.parametrize(
    "build",
    [  # the two largest (0.7-0.8 s each) run in make reliability
        pytest.param(mlp_tuple, marks=pytest.mark.slow),
        cnn_bn,
        pytest.param(transformer, marks=pytest.mark.slow),
        dict_model,
        _conv_sgd,
        _gelu_adamw,
    ],
)
def test_the_shortcut_leaves_every_fake_trial_and_the_edge_as_the_fake_kernels_give_them(build, monkeypatch):
    torch.manual_seed(0)
    quick = _fake_trials(build)
    _kernels_only(monkeypatch)
    torch.manual_seed(0)
    assert quick == _fake_trials(build)


def test_an_adam_step_on_fake_tensors_takes_the_shortcut(monkeypatch):
    answered = []
    shortcut = fake_values._elementwise_answer

    def counting(func, args, kwargs, mode):
        answer = shortcut(func, args, kwargs, mode)
        answered.extend([str(func)] if answer is not None else [])
        return answer

    monkeypatch.setattr(fake_values, "_elementwise_answer", counting)
    _fake_trials(mlp_tuple)
    assert {"aten.lerp_.Scalar", "aten.addcdiv_.default", "aten.sqrt.default"} <= set(answered)


CALLS = [
    ("add_", lambda a, b: a.add_(b, alpha=0.5)),
    ("mul_ number", lambda a, b: a.mul_(0.9)),
    ("lerp_", lambda a, b: a.lerp_(b, 0.1)),
    ("addcmul_", lambda a, b: a.addcmul_(b, b, value=0.01)),
    ("addcdiv_", lambda a, b: a.addcdiv_(a, b.sqrt().add_(1e-8), value=-0.1)),
    ("copy_", lambda a, b: a.copy_(b)),
    ("zero_", lambda a, b: a.zero_()),
    ("sqrt", lambda a, b: a.sqrt()),
    ("div number", lambda a, b: a / 3.0),
    ("sub", lambda a, b: a - b),
    ("gelu", lambda a, b: nn.functional.gelu(a, approximate="tanh")),
    ("threshold_backward", lambda a, b: torch.ops.aten.threshold_backward(a, b, 0.0)),
]


@pytest.mark.parametrize("shape", [(3, 1, 4), (5,), (), (2, 0)], ids=str)
@pytest.mark.parametrize(("name", "call"), CALLS, ids=[name for name, _ in CALLS])
def test_each_shortcut_answer_is_the_fake_kernels(name, call, shape, monkeypatch):
    def run() -> tuple:
        mode = fake_values.TraceFakeMode()
        with mode:
            a, b = torch.empty(shape), torch.empty(shape)
            out = call(a, b)
        return _layout(out), out is a, _same_storage(out, a), _same_storage(out, b)

    quick = run()
    _kernels_only(monkeypatch)
    assert quick == run()


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b, c: a.add_(c),  # c broadcasts to a larger shape than a: no in-place add
        lambda a, b, c: a.copy_(b.t()),  # shapes differ
        lambda a, b, c: a.long().add_(0.5),  # a float written into an integer tensor
        lambda a, b, c: a.lerp_(b.double(), 0.5),  # dtypes differ
    ],
)
def test_what_the_shortcut_does_not_answer_still_meets_the_fake_kernel(call):
    mode = fake_values.TraceFakeMode()
    with mode:
        a, b, c = torch.empty(4, 3), torch.empty(4, 3), torch.empty(2, 4, 3)
        with pytest.raises(RuntimeError):
            call(a, b, c)
