"""Ctrl-C stops a search at once and leaves everything as it was: the model, the optimizer, torch's dispatch
modes, the accounting, the signal handler; nothing is written. SIGINT is raised for real (``signal.raise_signal``)
at the worst moments: inside the weak-reference callback that uncounts a freed storage, and inside a trace."""

from __future__ import annotations

import signal

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.devices.accounting import LiveBytes
from batchfit.devices.interrupts import _on_sigint
from batchfit.devices.interrupts import interrupts_deferred


def model_and_batch() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()  # state to keep
    return model, (torch.randn(4, 32), torch.randint(0, 4, (4,))), optimizer


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [*model.state_dict().values(), *(p.grad for p in model.parameters())]
    return [t.clone() for t in tensors] + [v.clone() for s in optimizer.state.values() for v in s.values()]


def find(model, batch, optimizer, **options) -> bf.SearchResult:
    return bf.find_max_batch_size(
        model, batch, loss_fn=F.cross_entropy, optimizer=optimizer, device="sim:2MiB", **{"trace": False, **options}
    )


def test_ctrl_c_inside_the_accountings_weak_reference_callback_stops_the_search(monkeypatch):
    """It used to be printed and dropped by Python ("Exception ignored in ..."): the search went on with a count
    left half-updated, and once answered 941 where the answer is 1034."""
    model, batch, optimizer = model_and_batch()
    clean = find(model, batch, optimizer)
    before = state(model, optimizer)
    forget, calls = LiveBytes._forget, []

    def interrupted(self, key, ref=None):
        calls.append(key)
        if len(calls) == 40:
            signal.raise_signal(signal.SIGINT)  # lands while the callback uncounts a storage
        return forget(self, key, ref)

    monkeypatch.setattr(LiveBytes, "_forget", interrupted)
    with pytest.raises(KeyboardInterrupt):
        find(model, batch, optimizer)
    monkeypatch.setattr(LiveBytes, "_forget", forget)
    assert len(calls) >= 40
    assert all(torch.equal(a, b) for a, b in zip(before, state(model, optimizer), strict=True))
    assert torch._C._len_torch_dispatch_stack() == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    again = find(model, batch, optimizer)
    assert again.batch_size == clean.batch_size and [t.batch_size for t in again.trials] == [
        t.batch_size for t in clean.trials
    ]


def test_ctrl_c_inside_a_trace_leaves_no_dispatch_mode_pushed():
    model, batch, optimizer = model_and_batch()
    calls = []

    def loss(output, targets):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return F.cross_entropy(output, targets)

    with pytest.raises(KeyboardInterrupt):
        bf.estimate_memory(model, batch, 64, loss_fn=loss, optimizer=optimizer, device="a100-40gb")
    assert torch._C._len_torch_dispatch_stack() == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    estimate = bf.estimate_memory(model, batch, 64, loss_fn=F.cross_entropy, optimizer=optimizer, device="a100-40gb")
    assert estimate.fits is True


def test_ctrl_c_just_before_a_device_query_from_cpp_waits_for_the_next_op(monkeypatch):
    """``prim.device`` is asked from C++ that cannot pass a Python error on (``F.linear``'s kernels on a fake
    tensor, in a trace): a deferred Ctrl-C raised there aborted the process ("terminate called after throwing an
    instance of 'python_error'")."""
    from batchfit.devices.accounting import _CountingMode

    model, batch, optimizer = model_and_batch()
    before = state(model, optimizer)
    dispatch, in_linear, queries = _CountingMode.__torch_dispatch__, [], []

    def interrupted_before_queries(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default and in_linear:
            queries.append(func)
            if len(queries) == 1:
                signal.raise_signal(signal.SIGINT)  # pending as the query reaches the counting mode
        return dispatch(self, func, types, args, kwargs)

    model[0].register_forward_pre_hook(lambda module, args: in_linear.append(True))
    model[0].register_forward_hook(lambda module, args, output: in_linear.clear())
    monkeypatch.setattr(_CountingMode, "__torch_dispatch__", interrupted_before_queries)
    with pytest.raises(KeyboardInterrupt):
        find(model, batch, optimizer, trace=True)
    assert queries
    assert all(torch.equal(a, b) for a, b in zip(before, state(model, optimizer), strict=True))
    assert torch._C._len_torch_dispatch_stack() == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_raises_at_once():
    with interrupts_deferred():
        _on_sigint(signal.SIGINT, None)  # the first: deferred
        with pytest.raises(KeyboardInterrupt):
            _on_sigint(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_command_line_exits_130_and_writes_nothing(tmp_path):
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    (tmp_path / "work.py").write_text(
        "import signal, torch, batchfit as bf\n"
        "from torch.nn import functional as F\n"
        "calls = []\n"
        "def loss(output, targets):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 5:\n"
        "        signal.raise_signal(signal.SIGINT)\n"
        "    return F.cross_entropy(output, targets)\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Linear(32, 4)\n"
        "    return bf.Workload(model, (torch.randn(4, 32), torch.randint(0, 4, (4,))), loss,\n"
        "                       torch.optim.Adam(model.parameters()))\n"
    )
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["find", f"{tmp_path}/work.py:make", "--device", "sim:2MiB", "--json", str(out)])
    assert result.exit_code == 130, result.output
    written = sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__")  # Python's, not batchfit's
    assert not out.exists() and written == ["work.py"]
