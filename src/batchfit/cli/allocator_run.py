"""The body of ``batchfit allocator``: read a memory snapshot, replay it through the caching allocator model, and
report what matched, what fragmentation cost, what other settings would have done and the largest batch the replay
suggests. Its face is ``batchfit.cli.allocator``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape

from batchfit.cli.common import check_outputs
from batchfit.cli.common import console
from batchfit.cli.common import write_json
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.allocator_settings import allocator_label
from batchfit.devices.snapshot_files import Snapshot
from batchfit.devices.snapshot_files import load_snapshot
from batchfit.devices.snapshot_replay import LargestBatch
from batchfit.devices.snapshot_replay import RequestReplay
from batchfit.devices.snapshot_replay import SnapshotReplay
from batchfit.devices.snapshot_replay import largest_batch
from batchfit.devices.snapshot_replay import replay_requests
from batchfit.devices.snapshot_replay import replay_snapshot
from batchfit.devices.snapshot_state import read_snapshot
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes
from batchfit.errors import InputError

DEFAULT_TRIES = ("expandable_segments:True", "max_split_size_mb:128", "max_split_size_mb:512")


def run_allocator(
    *,
    snapshot: Path,
    batch_size: int | None,
    capacity: str | None,
    settings: str | None,
    try_settings: list[str] | None,
    device_index: int | None,
    json_path: Path | None,
    debug: bool,
) -> None:
    """The body of ``batchfit allocator`` (see its help)."""
    if batch_size is not None and batch_size < 1:
        raise InputError(f"--batch-size must be a positive integer, got {batch_size}")
    given_capacity = parse_bytes(capacity) if capacity is not None else None
    given_settings = AllocatorSettings.parse(settings) if settings is not None else None
    tries = [(text, AllocatorSettings.parse(text)) for text in (try_settings or DEFAULT_TRIES)]
    check_outputs(json_path)
    snap = read_snapshot(
        load_snapshot(snapshot), settings=given_settings, capacity_bytes=given_capacity, device=device_index
    )
    batch_size = batch_size or _noted_batch(snap)
    replay = replay_snapshot(snap)
    _say(_heading(snapshot, snap))
    for note in snap.unmodelled:
        _say(f"Note: the snapshot holds {note}.")
    for line in _replay_lines(replay):
        _say(line)
    what_ifs = _what_ifs(snap, replay, tries)
    for line in _oom_lines(snap, replay, what_ifs):
        _say(line)
    largest = None
    if batch_size is not None:
        largest = largest_batch(snap, batch_size, empty_caches=replay.empty_caches) if snap.capacity_bytes else None
        _say(_largest_line(largest, batch_size))
    if json_path is not None:
        write_json(json_path, _document(snapshot, snap, replay, what_ifs, largest))


def _say(line: str) -> None:
    """One line of the report, never wrapped (each is read as one line)."""
    console.print(escape(line), highlight=False, soft_wrap=True)


def _noted_batch(snap: Snapshot) -> int | None:
    noted = snap.about.get("batch_size")
    return noted if isinstance(noted, int) and noted > 0 else None


def _heading(path: Path, snap: Snapshot) -> str:
    requests = sum(e.action in ("alloc", "oom") for e in snap.events)
    frees = sum(e.action == "free_completed" for e in snap.events)
    capacity = format_bytes(snap.capacity_bytes) if snap.capacity_bytes is not None else "unlimited"
    return (
        f"batchfit allocator: {path}: {len(snap.events)} events on device {snap.device} ({requests} requests, "
        f"{frees} frees); settings {allocator_label(snap.settings)} (from {snap.settings_source}); "
        f"capacity {capacity} (from {snap.capacity_source})."
    )


def _replay_lines(replay: SnapshotReplay) -> list[str]:
    lines = []
    if replay.matched:
        oom = f"; the same request ran out of memory (event {replay.card_ooms[0]})" if replay.card_ooms else ""
        lines.append(
            f"Replay: matched event by event ({replay.compared} events: every block where the card put it, "
            f"{replay.segment_events} segment events, the reserved bytes after every event){oom}."
        )
    else:
        first = replay.first_mismatch.describe() if replay.first_mismatch is not None else "the ooms differ"
        ooms = ""
        if replay.card_ooms != replay.model_ooms:
            ooms = f"; out of memory at events {list(replay.card_ooms)} on the card, {list(replay.model_ooms)} in the model"
        lines.append(
            f"Replay: differs from the card: {first} ({replay.mismatches} of {replay.compared} events differ{ooms})."
        )
    if replay.empty_caches:
        where = ", ".join(str(i) for i in replay.empty_caches[:5]) + (", ..." if len(replay.empty_caches) > 5 else "")
        lines.append(
            f"The card emptied its cache (torch.cuda.empty_cache) {len(replay.empty_caches)} times: at events {where}."
        )
    reserved, allocated = replay.peak_reserved_bytes, replay.allocated_at_peak_bytes
    share = f" ({100 * replay.fragmentation_bytes / reserved:.1f}%)" if reserved else ""
    at = f" (event {replay.peak_index})" if replay.peak_index is not None else " (when the trace began)"
    lines.append(
        f"Fragmentation at the peak: {format_bytes(reserved)} reserved, {format_bytes(allocated)} allocated{at}: "
        f"{format_bytes(replay.fragmentation_bytes)}{share} reserved but not allocated."
    )
    return lines


def _what_ifs(
    snap: Snapshot, replay: SnapshotReplay, tries: list[tuple[str, AllocatorSettings]]
) -> list[tuple[str, RequestReplay]]:
    if not replay.card_ooms:
        return []
    return [(text, replay_requests(snap, chosen, empty_caches=replay.empty_caches)) for text, chosen in tries]


def _oom_lines(snap: Snapshot, replay: SnapshotReplay, what_ifs: list[tuple[str, RequestReplay]]) -> list[str]:
    if not replay.card_ooms:
        return ["No request ran out of memory."]
    index = replay.card_ooms[0]
    later = any(e.index > index and e.action in ("alloc", "oom") for e in snap.events)
    lines = [f"Out of memory: the request at event {index} failed on the card{_oom_state(replay)}."]
    for text, outcome in what_ifs:
        peak = f"peak {format_bytes(outcome.peak_reserved_bytes)} reserved"
        if not outcome.serves(index):
            lines.append(f"  {text} would not (the request at event {outcome.failed_index} fails).")
        elif not later:
            lines.append(f"  {text} would have served it ({peak}).")
        elif outcome.served:
            lines.append(f"  {text} would have served it and every later request ({peak}).")
        else:
            lines.append(f"  {text} would have served it, but not the request at event {outcome.failed_index}.")
    return lines


def _oom_state(replay: SnapshotReplay) -> str:
    if replay.oom_bytes is None:
        return ""
    reserved, allocated = replay.oom_bytes
    return (
        f" (in the model: {format_bytes(reserved)} reserved, {format_bytes(allocated)} allocated, "
        f"{format_bytes(reserved - allocated)} reserved but not allocated)"
    )


def _largest_line(largest: LargestBatch | None, batch_size: int) -> str:
    if largest is None:
        return "Largest batch: the capacity is unknown (no oom event, no note): give --capacity to find it."
    rule = "requests made and freed within the trace, and the one that failed, grow with the batch; the rest stay"
    capped = " (or more: the search stops there)" if largest.capped else ""
    if largest.batch_size == 0:
        return f"Largest batch the replay suggests: none, not even 1 (recorded at {batch_size}; {rule})."
    return (
        f"Largest batch the replay suggests: {largest.batch_size}{capped} (recorded at {batch_size}; {rule}; "
        f"{largest.replays} replays)."
    )


def _document(
    path: Path,
    snap: Snapshot,
    replay: SnapshotReplay,
    what_ifs: list[tuple[str, RequestReplay]],
    largest: LargestBatch | None,
) -> dict[str, Any]:
    first = replay.first_mismatch
    return {
        "snapshot": str(path),
        "device": snap.device,
        "events": len(snap.events),
        "settings": snap.settings.to_conf(),
        "settings_source": snap.settings_source,
        "capacity_bytes": snap.capacity_bytes,
        "capacity_source": snap.capacity_source,
        "matched": replay.matched,
        "compared": replay.compared,
        "mismatches": replay.mismatches,
        "first_mismatch": None if first is None else {"event": first.index, "card": first.card, "model": first.model},
        "empty_caches": list(replay.empty_caches),
        "card_ooms": list(replay.card_ooms),
        "model_ooms": list(replay.model_ooms),
        "card_peak_reserved_bytes": replay.card_peak_reserved_bytes,
        "peak_reserved_bytes": replay.peak_reserved_bytes,
        "allocated_at_peak_bytes": replay.allocated_at_peak_bytes,
        "fragmentation_bytes": replay.fragmentation_bytes,
        "what_if": [
            {
                "settings": text,
                "served": outcome.served,
                "failed_event": outcome.failed_index,
                "peak_reserved_bytes": outcome.peak_reserved_bytes,
            }
            for text, outcome in what_ifs
        ],
        "largest_batch_size": largest.batch_size if largest is not None else None,
    }
