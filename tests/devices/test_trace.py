"""The trace device and memory estimation: against the simulated device, a published formula,
the GPU presets, and the cases fake tensors cannot handle."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.devices.accounting import LiveBytes
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.devices.cuda_kernels import CudaTarget
from batchfit.devices.presets import ACCELERATORS
from batchfit.devices.presets import CUDA_RESERVE_BYTES
from batchfit.devices.presets import preset
from batchfit.devices.presets import usable_bytes
from batchfit.devices.trace import TraceDevice
from batchfit.devices.units import format_bytes
from batchfit.errors import TraceError
from batchfit.search.estimate import analytic_estimate
from batchfit.search.estimate import estimate_memory
from batchfit.search.estimate import estimate_workload
from batchfit.search.memory_model import StorageLines
from batchfit.search.memory_model import StorageRecord
from batchfit.search.runner import trace_estimate
from batchfit.step.builtin_workloads import cnn_small
from batchfit.step.builtin_workloads import gpt_tiny
from batchfit.step.builtin_workloads import mlp
from models import CASES
from models import Case
from models import cnn_bn
from models import mlp_tuple
from state_checks import assert_same
from state_checks import fingerprint
from state_checks import train_a_little

BUILDS = [gpt_tiny, cnn_small, mlp, *[case.build for case in CASES]]


def _measured_peak(build, batch_size: int) -> int:
    work = build()
    device = bf.SimulatedDevice("1GiB")
    return bf.probe_batch_size(
        work.model, work.sample_batch, batch_size, loss_fn=work.loss_fn, optimizer=work.optimizer, device=device
    ).peak_bytes


@pytest.mark.parametrize("build", BUILDS, ids=lambda build: build.__name__)
def test_trace_peak_matches_the_simulated_peak_within_one_percent(build):
    for batch_size in (1, 8, 32):
        traced = estimate_workload(build(), batch_size, analytic=False).peak_bytes
        assert math.isclose(traced, _measured_peak(build, batch_size), rel_tol=0.01)


def test_the_breakdown_sums_to_the_peak_and_names_each_part():
    work = gpt_tiny()
    estimate = estimate_workload(work, 4)
    assert sum(estimate.breakdown.values()) == estimate.peak_bytes
    params = list(work.model.parameters())
    rounded = lambda t: -(-t.numel() * t.element_size() // 512) * 512  # noqa: E731
    assert estimate.breakdown["parameters"] == sum(rounded(t) for t in [*params, *work.model.buffers()])
    # AdamW: two moments per parameter plus a 512-byte block for each `step` scalar
    assert estimate.breakdown["optimizer_state"] == 2 * sum(rounded(p) for p in params) + 512 * len(params)
    assert estimate.breakdown["activations"] > estimate.breakdown["temporaries"] > 0
    assert estimate.peak_phase == "backward"


def test_at_small_batches_an_adam_step_peaks_in_the_optimizer():
    dropped = estimate_workload(dataclasses.replace(mlp(), keep_output=False), 4)
    assert dropped.peak_phase == "optimizer"
    assert dropped.breakdown["gradients"] > 0 and dropped.breakdown["activations"] == 0
    held = estimate_workload(mlp(), 4)  # a hand-written loop's output lives through the optimizer step
    assert held.peak_phase == "optimizer"
    assert held.breakdown["activations"] == held.peak_bytes - dropped.peak_bytes > 0


def byte_mask_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout keeping a 1-byte mask, as fused GPU dropout does and the formula assumes (PyTorch's
    CPU dropout keeps its mask in the input's dtype: 2 bytes in bf16)."""
    keep = torch.rand_like(x) >= p  # bool: the only tensor saved for backward
    return x * keep / (1 - p)


