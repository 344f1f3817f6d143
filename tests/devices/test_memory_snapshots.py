"""batchfit's runs as PyTorch memory snapshots, and snapshots replayed through the caching allocator model.

A trial on a device that models the CUDA caching allocator is written in torch's format
(``batchfit.devices.memory_snapshots``); torch's own viewer reads it (``torch.cuda._memory_viz``); read back
(``batchfit.devices.snapshot_state``) and replayed (``batchfit.devices.snapshot_replay``), every event the model
makes is the event the snapshot holds: the same action, address and size, the same reserved bytes after it, the
same request out of memory. The cases fragment: five linear layers on a 3.1 MiB device, where the loop runs out
of memory with room free in pieces (``tests/support/user_loops.py``), and an MLP traced for an H100 at the edge of
its memory, where large segments are allocated, released and retried.
"""

from __future__ import annotations

import pickle
import pickletools

import pytest
import torch
from torch import nn

import batchfit as bf
from batchfit.cli.snapshot_trials import snapshot_trial
from batchfit.devices.allocator_events import RecordingAllocator
from batchfit.devices.allocator_settings import MIB
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.memory_snapshots import dump_memory_snapshot
from batchfit.devices.memory_snapshots import memory_snapshot
from batchfit.devices.memory_snapshots import recording_cuda_history
from batchfit.devices.memory_snapshots import settings_entry
from batchfit.devices.memory_snapshots import snapshot_of
from batchfit.devices.snapshot_files import load_snapshot
from batchfit.devices.snapshot_files import snapshot_settings
from batchfit.devices.snapshot_replay import batch_requests
from batchfit.devices.snapshot_replay import largest_batch
from batchfit.devices.snapshot_replay import replay_requests
from batchfit.devices.snapshot_replay import replay_snapshot
from batchfit.devices.snapshot_state import read_snapshot
from batchfit.errors import InputError
from user_loops import FiveLinears
from user_loops import loss_fn

# The opcodes MemoryViz.js's unpickler reads (torch/utils/viz/MemoryViz.js, ``unpickle``): a file with any other
# does not open in pytorch.org/memory_viz.
VIEWER_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET", "BININT", "BININT1",
    "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET", "MARK", "MEMOIZE", "BINPUT",
    "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE", "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1",
    "TUPLE2", "TUPLE3", "BINFLOAT",
}  # fmt: skip


def five_linears(rows: int, allocator: str = "cuda") -> dict:
    case = FiveLinears()
    model, sample, optimizer = case.build()
    device = bf.SimulatedDevice(case.capacity_bytes(), allocator=allocator)
    return snapshot_trial(bf.Workload(model, sample, loss_fn, optimizer), rows, device)


def wide_mlp() -> bf.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 8192), nn.GELU(), nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 1000))
    sample = (torch.randn(8, 1024), torch.randint(0, 1000, (8,)))
    return bf.Workload(model, sample, loss_fn, torch.optim.AdamW(model.parameters()))


_EDGES: dict[str, int] = {}


def h100_edge(allocator: str) -> int:
    """The largest batch of ``wide_mlp`` a trace for an H100 fits, under ``allocator``."""
    if allocator not in _EDGES:
        work = wide_mlp()
        device = bf.TraceDevice("h100-80gb", allocator=allocator)
        found = bf.find_max_batch_size(
            work.model, work.sample_batch, loss_fn=loss_fn, optimizer=work.optimizer, device=device, cache=False
        )
        _EDGES[allocator] = found.batch_size
    return _EDGES[allocator]


def h100_trace(rows: int, allocator: str = "cuda") -> dict:
    return snapshot_trial(wide_mlp(), rows, bf.TraceDevice("h100-80gb", allocator=allocator))


def round_trip(snapshot: dict) -> dict:
    return pickle.loads(pickle.dumps(snapshot, protocol=4))


def card_events(snapshot: dict) -> list[tuple]:
    """The snapshot's trace as the model must reproduce it: (action, address, size, reserved bytes after), each
    free once (``free_completed``), the reserved bytes walked from the segments at the end back to the start."""
    trace = snapshot["device_traces"][0]
    delta = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    reserved = sum(s["total_size"] for s in snapshot["segments"]) - sum(
        delta.get(e["action"], 0) * e["size"] for e in trace
    )
    events = []
    for entry in trace:
        reserved += delta.get(entry["action"], 0) * entry["size"]
        if entry["action"] != "free_requested":
            events.append((entry["action"], entry.get("addr", 0), entry["size"], reserved))
    return events


