"""Simulated and trace devices that model the CUDA caching allocator: a size fits when the allocator serves every
request within the capacity, as on the card; trials report reserved peaks; the storages' lines predict the
allocator's edge, not the live bytes' one; and a loop written by hand holds at the answer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchfit as bf
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.resolve import from_string
from batchfit.devices.trace import TraceDevice
from batchfit.devices.trace import as_trace_device
from batchfit.errors import InputError
from batchfit.search.fingerprint import device_fields

KIB = 1024
MIB = 2**20


def fragmenting_step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """A step that frees a large block, carves three from its segment and frees the middle one, then asks for
    more than the hole: the allocator must find a new segment where exact counting sees room."""
    rows = batch.shape[0]
    scratch = torch.zeros(rows, 20 * KIB)
    del scratch
    a, b, c = torch.zeros(rows, 5 * KIB), torch.zeros(rows, 10 * KIB), torch.zeros(rows, 5 * KIB)
    del b
    d = torch.zeros(rows, 12 * KIB)
    return model(batch).sum() + (a.sum() + c.sum() + d.sum()) * 0


def search(allocator: str, **options):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    device = bf.SimulatedDevice("64MiB", allocator=allocator)
    result = bf.find_max_batch_size(
        model, torch.randn(4, 8), step_fn=fragmenting_step, optimizer=optimizer, device=device, **options
    )
    return result, model, optimizer, device


def test_fragmentation_lowers_the_answer_and_the_lines_land_on_it():
    exact, *_ = search("exact", trace=False)
    modelled, *_ = search("cuda", trace=False)
    assert [t.batch_size for t in exact.trials] == [2, 3, exact.batch_size, exact.batch_size + 1]
    answer = modelled.batch_size  # the lines' edge, tried, one above, then 4 steps from an emptied cache
    assert [(t.batch_size, t.fits, t.steps) for t in modelled.trials[2:]] == [
        (answer, True, 2),
        (answer + 1, False, 0),
        (answer, True, 4),
    ]
    assert modelled.trials[:2] == [t for t in modelled.trials if t.batch_size in (2, 3)]
    assert modelled.batch_size < 0.7 * exact.batch_size  # a third of the capacity lost to one hole
    fitted = modelled.trials[2]
    assert fitted.peak_bytes < fitted.reserved_peak_bytes <= 64 * MIB
    assert all(t.reserved_peak_bytes is None for t in exact.trials)


def test_the_lines_edge_is_the_largest_size_the_allocator_serves():
    """Against every size near it, tried for real: the answer fits, and nothing from it to 40 above does."""
    modelled, model, optimizer, device = search("cuda", trace=False)
    tried = {
        size: bf.probe_batch_size(
            model, torch.randn(4, 8), size, step_fn=fragmenting_step, optimizer=optimizer, device=device
        ).fits
        for size in range(modelled.batch_size - 3, modelled.batch_size + 40, 3)
    }
    assert all(tried[size] for size in tried if size <= modelled.batch_size)
    assert not any(tried[size] for size in tried if size > modelled.batch_size)


def test_a_failed_request_is_worded_like_cudas_and_the_state_is_restored():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.Adam(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    trial = bf.probe_batch_size(
        model, torch.randn(4, 8), 700, step_fn=fragmenting_step, optimizer=optimizer, device="sim:64MiB:cuda"
    )
    assert not trial.fits and trial.oom and trial.failed_phase == "forward"
    assert "CUDA out of memory" in trial.error and "reserved but unallocated" in trial.error
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)) and not optimizer.state


def test_a_loop_written_by_hand_holds_at_the_answer_and_fails_one_above():
    """Not batchfit's step: a plain loop, five steps, the output kept until the next forward as people write it."""
    result, model, optimizer, _ = search("cuda", trace=False)

    def loop(rows: int, steps: int = 5) -> None:
        device = bf.SimulatedDevice("64MiB", allocator="cuda")
        device.register([*model.parameters(), *model.buffers()])
        out = None
        with device.measuring():
            for _ in range(steps):
                batch = torch.randn(rows, 8)
                optimizer.zero_grad(set_to_none=True)
                out = fragmenting_step(model, batch)
                out.backward()
                optimizer.step()
        del out

    snapshot = bf.StateSnapshot.take(model, optimizer)
    loop(result.batch_size)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        loop(result.batch_size + 1)
    snapshot.restore()


