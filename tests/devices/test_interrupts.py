"""Ctrl-C stops a search at once and leaves everything as it was: the model, the optimizer, torch's dispatch
modes, the accounting, the signal handler; nothing is written. SIGINT is raised for real (``signal.raise_signal``)
at the worst moments: inside the weak-reference callback that uncounts a freed storage, and inside a trace."""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.devices.accounting import LiveBytes
from batchfit.devices.interrupts import _on_sigint
from batchfit.devices.interrupts import interrupts_deferred
from batchfit.devices.interrupts import raise_if_interrupted


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
        model, batch, loss_fn=F.cross_entropy, optimizer=optimizer, **{"device": "sim:2MiB", "trace": False, **options}
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


# -- two Ctrl-Cs in quick succession ----------------------------------------------------------------------------


def send_sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # a real signal: Python runs the handler at its next check


def counts_are_whole(counter: LiveBytes) -> bool:
    """Every storage still counted is alive, and the live bytes are the sum of those counted."""
    gc.collect()
    counter.settle()
    entries = list(counter._refs.values())
    return (
        all(ref() is not None for ref, *_ in entries)
        and counter.live_bytes == sum(entry[1] for entry in entries)
        and counter.exact_live_bytes == sum(entry[2] for entry in entries)
    )


def releases_in_a_search(monkeypatch) -> int:
    """How many storages the accounting's weak-reference callback uncounts in a clean search."""
    forget, releases = LiveBytes._forget, []

    def counted(self, key, ref=None):
        if sys._getframe(1).f_code.co_name == "_released":
            releases.append(key)
        return forget(self, key, ref)

    model, batch, optimizer = model_and_batch()
    monkeypatch.setattr(LiveBytes, "_forget", counted)
    find(model, batch, optimizer)
    monkeypatch.setattr(LiveBytes, "_forget", forget)
    return len(releases)


def assert_stopped_whole(model, batch, optimizer, before, clean, device: bf.SimulatedDevice, hook) -> None:
    """The model and optimizer as they were, nothing left pushed or installed, the counts whole, and a search run
    now (on the same device, and on a new one) answers as the clean one did."""
    assert all(torch.equal(a, b) for a, b in zip(before, state(model, optimizer), strict=True))
    assert torch._C._len_torch_dispatch_stack() == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert sys.unraisablehook is hook
    assert counts_are_whole(device.counter)
    for again in (find(model, batch, optimizer, device=device), find(model, batch, optimizer)):
        assert again.batch_size == clean.batch_size
        assert [t.batch_size for t in again.trials] == [t.batch_size for t in clean.trials]


@pytest.mark.parametrize("seed", range(4))
def test_two_quick_ctrl_cs_inside_a_storage_release_stop_the_search_with_the_counts_whole(monkeypatch, seed):
    """The second Ctrl-C used to raise at once inside the weak-reference callback that uncounts a freed storage:
    Python printed and dropped it, the first's flag went with it, the storage was never uncounted, and the search
    answered (848 where 862 is right, in an outside campaign). Now it stays deferred until the next op."""
    at = random.Random(seed).randrange(1, releases_in_a_search(monkeypatch))
    model, batch, optimizer = model_and_batch()
    clean = find(model, batch, optimizer)
    before, hook, device = state(model, optimizer), sys.unraisablehook, bf.SimulatedDevice("2MiB")
    forget, releases = LiveBytes._forget, []

    def interrupted(self, key, ref=None):
        if sys._getframe(1).f_code.co_name == "_released":  # inside the weak-reference callback
            releases.append(key)
            if len(releases) == at:
                send_sigint()  # the first: deferred
                send_sigint()  # the second, at once: inside the release, where a raise would be dropped
        return forget(self, key, ref)

    monkeypatch.setattr(LiveBytes, "_forget", interrupted)
    with pytest.raises(KeyboardInterrupt):
        find(model, batch, optimizer, device=device)
    monkeypatch.setattr(LiveBytes, "_forget", forget)
    assert len(releases) >= at
    assert_stopped_whole(model, batch, optimizer, before, clean, device, hook)


@pytest.mark.parametrize("seed", range(3))
def test_a_second_ctrl_c_from_a_finalizer_of_a_freed_storage_is_not_lost(seed, capfd):
    """The second Ctrl-C comes from a ``weakref.finalize`` of a storage the step frees (so within its release,
    beside the accounting's own callback), where Python drops any exception: it is deferred again, never lost, and
    the search stops at the next op instead of answering."""
    at = random.Random(seed).randrange(1, 5)
    model, batch, optimizer = model_and_batch()
    clean = find(model, batch, optimizer)
    before, hook, device = state(model, optimizer), sys.unraisablehook, bf.SimulatedDevice("2MiB")
    calls = []

    def loss(output, targets):
        calls.append(1)
        if len(calls) == at:
            scratch = output.detach() * 2  # a storage of the step's own, counted
            weakref.finalize(scratch.untyped_storage(), send_sigint)  # the second, when that storage is freed
            send_sigint()  # the first: deferred (any op now would raise it)
            del scratch  # freed here: the finalizer's Ctrl-C is raised at once inside the release
        return F.cross_entropy(output, targets)

    with pytest.raises(KeyboardInterrupt):
        bf.find_max_batch_size(model, batch, loss_fn=loss, optimizer=optimizer, device=device, trace=False)
    assert len(calls) == at
    assert "Exception ignored" not in capfd.readouterr().err  # deferred again, not printed and dropped
    assert_stopped_whole(model, batch, optimizer, before, clean, device, hook)


@pytest.mark.parametrize("seed", range(3))
def test_two_quick_ctrl_cs_in_the_users_code_stop_the_search_at_once(seed):
    """Both in the loss function: the second raises there at once (the user insists), where every count is whole."""
    at = random.Random(seed).randrange(1, 5)
    model, batch, optimizer = model_and_batch()
    clean = find(model, batch, optimizer)
    before, hook, device = state(model, optimizer), sys.unraisablehook, bf.SimulatedDevice("2MiB")
    calls = []

    def loss(output, targets):
        calls.append(1)
        if len(calls) == at:
            send_sigint()
            send_sigint()
            pytest.fail("the second Ctrl-C did not raise at once")  # pragma: no cover
        return F.cross_entropy(output, targets)

    with pytest.raises(KeyboardInterrupt):
        bf.find_max_batch_size(model, batch, loss_fn=loss, optimizer=optimizer, device=device, trace=False)
    assert_stopped_whole(model, batch, optimizer, before, clean, device, hook)


def test_a_second_ctrl_c_amid_the_accounting_waits_for_the_next_safe_point():
    """With the accounting's own code on the stack (here: counting the tensors it is handed), the second Ctrl-C
    stays deferred: raised once, at the next safe point."""

    kept = torch.zeros(4)

    def tensors():
        send_sigint()  # the first
        send_sigint()  # the second: LiveBytes.track_all is on the stack
        yield kept

    counter = LiveBytes()
    with interrupts_deferred():
        counter.track_all(tensors())
        counted = counter.live_bytes
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
        raise_if_interrupted()  # once
    assert counted == 16


def test_a_ctrl_c_pending_when_an_error_leaves_takes_its_place():
    with pytest.raises(KeyboardInterrupt) as caught, interrupts_deferred():
        _on_sigint(signal.SIGINT, None)
        raise ValueError("the search's own error")
    assert isinstance(caught.value.__context__, ValueError)
    raise_if_interrupted()  # nothing left pending outside