class MegatronBlock(nn.Module):
    """A GPT layer as Korthikanti et al. 2022 count it: pre-LN, explicit softmax attention with
    dropout on the scores, a 4h GeLU MLP, dropout after both projections."""

    def __init__(self, hidden: int, heads: int, p: float = 0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return x.view(b, s, self.heads, h // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        q, k, v = self.split(self.q(y)), self.split(self.k(y)), self.split(self.v(y))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        attention = byte_mask_dropout(torch.softmax(scores, dim=-1), self.p)
        context = torch.matmul(attention, v).transpose(1, 2).reshape(x.shape)
        x = x + byte_mask_dropout(self.proj(context), self.p)
        return x + byte_mask_dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p)


def test_a_megatron_block_matches_korthikanti_et_al_2022():
    s, b, h, a = 128, 4, 256, 8
    block = MegatronBlock(h, a).to(torch.bfloat16)
    batch = torch.randn(b, s, h, dtype=torch.bfloat16)
    work = bf.Workload(block, batch, loss_fn=lambda out, batch: out.float().sum(), mode="train")
    estimate = estimate_workload(work, b, analytic=False)
    # Saved for backward in 16-bit, per layer, no recomputation: s·b·h·(34 + 5·a·s/h) bytes.
    # The formula counts the layer's input (2·sbh, saved by the first LayerNorm); here that
    # input is the batch, so the breakdown files it under "batch".
    formula = s * b * h * (34 + 5 * a * s / h)
    layer_input = 2 * s * b * h
    assert estimate.breakdown["activations"] + layer_input == pytest.approx(formula, rel=0.05)


def test_analytic_estimate_corrects_the_textbook_formula():
    work = mlp_tuple()  # Adam on fp32 parameters
    params = sum(p.numel() * p.element_size() for p in work.model.parameters())
    analytic = analytic_estimate(work, 16)
    assert analytic.parameters == analytic.gradients == params
    assert analytic.optimizer_state == 2 * params  # Adam: two fp32 moments
    sgd = analytic_estimate(cnn_bn(), 16)  # SGD with momentum: one buffer, not none
    assert sgd.optimizer_state == sum(p.numel() * 4 for p in cnn_bn().model.parameters())
    # activations: every leaf module's output per sample, times the batch
    assert analytic.activations == 16 * 4 * (64 + 64 + 64 + 64 + 10)


def test_analytic_master_weights_add_an_fp32_copy_for_16_bit_parameters():
    work = mlp_tuple()
    work.model.to(torch.bfloat16)
    numel = sum(p.numel() for p in work.model.parameters())
    plain = analytic_estimate(work, 4)
    assert plain.parameters == plain.gradients == 2 * numel and plain.optimizer_state == 2 * 2 * numel
    assert analytic_estimate(work, 4, master_weights=True).optimizer_state == 2 * 2 * numel + 4 * numel


def test_analytic_checkpointing_keeps_block_inputs_not_one_layer():
    work = gpt_tiny()
    full = analytic_estimate(work, 8).activations
    checkpointed = analytic_estimate(work, 8, checkpointing=True).activations
    hidden = 8 * 64 * 128 * 4  # one block input: batch x seq x dim in fp32
    blocks = 2
    # everything outside the blocks, the two block inputs, and one block's own outputs
    one_block = (full - checkpointed + blocks * hidden) / (blocks - 1)
    assert checkpointed < full and one_block > 0
    assert checkpointed >= blocks * hidden


def test_the_trace_never_touches_the_users_model_or_optimizer():
    work = mlp_tuple()
    train_a_little(work)
    before = fingerprint(work)
    estimate_workload(work, 64)
    bf.search_workload(work, device=TraceDevice("1MiB"))
    assert_same(before, fingerprint(work))


def test_searching_on_the_trace_finds_the_simulated_edge():
    for case in CASES:
        traced = bf.search_workload(case.build(), device=TraceDevice(case.capacity))
        simulated = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), trace=False)
        assert traced.batch_size == simulated.batch_size


def _traced(build, capacity, space=(1, None)) -> dict:
    device = bf.SimulatedDevice(capacity)
    return trace_estimate(build(), device, device.capacity_bytes(), space, 2)


def _fake_search(build, capacity, space=(1, None)) -> bf.SearchResult:
    return bf.search_workload(
        build(), device=TraceDevice(capacity), trace=False, min_batch_size=space[0], max_batch_size=space[1]
    )


