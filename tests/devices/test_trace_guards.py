"""The trace's two guards: an op whose fake kernel makes less memory than the real one (the CPU
LSTM's workspace) is completed where the missing bytes are known and otherwise turns an estimate
into a lower bound with a warning, and an error on fake tensors is either the user's own (raised
unchanged) or something the trace cannot do (a fallback to real probing)."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import batchfit as bf
from batchfit.devices import undercounts
from batchfit.devices.trace import UNDERCOUNTING_OPS
from batchfit.devices.trace import TraceDevice
from batchfit.devices.trace import is_users_error
from batchfit.devices.trace import lstm_workspace_bytes
from batchfit.devices.trace_errors import tracing
from batchfit.errors import TraceError
from state_checks import assert_same
from state_checks import fingerprint

MKLDNN_RNN = "aten::mkldnn_rnn_layer"


class LastStep(nn.Module):
    """A one-layer LSTM read at its last step: on CPU it runs ``aten::mkldnn_rnn_layer``."""

    def __init__(self, rnn: type[nn.RNNBase] = nn.LSTM):
        super().__init__()
        self.rnn, self.head = rnn(32, 64, batch_first=True), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def _lstm(rnn: type[nn.RNNBase] = nn.LSTM):
    torch.manual_seed(0)
    model = LastStep(rnn)
    return model, torch.randn(4, 16, 32), torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


class _OutputBytes(TorchDispatchMode):
    """Storage bytes of every op's new outputs (not views or in-place results), in call order."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(ret.alias_info for ret in func._schema.returns):
            sizes = [t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.calls.append((func.name(), sizes))
        return out


def _output_bytes(model: nn.Module, batch: torch.Tensor, fake: bool, traced: bool = False) -> dict[str, list[int]]:
    """The total output bytes of each op of one forward and backward, real or on fake tensors
    (``traced``: as a trial on the TraceDevice sees them, workspaces completed)."""
    device = TraceDevice("1GiB")
    if fake:
        work = device.prepare(bf.Workload(model, batch, loss_fn=_loss))
        model, batch = work.model, work.sample_batch
    record = _OutputBytes()
    context = (device.measuring() if traced else device.fake_mode) if fake else contextlib.nullcontext()
    with context, record:
        _loss(model(batch), batch).backward()
    totals: dict[str, list[int]] = {}
    for name, sizes in record.calls:
        totals.setdefault(name, []).append(sum(sizes))
    return totals


@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU, nn.RNN], ids=lambda rnn: rnn.__name__)
def test_the_table_holds_exactly_the_ops_whose_fake_outputs_are_smaller(rnn):
    model, batch, _ = _lstm(rnn)
    real, fake = _output_bytes(model, batch, fake=False), _output_bytes(model, batch, fake=True)
    smaller = {name for name in real if name in fake and sum(fake[name]) < sum(real[name])}
    assert smaller == ({MKLDNN_RNN} if rnn is nn.LSTM else set())
    assert smaller <= set(UNDERCOUNTING_OPS)


def test_the_trace_makes_the_workspace_the_real_lstm_kernel_keeps():
    model, batch, _ = _lstm()
    real, traced = _output_bytes(model, batch, fake=False), _output_bytes(model, batch, fake=True, traced=True)
    assert traced[MKLDNN_RNN] == real[MKLDNN_RNN] and real[MKLDNN_RNN][0] > 0
    assert {name: sum(sizes) for name, sizes in traced.items() if name in real} == {
        name: sum(sizes) for name, sizes in real.items() if name in traced
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (7, 3, 33, 64), (2, 5, 300, 129), (33, 2, 1, 100)], ids=str)
def test_the_workspace_formula_is_what_the_real_kernel_keeps(shape, dtype):
    steps, batch, input_size, hidden_size = shape
    try:
        real_bytes = undercounts._real_workspace_bytes(*shape, dtype)
    except RuntimeError:  # a CPU without oneDNN's bf16 LSTM: the trace keeps the guard there
        pytest.skip(f"no oneDNN LSTM in {dtype} on this CPU")
    assert real_bytes == lstm_workspace_bytes(steps, batch, input_size, hidden_size, itemsize=dtype.itemsize)