def test_device_strings_and_presets_choose_the_allocator():
    assert from_string("sim:64MiB").allocator_settings is None
    assert from_string("sim:64MiB:cuda").allocator_settings == AllocatorSettings()
    assert from_string("sim:64MiB:cuda-expandable").allocator_settings.expandable_segments
    with pytest.raises(InputError, match="unknown allocator 'cudda'"):
        from_string("sim:64MiB:cudda")
    assert TraceDevice("a100-40gb").allocator_settings == AllocatorSettings()  # a GPU preset: the CUDA allocator
    assert TraceDevice("apple-32gb").allocator_settings is None  # MPS has its own
    assert TraceDevice("40GiB").allocator_settings is None
    assert as_trace_device("trace:a100-40gb:exact").allocator_settings is None
    assert as_trace_device("sim:1GiB:cuda").allocator_settings == AllocatorSettings()
    assert (
        as_trace_device(bf.SimulatedDevice("1GiB", allocator="cuda-expandable")).name == "trace:1.0GiB:cuda-expandable"
    )


def test_the_cache_key_holds_the_allocator():
    keys = {str(device_fields(bf.SimulatedDevice("64MiB", allocator=kind))) for kind in ("exact", "cuda")}
    assert len(keys) == 2


def test_an_estimate_says_when_the_allocator_cannot_serve_what_the_live_bytes_would_fit():
    model = nn.Linear(8, 1)
    estimate = bf.estimate_memory(
        model, torch.randn(4, 8), 700, step_fn=fragmenting_step, device=TraceDevice("64MiB", allocator="cuda")
    )
    assert estimate.peak_bytes < 64 * MIB and estimate.served is False and estimate.fits is False
    assert "cannot serve every request: fragmentation" in estimate.summary()
    exact = bf.estimate_memory(model, torch.randn(4, 8), 700, step_fn=fragmenting_step, device="64MiB")
    assert exact.fits is True and exact.peak_bytes == estimate.peak_bytes


def test_a_confirmation_that_fails_goes_down_until_a_size_holds_for_its_steps():
    """A loop whose memory grows with every step (a buffer more per step, dropped when a trial puts the
    model back): two steps fit where four do not. The confirmation gallops down from the answer, then
    bisects, to the largest size that holds four steps, the answer then; every size tried is a trial."""

    def growing_step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        model.register_buffer(f"kept_{len(model._buffers)}", torch.zeros(batch.shape[0], 2 * KIB))
        return model(batch).sum()

    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    common = dict(step_fn=growing_step, optimizer=optimizer, device="sim:8MiB")
    two_steps = bf.find_max_batch_size(model, torch.randn(4, 8), trace=False, confirm_steps=0, **common)
    confirmed = bf.find_max_batch_size(model, torch.randn(4, 8), trace=False, confirm_steps=4, **common)
    edge = two_steps.batch_size
    assert (
        [t.batch_size for t in confirmed.trials[:4]]
        == [t.batch_size for t in two_steps.trials]
        == [
            2,
            3,
            edge,
            edge + 1,
        ]
    )
    confirmations = confirmed.trials[4:]
    assert confirmations[0].batch_size == edge and not confirmations[0].fits
    sizes = range(confirmed.batch_size - 2, edge + 1)
    truth = max(s for s in sizes if bf.probe_batch_size(model, torch.randn(4, 8), s, steps=4, **common).fits)
    assert confirmed.batch_size == truth < edge and confirmed.exact
    assert confirmed.extra["confirmed"] == {"steps": 4, "batch_size": truth, "from": edge}
    assert all(t.steps == 4 for t in confirmations if t.fits)
    assert len(confirmations) <= 2 * (edge - truth).bit_length() + 1  # galloping down, then bisection
