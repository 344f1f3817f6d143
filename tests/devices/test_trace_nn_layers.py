"""Stock ``torch.nn`` layers on the trace: the ones whose step asks its data a question (a causal
or padding mask, rows picked from the targets, lengths), the nested-tensor fast path of
``nn.TransformerEncoder``, and col2im's storage, each traced to within 1% of the peak the
simulated device measures at the same batch size; and a layer the trace cannot run gives a
one-line reason to fall back on. The whole table is benchmarks/nn_layers_trace.py's."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import rnn as rnn_utils

import batchfit as bf
from batchfit.devices import fake_values
from batchfit.devices import undercounts
from batchfit.devices.trace import TraceDevice
from batchfit.errors import TraceError
from batchfit.search.estimate import estimate_workload
from batchfit.step.batching import tensor_leaves

BATCH = 16
FEATURES = 32


def _loss(out: Any, batch: dict) -> torch.Tensor:
    """The mean of every floating tensor in ``out`` (AdaptiveLogSoftmaxWithLoss returns two)."""
    return sum(t.float().mean() for t in tensor_leaves(out) if t.is_floating_point())


def _workload(model: nn.Module, batch: dict, mode: str = "train") -> bf.Workload:
    return bf.Workload(model, batch, loss_fn=_loss, optimizer=torch.optim.AdamW(model.parameters()), mode=mode)


def _peaks(model: nn.Module, batch: dict, mode: str = "train", analytic: bool = True) -> tuple[int, int]:
    """(traced, real) peaks at ``BATCH``: ``estimate_memory``'s on a TraceDevice, a real trial's
    on a SimulatedDevice."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype warning for nested tensors
        traced = estimate_workload(_workload(model, batch, mode), BATCH, device=TraceDevice("1GiB"), analytic=analytic)
        work = _workload(model, batch, mode)
        real = bf.probe_batch_size(
            model, batch, BATCH, loss_fn=_loss, optimizer=work.optimizer, mode=mode, device=bf.SimulatedDevice("1GiB")
        )
    return traced.peak_bytes, real.peak_bytes


def _assert_matches(model: nn.Module, batch: dict, mode: str = "train", analytic: bool = True) -> None:
    traced, real = _peaks(model, batch, mode, analytic)
    assert math.isclose(traced, real, rel_tol=0.01), (traced, real)


def _padding(valid: tuple[int, ...], seq: int = 24) -> torch.Tensor:
    """True where a row is padding; each row's tokens first."""
    return torch.arange(seq)[None, :] >= torch.tensor(valid)[:, None]


class Encoder(nn.Module):
    """Tokens through a 4-layer ``nn.TransformerEncoder`` (0.93M parameters with the head).
    ``causal``: ``"forward"`` makes the causal mask in forward, ``"buffer"`` keeps it as a buffer."""

    def __init__(self, causal: str | None = None, head: bool = True, seq: int = 24):
        super().__init__()
        torch.manual_seed(0)
        self.causal = causal
        self.embed = nn.Embedding(512, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=True)
        self.head = nn.Linear(128, 512) if head else nn.Identity()
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        mask = {"forward": nn.Transformer.generate_square_subsequent_mask(tokens.shape[1]), "buffer": self.mask}
        return self.head(self.encoder(self.embed(tokens), mask=mask.get(self.causal), src_key_padding_mask=padding))


def _tokens(padded: bool = False, valid: tuple[int, ...] = (20, 24, 13, 17)) -> dict:
    torch.manual_seed(1)
    batch = {"tokens": torch.randint(0, 512, (4, 24))}
    if padded:
        batch["padding"] = _padding(valid)
    return batch


def test_the_encoder_is_the_size_the_issue_reported():
    assert 0.85e6 < sum(p.numel() for p in Encoder().parameters()) < 0.95e6


def test_transformer_encoder_trains_with_a_padding_mask_within_one_percent():
    _assert_matches(Encoder(), _tokens(padded=True))