@pytest.mark.parametrize("case", [*CASES, Case(gpt_tiny, "40MiB")], ids=lambda case: case.name)
def test_the_trace_finds_the_fake_searchs_edge_from_the_lines_of_two_fake_trials(case):
    full = _fake_search(case.build, case.capacity)
    traced = _traced(case.build, case.capacity)
    assert traced["batch_size"] == full.batch_size and traced["method"] == "lines"
    assert traced["trials"] == 2 < len(full.trials)


def test_the_traces_lines_keep_to_the_sizes_allowed_and_say_when_nothing_fits():
    case = CASES[0]
    for space in [(3, None), (1, 20), (40, 60)]:
        traced = _traced(case.build, case.capacity, space)
        assert traced["batch_size"] == _fake_search(case.build, case.capacity, space).batch_size
        assert traced["trials"] <= 2
    assert _traced(case.build, "40KiB")["batch_size"] is None


def contrastive_loss(out: torch.Tensor, batch) -> torch.Tensor:
    features = F.normalize(out, dim=1)
    logits = features @ features.T  # B x B: quadratic in the batch size, not a line
    return F.cross_entropy(logits, torch.arange(len(logits)))


def contrastive() -> bf.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return bf.Workload(model, torch.randn(4, 16), contrastive_loss, torch.optim.Adam(model.parameters()))


def test_sizes_that_are_not_lines_in_the_batch_size_hand_the_trace_to_the_search():
    traced = _traced(contrastive, "256KiB")
    assert traced["method"] == "search"
    assert traced["batch_size"] == _fake_search(contrastive, "256KiB").batch_size > 3