def test_a_build_whose_kernel_disagrees_with_the_formula_keeps_the_guard(monkeypatch):
    assert undercounts._formula_holds.__wrapped__(torch.float32)
    monkeypatch.setattr(undercounts, "_real_workspace_bytes", lambda *shape: lstm_workspace_bytes(*shape[:4]) + 4096)
    assert not undercounts._formula_holds.__wrapped__(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_a_workspace_of_an_unmeasured_dtype_or_packed_sequence_stays_unknown(dtype):
    def arguments(dtype: torch.dtype, batch_sizes: list[int]) -> dict:
        x, cx = torch.zeros(6, 3, 8, dtype=dtype), torch.zeros(3, 16, dtype=dtype)
        return {"input": x, "cx_": cx, "mode": undercounts.LSTM_MODE, "batch_sizes": batch_sizes, "hidden_size": 16}

    assert undercounts._lstm_workspace_of(arguments(torch.float32, [])) == lstm_workspace_bytes(6, 3, 8, 16)
    assert undercounts._lstm_workspace_of(arguments(dtype, [])) is None
    assert undercounts._lstm_workspace_of(arguments(torch.float32, [3, 3, 2])) is None


def test_a_trace_for_another_device_only_records_the_workspace():
    model, batch, _ = _lstm()
    device, seen = TraceDevice("1GiB"), {}
    work = device.prepare(bf.Workload(model, batch, loss_fn=_loss))
    with device.fake_mode, undercounts.UndercountWatch(seen, complete=False):
        work.model(work.sample_batch)
    assert list(seen) == [MKLDNN_RNN]  # a GPU's kernel keeps another workspace: a lower bound


class Stacked(nn.Module):
    """Two bidirectional layers, read at the last step."""

    def __init__(self, rnn: type[nn.RNNBase]):
        super().__init__()
        self.rnn, self.head = rnn(24, 40, num_layers=2, bidirectional=True, batch_first=True), nn.Linear(80, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


RECURRENT_CASES = [  # (rnn, two bidirectional layers?, autocast): GRU and RNN run per step, slower to trace
    (nn.LSTM, False, None),
    (nn.LSTM, False, "bf16"),
    (nn.LSTM, True, None),
    (nn.LSTM, True, "bf16"),
    (nn.GRU, False, None),  # GRU and RNN never call the LSTM kernel: a check that nothing else moved
    (nn.RNN, True, None),
]


@pytest.mark.parametrize(
    ("rnn", "stacked", "amp"), RECURRENT_CASES, ids=lambda value: getattr(value, "__name__", str(value))
)
def test_a_recurrent_estimate_is_within_one_percent_of_the_measured_peak(rnn, stacked, amp):
    torch.manual_seed(0)
    model = Stacked(rnn) if stacked else LastStep(rnn)
    batch = torch.randn(4, 12, 24 if stacked else 32)
    kwargs = {"loss_fn": _loss, "optimizer": torch.optim.Adam(model.parameters()), "amp_dtype": amp}
    for batch_size in (1, 40):  # the workspace grows with the batch: two sizes test its line
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing under-counted: no warning
            estimate = bf.estimate_memory(model, batch, batch_size, device="1GiB", **kwargs)
        measured = bf.probe_batch_size(model, batch, batch_size, device=bf.SimulatedDevice("1GiB"), **kwargs)
        assert abs(estimate.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes
        assert estimate.undercounted_ops == () and estimate.fits is True


def test_auto_finds_the_lstm_edge_exactly_in_at_most_three_trials(caplog):
    model, batch, optimizer = _lstm()
    kwargs = {"loss_fn": _loss, "optimizer": optimizer}
    with caplog.at_level("WARNING", logger="batchfit"):
        result = bf.find_max_batch_size(model, batch, device=bf.SimulatedDevice("12MiB"), trace=True, **kwargs)
    assert "under-counts" not in caplog.text and len(result.trials) <= 3
    edge = result.batch_size
    assert bf.probe_batch_size(model, batch, edge, device=bf.SimulatedDevice("12MiB"), **kwargs).fits
    assert not bf.probe_batch_size(model, batch, edge + 1, device=bf.SimulatedDevice("12MiB"), **kwargs).fits
    assert result.extra["trace"]["batch_size"] == edge > 1


@pytest.fixture
def unverified(monkeypatch):
    """A torch build on which the workspace formula does not hold: the op stays under-counted."""
    monkeypatch.setattr(undercounts, "_formula_holds", lambda dtype: False)


def test_an_lstm_estimate_warns_and_gives_no_fits_verdict_it_cannot_back(unverified):
    model, batch, optimizer = _lstm()
    real = bf.probe_batch_size(model, batch, 64, loss_fn=_loss, optimizer=optimizer, device=bf.SimulatedDevice("1GiB"))
    traced = TraceDevice(1 << 40)
    with pytest.warns(UserWarning, match=r"under-counts aten::mkldnn_rnn_layer .*batchfit find --device sim:"):
        lower = bf.estimate_memory(model, batch, 64, loss_fn=_loss, optimizer=optimizer, device=traced)
    assert lower.peak_bytes < real.peak_bytes  # the workspace the fake kernel leaves out
    between = (lower.peak_bytes + real.peak_bytes) // 2
    with pytest.warns(UserWarning, match="under-counts"):
        estimate = bf.estimate_memory(model, batch, 64, loss_fn=_loss, optimizer=optimizer, device=between)
    assert estimate.undercounted_ops == (MKLDNN_RNN,) and estimate.fits is None  # not "fits": it does not
    assert "peak is at least" in estimate.summary() and "it may not fit in" in estimate.summary()
    assert estimate.to_dict()["undercounted_ops"] == [MKLDNN_RNN] and estimate.to_dict()["fits"] is None
    with pytest.warns(UserWarning, match="under-counts"):
        small = bf.estimate_memory(model, batch, 64, loss_fn=_loss, optimizer=optimizer, device=lower.peak_bytes - 1)
    assert small.fits is False  # a lower bound over the capacity is a verdict it can back


def test_estimates_without_such_ops_stay_silent_verdicts():
    model, batch, optimizer = _lstm(nn.GRU)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        estimate = bf.estimate_memory(model, batch, 64, loss_fn=_loss, optimizer=optimizer, device="1GiB")
        lstm, lstm_batch, _ = _lstm()
        inference = bf.estimate_memory(lstm, lstm_batch, 64, mode="eval", device="1GiB")  # no_grad: no workspace
    assert estimate.undercounted_ops == () == inference.undercounted_ops
    assert estimate.fits is True and inference.fits is True


def test_a_traced_first_guess_that_undercounts_is_logged_and_the_real_probes_decide(unverified, caplog):
    model, batch, optimizer = _lstm()
    kwargs = {"loss_fn": _loss, "optimizer": optimizer, "max_batch_size": 256}
    with caplog.at_level("WARNING", logger="batchfit"):
        guessed = bf.find_max_batch_size(model, batch, device=bf.SimulatedDevice("12MiB"), trace=True, **kwargs)
    assert "under-counts aten::mkldnn_rnn_layer" in caplog.text and "only a first guess" in caplog.text
    probed = bf.find_max_batch_size(model, batch, device=bf.SimulatedDevice("12MiB"), trace=False, **kwargs)
    assert guessed.batch_size == probed.batch_size and guessed.extra["trace"]["batch_size"] > guessed.batch_size


def test_the_users_own_value_error_on_fake_tensors_is_raised_unchanged(caplog):
    model, batch = nn.Linear(8, 8), torch.randn(4, 8)
    optimizer = torch.optim.Adam(model.parameters())
    _loss(model(batch), batch).backward()
    optimizer.step()
    before = fingerprint(bf.Workload(model, batch, optimizer=optimizer))
    raised, calls = ValueError("bad targets"), []

    def loss_fn(out, batch):
        calls.append(type(out).__name__)
        raise raised

    with caplog.at_level("WARNING", logger="batchfit"), pytest.raises(ValueError) as error:
        bf.find_max_batch_size(model, batch, loss_fn=loss_fn, optimizer=optimizer, device="sim:64KiB", trace=True)
    assert error.value is raised and calls == ["FakeTensor"]  # raised by the trace, no real probe
    assert "could not trace" not in caplog.text
    assert_same(before, fingerprint(bf.Workload(model, batch, optimizer=optimizer)))
    with pytest.raises(ValueError, match="^bad targets$"):
        bf.estimate_memory(model, batch, 8, loss_fn=loss_fn)


class NeedsData(nn.Module):
    """A model whose forward reads values (``.item()``, ``.tolist()``), shapes by data
    (``torch.nonzero``) or formats a number: all fine on real tensors, none on fake ones."""

    def __init__(self, read: str):
        super().__init__()
        self.read, self.linear = read, nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.read == "item":
            return y * (1.0 + 0.0 * y.abs().max().item())
        if self.read == "tolist":
            return y * len(y.tolist())
        if self.read == "nonzero":
            return y + torch.nonzero(y > 0).shape[0] * 0.0
        if self.read == "wrapped":  # the user's ValueError, raised because .item() failed
            try:
                return y * y.max().item()
            except RuntimeError as error:
                raise ValueError("need a number") from error
        label = f"{y.sum():.3f}"  # a TypeError on a fake tensor
        return y * len(label) / len(label)


@pytest.mark.parametrize("read", ["item", "tolist", "nonzero", "wrapped", "format"])
def test_what_fake_tensors_cannot_do_falls_back_to_real_probing(read, caplog):
    batch = torch.randn(4, 8)
    with caplog.at_level("WARNING", logger="batchfit"):
        result = bf.find_max_batch_size(NeedsData(read), batch, loss_fn=_loss, device="sim:64KiB", trace=True)
    assert "could not trace the workload" in caplog.text and "probing without an estimate" in caplog.text
    probed = bf.find_max_batch_size(NeedsData(read), batch, loss_fn=_loss, device="sim:64KiB", trace=False)
    assert result.batch_size == probed.batch_size > 1 and "trace" not in result.extra
    with pytest.raises(TraceError, match="cannot trace this workload on fake tensors"):
        bf.estimate_memory(NeedsData(read), batch, 8, loss_fn=_loss)


class Locked(nn.Linear):
    """A model holding a lock: it trains, but cannot be copied onto fake tensors."""

    def __init__(self):
        super().__init__(8, 8)
        self.lock = threading.Lock()


def test_a_model_the_trace_cannot_copy_is_a_trace_error_not_the_users(caplog):
    batch = torch.randn(4, 8)
    with pytest.raises(TraceError, match=r"cannot trace .*TypeError: cannot pickle"):
        bf.estimate_memory(Locked(), batch, 8, loss_fn=_loss)
    with caplog.at_level("WARNING", logger="batchfit"):
        result = bf.find_max_batch_size(Locked(), batch, loss_fn=_loss, device="sim:64KiB", trace=True)
    assert "could not trace the workload (TypeError: cannot pickle" in caplog.text and result.batch_size > 1


def test_an_error_raised_in_batchfits_trace_is_never_the_users():
    def raise_in(filename: str) -> BaseException:
        try:
            exec(compile("raise TypeError('internal')", filename, "exec"))
        except TypeError as error:
            return error
        raise AssertionError("nothing raised")

    for module in ("trace", "trace_errors", "undercounts", "fake_values", "value_rules"):
        assert not is_users_error(raise_in(f"/site-packages/batchfit/devices/{module}.py"))
    assert not is_users_error(raise_in("/site-packages/torch/_subclasses/fake_tensor.py"))
    assert is_users_error(raise_in("/home/user/train.py"))
    assert not is_users_error(RuntimeError("boom")) and not is_users_error(TraceError("no fake kernel"))


def test_a_data_dependent_guard_is_the_traces_once_symbolic_shapes_are_loaded():
    """``import batchfit`` leaves symbolic shapes (and sympy) unloaded; the guard error they raise still counts
    as the trace's, also when the user's code re-raises it as a ValueError."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    guard = GuardOnDataDependentSymNode(sympy.Symbol("u0"), "Could not guard on data-dependent expression u0 > 0")
    try:
        try:
            raise guard
        except RuntimeError as error:
            exec(compile("raise ValueError('bad shape')", "/home/user/train.py", "exec"))
            raise AssertionError("nothing raised") from error
    except ValueError as reraised:
        assert not is_users_error(reraised)
    with pytest.raises(TraceError, match="GuardOnDataDependentSymNode: Could not guard"), tracing():
        raise guard
