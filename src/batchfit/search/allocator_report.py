"""What the caching allocator cost a search: the reserved bytes beyond the live ones at the answer, the answer
expandable segments would give, and the advice to set them where they would raise it.

On a GPU the edge is where the caching allocator can no longer serve a request, and a cached block it cannot
reuse (a hole between live blocks of one segment) is memory the step cannot have. ``expandable_segments:True``
maps pages into one growing segment instead, and unmaps free ones, so little is lost that way.
"""

from __future__ import annotations

from typing import Any

from batchfit.devices.units import format_bytes

CONFIRM_STEPS = 4  # steps in a row that confirm the answer where a caching allocator decides what fits
EXPANDABLE_CONF = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def allocator_report(device: Any, result: Any) -> dict[str, Any] | None:
    """The allocator's part of a search ``result`` on ``device`` (``None`` where no caching allocator decides):
    its settings, the peaks at the answer (its last trial there: the confirmation, if one ran), the bytes
    reserved beyond the live ones, the steps of the loop the allocator model ran there and whether its state
    then repeated (``loop_steps``, ``settled``: see ``batchfit.devices.allocator_replay``), the edge predicted with expandable segments and with these settings (where
    the lines or the trace predicted them), and ``advice`` when expandable segments would raise the answer."""
    settings = getattr(device, "allocator_settings", None)
    if settings is None:
        return None
    at_answer = [t for t in result.trials if t.batch_size == result.batch_size and t.fits]
    chosen = at_answer[-1] if at_answer else None
    allocated = chosen.peak_bytes if chosen is not None else None
    reserved = chosen.reserved_peak_bytes if chosen is not None else None
    predicted = result.extra.get("lines") or result.extra.get("trace") or {}
    report = {
        "settings": settings.to_conf(),
        "expandable_segments": settings.expandable_segments,
        "allocated_peak_bytes": allocated,
        "reserved_peak_bytes": reserved,
        "fragmentation_bytes": reserved - allocated if reserved is not None and allocated is not None else None,
        "predicted_batch_size": predicted.get("batch_size"),
        "expandable_batch_size": predicted.get("expandable_batch_size"),
        "loop_steps": chosen.loop_steps if chosen is not None else None,
        "settled": chosen.settled if chosen is not None else None,
    }
    report["advice"] = expandable_advice(report["predicted_batch_size"], report["expandable_batch_size"])
    return report


def expandable_advice(predicted: int | None, expandable: int | None) -> str | None:
    """The advice to set expandable segments, where they are predicted to fit more than these settings.

    >>> expandable_advice(89, 93)
    'set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts: predicted to fit 93 where the allocator as set fits 89 (fragmentation costs 4), then search again'
    """
    if predicted is None or expandable is None or expandable <= predicted:
        return None
    return (
        f"set {EXPANDABLE_CONF} before CUDA starts: predicted to fit {expandable} where the allocator as set fits "
        f"{predicted} (fragmentation costs {expandable - predicted}), then search again"
    )


def allocator_clause(extra: dict[str, Any]) -> str:
    """The summary's words on the allocator: the confirmation, what it reserved beyond the live bytes, the advice."""
    words = ""
    confirmed = extra.get("confirmed")
    if confirmed and confirmed.get("batch_size") is not None:
        words += f"; confirmed by {confirmed['steps']} steps in a row from an emptied cache, as training starts"
    report = extra.get("allocator")
    if report and report.get("loop_steps"):
        held = "settled by" if report.get("settled") else "held"
        words += f"; the allocator model ran the training loop on and it {held} step {report['loop_steps']}"
    if report and report.get("fragmentation_bytes") is not None:
        words += f"; the caching allocator reserved {format_bytes(report['fragmentation_bytes'])} beyond the live bytes"
    if report and report.get("advice"):
        words += f"; {report['advice']}"
    return words