def test_storage_lines_need_the_same_ops_and_reproduce_both_trials():
    def record(batch_size, born, nbytes, timeline):
        freed = np.full(2, len(timeline))  # both outlive the trial
        return StorageRecord(batch_size, np.array(born), freed, np.array(nbytes), np.array(timeline), max(timeline))

    rounded = lambda sizes: -(-sizes // 512) * 512  # noqa: E731
    low = record(2, [0, 1], [100, 8], [512, 1024])
    assert StorageLines.fit(low, record(3, [0, 2], [150, 8], [512, 512, 1024]), rounded) is None  # other ops
    assert StorageLines.fit(low, record(3, [0, 1], [150, 8], [512, 1536]), rounded) is None  # misses its timeline
    assert StorageLines.fit(low, record(3, [0, 1], [150, 8], [512, 1024]), rounded).proportional


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y[y > 0].sum() + y.sum()  # the output's shape depends on the data


def test_data_dependent_shapes_fall_back_to_probing_with_one_warning(caplog):
    model = DataDependent()
    batch = torch.randn(4, 8)
    with caplog.at_level("WARNING", logger="batchfit"):
        result = bf.find_max_batch_size(model, batch, loss_fn=lambda out, batch: out, device="sim:64KiB", trace=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert (
        len(warnings) == 1
        and "could not trace the workload" in warnings[0]
        and "probing without an estimate" in warnings[0]
    )
    assert result.batch_size > 1 and result.trials[0].batch_size == 2  # real probing, lines from 2 and 3
    with pytest.raises(TraceError, match="cannot trace this workload on fake tensors .*batchfit find"):
        bf.estimate_memory(model, batch, 8, loss_fn=lambda out, batch: out)


@torch.library.custom_op("batchfit_tests::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:  # a custom op with no fake kernel
    return x.clone()


opaque.register_autograd(lambda ctx, grad: grad)  # it trains; it just cannot be traced


def test_an_op_without_a_fake_kernel_falls_back_too(caplog):
    model = nn.Linear(8, 8)
    batch = torch.randn(4, 8)
    loss = lambda out, batch: opaque(out).sum()  # noqa: E731
    with caplog.at_level("WARNING", logger="batchfit"):
        result = bf.find_max_batch_size(model, batch, loss_fn=loss, device="sim:64KiB", trace=True)
    assert "could not trace the workload" in caplog.text and result.exact
    with pytest.raises(TraceError, match="cannot trace"):
        bf.estimate_memory(model, batch, 8, loss_fn=loss)


def test_presets_subtract_the_cuda_context_reserve():
    names = {
        "t4-16gb",
        "v100-16gb",
        "v100-32gb",
        "rtx3060-12gb",
        "rtx3090-24gb",
        "rtx4090-24gb",
        "l4-24gb",
        "a10-24gb",
        "l40s-48gb",
        "a100-40gb",
        "a100-80gb",
        "h100-80gb",
        "h200-141gb",
        "mi300x-192gb",
    }
    assert names <= set(ACCELERATORS) and any(name.startswith("apple-") for name in ACCELERATORS)
    # the driver's totals, never the nominal capacity: measured on the H100 and the H200 (shared/notes/real-gpu.md)
    assert preset("h100-80gb").memory_bytes == 85_017_493_504 < 80 * 2**30
    assert preset("h200-141gb").memory_bytes == 150_109_880_320 < 141 * 2**30
    assert preset("h100-80gb").usable_bytes == 84_393_787_392  # free + reserved after start-up, as measured
    assert preset("h200-141gb").usable_bytes == 149_555_380_224
    assert preset("A100-40GB").usable_bytes == 40320 * 2**20 - CUDA_RESERVE_BYTES
    assert usable_bytes("a100-40gb", reserve_bytes=0) == 40320 * 2**20
    assert TraceDevice("h100-80gb").capacity_bytes() == preset("h100-80gb").usable_bytes
    assert TraceDevice("h100-80gb", reserve_bytes=2**30).capacity_bytes() == 85_017_493_504 - 2**30
    cuda = [accelerator for name, accelerator in ACCELERATORS.items() if not name.startswith("apple")]
    assert all(a.source and a.memory_bytes < int(a.name.split("-")[-1][:-2]) * 2**30 for a in cuda)
    with pytest.raises(ValueError, match="unknown GPU 'a200'.*a100-40gb"):
        preset("a200")


def test_a_counter_with_a_caching_allocator_reserves_its_segments():
    mib = 2**20
    counter = LiveBytes(rounding_bytes=512, limit_bytes=64 * mib, allocator=CachingAllocator(64 * mib))
    with counter.mode():
        small, large = torch.empty(1000, dtype=torch.uint8), torch.empty(3 * mib, dtype=torch.uint8)
        assert counter.live_bytes == 1024 + 3 * mib
        assert counter.reserved_bytes == 2 * mib + 20 * mib  # a small segment, a 20 MiB large one
        del small, large
    assert counter.live_bytes == 0 and counter.reserved_bytes == 22 * mib  # cached
    counter.empty_cache()
    assert counter.reserved_bytes == 0 and counter.peak_reserved_bytes == 22 * mib


def _linear_and_batch():
    model = nn.Linear(64, 64)
    return model, (torch.randn(4, 64), torch.randn(4, 64)), torch.optim.Adam(model.parameters())


A100_BYTES = usable_bytes("a100-40gb")


@pytest.mark.parametrize(
    ("device", "gpu"),
    [
        (TraceDevice("a100-40gb"), True),
        ("a100-40gb", True),
        ("trace:a100-40gb", True),
        ("sim:" + str(A100_BYTES), False),
        (bf.SimulatedDevice(A100_BYTES), False),
        (A100_BYTES, False),
        (f"{A100_BYTES}B", False),
    ],
    ids=["TraceDevice", "preset", "trace:", "sim:", "SimulatedDevice", "bytes", "size"],
)
def test_estimate_memory_takes_every_form_of_device(device, gpu):
    """A preset traces what its GPU (an A100: sm80) runs; a capacity alone traces the CPU's step."""
    model, batch, optimizer = _linear_and_batch()
    estimate = bf.estimate_memory(model, batch, 32, loss_fn=F.mse_loss, optimizer=optimizer, device=device)
    as_gpu = TraceDevice(A100_BYTES, target=CudaTarget(sm=(8, 0)), allocator="cuda")
    reference = bf.estimate_memory(
        model, batch, 32, loss_fn=F.mse_loss, optimizer=optimizer, device=as_gpu if gpu else None
    )
    assert estimate.capacity_bytes == A100_BYTES and estimate.fits is True
    assert estimate.peak_bytes == reference.peak_bytes and estimate.breakdown == reference.breakdown


def test_estimate_memory_measures_past_the_capacity_and_leaves_the_device_alone():
    model, batch, optimizer = _linear_and_batch()
    device = TraceDevice("64KiB")
    estimate = bf.estimate_memory(model, batch, 512, loss_fn=F.mse_loss, optimizer=optimizer, device=device)
    assert estimate.fits is False and estimate.peak_bytes > 64 * 2**10 == estimate.capacity_bytes
    assert device.peak_bytes() == 0 and device.counter.ledger is None  # traced on a fresh device


def test_estimate_memory_keeps_the_trace_devices_allocator():
    model, batch, optimizer = _linear_and_batch()
    plain, modelled, old_name = (
        bf.estimate_memory(model, batch, 5000, loss_fn=F.mse_loss, optimizer=optimizer, device=device)
        for device in (TraceDevice("1GiB"), TraceDevice("1GiB", allocator="cuda"), TraceDevice("1GiB", reserved=True))
    )
    assert (plain.allocator, plain.reserved_peak_bytes, plain.served) == ("exact", None, None)
    assert modelled.allocator == "cuda" and modelled.served is True and modelled.fits is True
    assert modelled.peak_bytes == plain.peak_bytes < modelled.reserved_peak_bytes  # whole segments reserved
    assert old_name.to_dict() == modelled.to_dict()


def test_estimate_memory_capacity_is_deprecated_for_device():
    model, batch, optimizer = _linear_and_batch()
    with pytest.warns(DeprecationWarning, match=r"capacity=.*deprecated: pass device="):
        old = bf.estimate_memory(model, batch, 8, loss_fn=F.mse_loss, optimizer=optimizer, capacity="a100-40gb")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = bf.estimate_memory(model, batch, 8, loss_fn=F.mse_loss, optimizer=optimizer, device="a100-40gb")
    assert old == new
    with pytest.raises(TypeError, match="device= or the deprecated capacity=, not both"):
        bf.estimate_memory(model, batch, 8, loss_fn=F.mse_loss, device="a100-40gb", capacity="40GiB")


def test_estimate_memory_keywords_follow_find_max_batch_size():
    def keywords(function):
        return [p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY]

    estimate = keywords(estimate_memory)
    assert estimate[:5] == ["loss_fn", "optimizer", "amp_dtype", "device", "steps"]
    assert estimate[5:7] == ["mode", "step_fn"]
    shared = [name for name in keywords(bf.find_max_batch_size) if name in estimate]
    assert shared == [name for name in estimate if name in shared]


def test_summaries_name_the_peak_and_the_largest_part_and_dicts_are_json():
    work = gpt_tiny()
    estimate = estimate_workload(work, 4, device="a100-40gb")
    largest = max(estimate.breakdown, key=estimate.breakdown.get).replace("_", " ")
    sentence = estimate.summary()
    assert sentence.startswith("At batch size 4 the peak is ") and f"the largest part {largest} (" in sentence
    assert sentence.endswith(f"; it fits in {format_bytes(A100_BYTES)}.") and ". " not in sentence  # one sentence
    analytic = estimate.analytic
    assert analytic.summary().startswith("The analytic estimate is ") and "the largest part " in analytic.summary()
    document = json.loads(json.dumps(estimate.to_dict()))
    assert document["peak_bytes"] == estimate.peak_bytes and document["analytic"] == analytic.to_dict()
    assert json.loads(json.dumps(analytic.to_dict()))["peak_bytes"] == analytic.peak_bytes


class Plain(torch.optim.SGD):
    """An SGD by another name: its state is SGD's (none without momentum)."""


def test_the_analytic_optimizer_state_follows_the_class_not_its_name():
    work = mlp_tuple()
    work = bf.Workload(work.model, work.sample_batch, work.loss_fn, Plain(work.model.parameters(), lr=0.1))
    assert analytic_estimate(work, 4).optimizer_state == 0