@pytest.mark.parametrize("causal", ["forward", "buffer"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_causal_mask_is_checked_as_the_real_step_checks_it(causal, mode):
    # TransformerEncoder asks whether the mask is causal (`bool((mask == causal).all())`): a
    # data-dependent question that stopped the trace; the mask's values are now kept.
    _assert_matches(Encoder(causal=causal), _tokens(), mode)


@pytest.mark.parametrize("valid", [(20, 24, 13, 17), (3, 24, 2, 5), (24, 24, 24, 24)], ids=str)
def test_the_nested_tensor_fast_path_counts_the_unpadded_tokens(valid):
    # eval with a padding mask: the real step packs the unpadded tokens into a nested tensor
    # (which fake tensors cannot be); without the head the encoder's tensors make the peak.
    _assert_matches(Encoder(head=False), _tokens(padded=True, valid=valid), "eval")


def test_the_nested_fast_path_peak_follows_the_padding():
    short = _peaks(Encoder(head=False), _tokens(padded=True, valid=(3, 24, 2, 5)), "eval")
    full = _peaks(Encoder(head=False), _tokens(padded=True, valid=(24, 24, 24, 24)), "eval")
    assert short[0] < full[0] and short[0] == short[1] and full[0] == full[1]


class Attention(nn.Module):
    def __init__(self, need_weights: bool = True, seq: int = 24, width: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.seq, self.width, self.need_weights = seq, width, need_weights
        self.pre = nn.Linear(FEATURES, seq * width)
        self.attention = nn.MultiheadAttention(width, 4, batch_first=True)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        h = self.pre(x).view(x.shape[0], self.seq, self.width)
        return self.attention(h, h, h, key_padding_mask=padding, need_weights=self.need_weights)[0]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_multihead_attention_with_a_padding_mask_within_one_percent(mode):
    torch.manual_seed(1)
    _assert_matches(
        Attention(need_weights=mode == "train"),
        {"x": torch.randn(4, FEATURES), "padding": _padding((20, 24, 13, 17))},
        mode,
    )


class Pre(nn.Module):
    """``Linear(FEATURES, prod(shape))`` viewed as ``(batch, *shape)``, then ``layer(h, **rest)``."""

    def __init__(self, layer: nn.Module, shape: tuple[int, ...], post: Callable | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.shape, self.layer, self.post = shape, layer, post
        self.pre = nn.Linear(FEATURES, math.prod(shape))

    def forward(self, x: torch.Tensor, **rest: torch.Tensor) -> torch.Tensor:
        h = self.pre(x).view(x.shape[0], *self.shape)
        return self.layer(self.post(h) if self.post else h, *rest.values())


def _features(**rest: torch.Tensor) -> dict:
    torch.manual_seed(1)
    return {"x": torch.randn(4, FEATURES), **rest}


def test_gaussian_nll_checks_the_variance_it_is_given():
    # `torch.any(var < 0)` on the batch's variances
    _assert_matches(Pre(nn.GaussianNLLLoss(), (8,)), _features(target=torch.rand(4, 8), var=torch.rand(4, 8)))


def test_adaptive_log_softmax_picks_the_rows_of_each_cluster():
    # `nonzero` on a mask of the targets: an output shape that depends on values
    targets = torch.tensor([3, 15, 33, 7])
    _assert_matches(Pre(nn.AdaptiveLogSoftmaxWithLoss(16, 40, [10, 20]), (16,)), _features(target=targets))


class CTC(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.loss = nn.Linear(FEATURES, 12 * 6), nn.CTCLoss()

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = self.pre(x).view(x.shape[0], 12, 6).log_softmax(-1).transpose(0, 1)
        return self.loss(log_probs, targets, input_lengths, target_lengths)


def test_ctc_loss_sizes_its_alphas_by_the_longest_target():
    batch = _features(
        targets=torch.randint(1, 6, (4, 5)),
        input_lengths=torch.tensor([12, 10, 12, 11]),
        target_lengths=torch.tensor([5, 3, 4, 2]),
    )
    _assert_matches(CTC(), batch)


class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.lstm = nn.Linear(FEATURES, 12 * 16), nn.LSTM(16, 32, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.pre(x).view(x.shape[0], 12, 16)
        packed = rnn_utils.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        return self.lstm(packed)[0].data


def test_a_packed_sequence_has_the_rows_its_lengths_sum_to():
    # the trial, and estimate_memory's analytic part beside it
    _assert_matches(Packed(), _features(lengths=torch.tensor([12, 7, 9, 3])))


@pytest.mark.parametrize(
    "layer, shape",
    [(nn.Unfold(kernel_size=3), (4, 16, 16)), (nn.Fold(output_size=(8, 8), kernel_size=2), (16, 49))],
    ids=["Unfold", "Fold"],
)
def test_col2im_keeps_a_storage_of_its_input_size(layer, shape):
    # nn.Unfold traced at 0.78 of the real peak: the real col2im keeps max(input, output) elements
    _assert_matches(Pre(layer, shape), _features())


def test_col2im_formula_is_checked_against_this_build():
    assert undercounts._col2im_formula_holds.__wrapped__()


def test_a_data_question_on_the_parameters_is_a_one_line_reason_to_fall_back():
    class Gated(nn.Module):
        """Padding decided by the activations: the trace cannot know it."""

        def __init__(self):
            super().__init__()
            self.encoder = Encoder(head=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.encoder.embed(tokens)
            return self.encoder.encoder(h, src_key_padding_mask=h[..., 0] > 1.0)

    with pytest.raises(TraceError) as raised, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate_workload(_workload(Gated(), _tokens(), "eval"), BATCH, analytic=False)
    message = str(raised.value)
    assert "\n" not in message and "padding mask's values" in message and "batchfit find" in message


def test_values_past_the_kept_size_are_a_one_line_reason_and_the_search_probes_for_real(monkeypatch, caplog):
    monkeypatch.setattr(fake_values, "SHADOW_MAX_BYTES", 0)  # nothing kept: the causal check cannot be answered
    model, batch = Encoder(causal="forward"), _tokens()
    with pytest.raises(TraceError) as raised:
        estimate_workload(_workload(model, batch), BATCH, analytic=False)
    assert "\n" not in str(raised.value) and "aten._local_scalar_dense" in str(raised.value)
    with caplog.at_level(logging.WARNING, logger="batchfit"):
        found = bf.find_max_batch_size(
            model, batch, loss_fn=_loss, device=bf.SimulatedDevice("64MiB"), trace=True, max_batch_size=64
        )
    assert found.batch_size >= 1
    assert any("could not trace" in record.getMessage() for record in caplog.records)


def test_the_users_tensors_are_never_written():
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(FEATURES, 4)

        def forward(self, x: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
            flags.mul_(2)  # on the batch built from the sample, in place, with values the trace keeps
            return self.lin(x) * flags.float().mean()

    batch = _features(flags=torch.ones(4, dtype=torch.int64))
    before = {key: value.clone() for key, value in batch.items()}
    estimate_workload(_workload(Writes(), batch), BATCH, analytic=False)
    assert all(torch.equal(before[key], batch[key]) for key in batch)


def test_the_values_kept_stay_within_their_budget(monkeypatch):
    class Zeros(nn.Module):
        """Makes four 256 KiB constants in forward, alive together: real copies of all would be 1 MiB."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(FEATURES, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            parts = [torch.ones(x.shape[0], 4096) for _ in range(4)]  # alive together
            return self.lin(x) + sum(part.sum() for part in parts) + torch.empty(x.shape[0], 4096).shape[0]

    kept: list[int] = []
    add = fake_values._Shadows.add

    def watched(self, fake, real):
        add(self, fake, real)
        kept.append(self.kept_bytes)

    monkeypatch.setattr(fake_values, "SHADOW_BUDGET_BYTES", 2**19)
    monkeypatch.setattr(fake_values._Shadows, "add", watched)
    estimate_workload(_workload(Zeros(), _features()), BATCH, analytic=False)
    assert kept and max(kept) <= 2**19