def model_events(replay) -> list[tuple]:
    """What the model did in the replay, as ``card_events`` reads the card (addresses are the card's)."""
    return [(e.action, 0 if e.action == "oom" else e.addr, e.size, e.reserved_bytes) for e in replay.model_events]


def assert_replays_event_by_event(snapshot: dict) -> None:
    """Read back and replayed, the model makes exactly the snapshot's events, in order: every request and free,
    every segment allocated, freed, mapped or unmapped at the same place with the same size, the reserved bytes
    equal after each, and the same request out of memory."""
    snap = read_snapshot(round_trip(snapshot))
    replay = replay_snapshot(snap)
    assert replay.matched, replay.first_mismatch
    assert replay.mismatches == 0 and not replay.empty_caches
    expected = card_events(snapshot)
    assert replay.compared == len(expected)
    assert model_events(replay) == expected
    ooms = [e.index for e in snap.events if e.action == "oom"]
    assert list(replay.card_ooms) == list(replay.model_ooms) == ooms


# -- writing ------------------------------------------------------------------------------------------------------


def test_a_trial_is_written_in_torchs_format_without_stack_frames():
    snapshot = five_linears(222)
    assert {"segments", "device_traces", "allocator_settings"} <= snapshot.keys()
    segment = snapshot["segments"][0]
    assert {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
            "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"} <= segment.keys()  # fmt: skip
    assert segment["segment_type"] == "small" and segment["total_size"] == 2 * MIB
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
    assert {b["state"] for b in segment["blocks"]} <= {"active_allocated", "inactive"}
    trace = snapshot["device_traces"][0]
    assert {e["action"] for e in trace} == {"alloc", "free_requested", "free_completed", "oom"}
    assert all(e["frames"] == [] for e in trace) and all(b["frames"] == [] for b in segment["blocks"])
    oom = trace[-1]
    assert oom["action"] == "oom" and "addr" not in oom and oom["device_free"] == 3_296_634 - 2 * MIB
    frees = [i for i, e in enumerate(trace) if e["action"] == "free_completed"]
    assert all(trace[i - 1]["action"] == "free_requested" and trace[i - 1]["addr"] == trace[i]["addr"] for i in frees)
    assert snapshot["batchfit"]["failed_step"] == 8  # the loop runs out of memory at step 8 (user_loops.FiveLinears)
    assert snapshot["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == ""


def test_the_file_is_small_and_opens_in_torchs_viewer(tmp_path):
    """The pickle uses only the opcodes MemoryViz.js reads, and torch's _memory_viz draws it: the segment and
    trace plots (HTML), the summary of segments (which checks every segment's blocks add up), the trace text."""
    from torch.cuda import _memory_viz

    for snapshot in (five_linears(222), five_linears(200, "cuda-expandable"), h100_trace(4096, "cuda-expandable")):
        data = pickle.dumps(snapshot, protocol=4)
        assert {op.name for op, _, _ in pickletools.genops(data)} <= VIEWER_OPCODES
        assert len(data) < 200 * len(snapshot["device_traces"][0]) + 100_000
        for plot in (_memory_viz.segment_plot, _memory_viz.trace_plot):
            html = plot(round_trip(snapshot))
            assert html.startswith("\n<!DOCTYPE html>") and "snapshot.pickle" in html
        assert "total_reserved" in _memory_viz.segsum(snapshot)
        assert "TOTAL MEM" in _memory_viz.trace(snapshot)


def test_the_viewer_walks_the_trace_back_to_a_consistent_state():
    """MemoryViz.js draws the allocator at any event by walking the trace back from the segments at its end
    (``simulate_memory``): every segment a reverse step removes must be there, and every block lie in a segment."""
    for snapshot in (five_linears(222), h100_trace(h100_edge("cuda") + 1), h100_trace(2048, "cuda-expandable")):
        segments = {s["address"]: s["total_size"] for s in snapshot["segments"]}
        blocks = {b["address"]: b["size"] for s in snapshot["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated"}  # fmt: skip

        def inside(addr: int, segments: dict[int, int] = segments) -> bool:
            return any(a <= addr < a + size for a, size in segments.items())

        for event in reversed(snapshot["device_traces"][0]):
            action, addr = event["action"], event.get("addr")
            if action == "alloc":
                assert blocks.pop(addr, None) is not None
            elif action == "free_completed":
                blocks[addr] = event["size"]
                assert inside(addr)
            elif action == "segment_alloc":
                assert segments.pop(addr) == event["size"] and not any(addr <= b < addr + event["size"] for b in blocks)
            elif action == "segment_free":
                segments[addr] = event["size"]
            elif action == "segment_map":  # a mapped range leaves the run of pages it lies in
                start = next(a for a, size in segments.items() if a <= addr and addr + event["size"] <= a + size)
                end = start + segments.pop(start)
                for a, b in ((start, addr), (addr + event["size"], end)):
                    if b > a:
                        segments[a] = b - a
            elif action == "segment_unmap":  # the range joins the runs of pages around it
                begin, end = addr, addr + event["size"]
                before = next((a for a, size in segments.items() if a + size == begin), None)
                if before is not None:
                    begin = before
                    del segments[before]
                if end in segments:
                    end += segments.pop(end)
                segments[begin] = end - begin
        assert all(inside(addr) for addr in blocks)


def test_settings_are_written_as_torch_writes_them_and_read_back():
    for settings in (
        AllocatorSettings(),
        AllocatorSettings(expandable_segments=True),
        AllocatorSettings.parse("max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4]"),
        AllocatorSettings.parse("garbage_collection_threshold:0.6,per_process_memory_fraction:0.9"),
    ):
        entry = settings_entry(settings)
        assert snapshot_settings({"allocator_settings": entry})[0] == settings
        if settings.max_split_size_bytes is None:
            assert entry["max_split_size"] == -1  # torch's SIZE_MAX, written as an int64
        assert list(entry["roundup_power2_divisions"])[:3] == ["1", "2", "4"]
    # torch's values win over its string (the string is the last one given; the values what the allocator runs)
    entry = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": False}
    assert snapshot_settings({"allocator_settings": entry})[0] == AllocatorSettings()
    assert snapshot_settings({})[0] == AllocatorSettings()  # a snapshot from before torch 2.4: the defaults


def test_a_device_without_the_allocator_model_has_no_snapshot():
    with pytest.raises(InputError, match="sim:CAPACITY:cuda"):
        memory_snapshot(bf.SimulatedDevice("8MiB"))
    with pytest.raises(InputError, match="no trial"):
        memory_snapshot(bf.SimulatedDevice("8MiB", allocator="cuda"))


def test_a_cuda_trial_records_torchs_own_history_without_frames(monkeypatch):
    calls = []
    memory = torch.cuda.memory
    monkeypatch.setattr(memory, "_record_memory_history", lambda enabled="all", **kw: calls.append((enabled, kw)))
    monkeypatch.setattr(memory, "_snapshot", lambda: {"segments": [], "device_traces": [[]]})
    with recording_cuda_history() as take:
        assert take() == {"segments": [], "device_traces": [[]]}
    assert calls[0][0] == "all" and calls[0][1]["context"] is None and calls[-1][0] is None


# -- the round trip ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("allocator", ["cuda", "cuda-expandable"])
@pytest.mark.parametrize("rows", [200, 222, 242])
def test_five_linears_on_3_mib_replays_event_by_event(rows, allocator):
    """200 rows run 2 steps and settle; 222 run on in the model and run out of memory at step 8; 242 run out of
    memory in the trial's second step: each snapshot, replayed, is the model's run event for event."""
    assert_replays_event_by_event(five_linears(rows, allocator))


@pytest.mark.parametrize("allocator", ["cuda", "cuda-expandable"])
def test_an_h100_trace_at_the_edge_replays_event_by_event(allocator):
    """Large-pool segments of an MLP traced for an H100: at the edge the allocator frees its cache and retries
    (segment_free, or segment_unmap with expandable segments) and one above it runs out of memory."""
    edge = h100_edge(allocator)
    below, above = h100_trace(edge // 2, allocator), h100_trace(edge + 1, allocator)
    for snapshot in (below, above):
        assert_replays_event_by_event(snapshot)
    actions = {e["action"] for e in above["device_traces"][0]}
    if allocator == "cuda":
        assert {"segment_alloc", "segment_free", "oom"} <= actions
        assert all(s["segment_type"] == "large" for s in above["segments"] if s["total_size"] > 2 * MIB)
    else:
        assert {"segment_map", "segment_unmap", "oom"} <= actions
        assert all(s["is_expandable"] for s in above["segments"])


def test_a_trace_recorded_midway_starts_from_the_state_it_walks_back_to():
    """Recording begins with blocks held and segments cached, some freed during the trace (a 19.5 MiB block held
    whole in its 20 MiB segment, known to the trace only by its request), and the trace empties the cache."""
    allocator = RecordingAllocator(200 * MIB)
    whole = allocator.malloc(int(19.5 * MIB))  # a 20 MiB segment; the 0.5 MiB left is not split off
    small = [allocator.malloc(4096) for _ in range(3)]
    cached = allocator.malloc(30 * MIB)
    allocator.free(cached)
    recorder = RecordingAllocator.of(allocator)
    blocks = {id(b): b for b in recorder.active}
    held = sorted(blocks.values(), key=lambda b: b.ptr)
    recorder.requested[id(held[0])] = int(19.5 * MIB)  # the request the card knew it by
    recorder.free(held[0])
    again = recorder.malloc(20 * MIB)  # lands in the freed segment, whole
    recorder.free(held[1])
    recorder.empty_cache()  # the cached 30 MiB segment goes back (no request needed it to)
    big = recorder.malloc(60 * MIB)
    recorder.malloc(150 * MIB)  # out of memory: 20 + 2 + 60 reserved of 200, nothing cached whole
    snapshot = snapshot_of(recorder, {"capacity_bytes": 200 * MIB})
    assert again is not None and big is not None and whole is not None and small
    snap = read_snapshot(round_trip(snapshot))
    replay = replay_snapshot(snap)
    assert replay.matched, replay.first_mismatch
    assert model_events(replay) == card_events(snapshot)
    assert len(replay.empty_caches) == 1 and replay.card_ooms


def test_a_replay_with_other_settings_differs_at_the_first_event_that_does():
    snapshot = h100_trace(h100_edge("cuda") + 1)
    snap = read_snapshot(round_trip(snapshot), settings=AllocatorSettings(expandable_segments=True))
    replay = replay_snapshot(snap)
    first = replay.first_mismatch
    assert not replay.matched and first is not None
    assert first.index == next(i for i, e in enumerate(snapshot["device_traces"][0]) if e["action"] == "segment_alloc")
    assert "segment_alloc" in first.card and "segment_map" in first.model


def test_the_capacity_is_read_from_the_first_oom_where_batchfit_left_no_note():
    snapshot = round_trip(five_linears(222))
    del snapshot["batchfit"]
    snap = read_snapshot(snapshot)
    assert snap.capacity_bytes == 3_296_634 and "oom" in snap.capacity_source
    assert replay_snapshot(snap).matched
    snapshot["device_traces"][0] = [e for e in snapshot["device_traces"][0] if e["action"] != "oom"]
    assert read_snapshot(snapshot).capacity_bytes is None


# -- what the replay says ------------------------------------------------------------------------------------------


def test_expandable_segments_would_have_served_the_request_that_failed():
    """One above the edge under the default settings, the request that runs out of memory (with memory reserved
    in pieces) is served with expandable segments; replayed with the snapshot's own settings, it fails again."""
    snap = read_snapshot(round_trip(h100_trace(h100_edge("cuda") + 1)))
    replay = replay_snapshot(snap)
    failed = replay.card_ooms[0]
    assert replay.fragmentation_bytes > 0 and replay.oom_bytes is not None
    assert replay_requests(snap, AllocatorSettings(expandable_segments=True)).serves(failed)
    assert not replay_requests(snap).serves(failed)


def test_the_largest_batch_scales_what_the_trace_made_and_freed():
    snapshot = h100_trace(h100_edge("cuda") // 2)
    snap = read_snapshot(round_trip(snapshot))
    scaled = batch_requests(snap)
    trace = snapshot["device_traces"][0]
    assert scaled and all(trace[i]["action"] in ("alloc", "oom") for i in scaled)
    kept = [i for i, e in enumerate(trace) if e["action"] == "alloc" and i not in scaled]
    assert kept  # gradients and AdamW's state, made in the first step and held to the end
    found = largest_batch(snap, h100_edge("cuda") // 2)
    assert h100_edge("cuda") // 2 < found.batch_size < 2 * h100_edge("cuda")


# -- reading -------------------------------------------------------------------------------------------------------


def test_a_file_that_is_not_a_snapshot_is_refused_in_one_line(tmp_path):
    cases = {
        "text.pickle": b"not a pickle at all\n",
        "list.pickle": pickle.dumps([1, 2, 3]),
        "dict.pickle": pickle.dumps({"segments": []}),
        "class.pickle": pickle.dumps(AllocatorSettings()),  # names a class: refused before anything runs
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(InputError, match="is not a memory snapshot") as error:
            load_snapshot(path)
        assert "\n" not in str(error.value)
    good = tmp_path / "good.pickle"
    dump_memory_snapshot(_probed_device(), good)
    assert load_snapshot(good)["device_traces"]


def _probed_device() -> bf.SimulatedDevice:
    device = bf.SimulatedDevice("64MiB", allocator="cuda")
    sample = (torch.randn(4, 64), torch.randint(0, 32, (4,)))
    bf.probe_batch_size(nn.Linear(64, 32), sample, 16, loss_fn=loss_fn, device=device)
    return device
