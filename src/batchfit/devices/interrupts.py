"""Ctrl-C, taken where the accounting is whole.

Python raises ``KeyboardInterrupt`` at whatever bytecode runs when SIGINT arrives. Inside a weak-reference
callback (the live-byte accounting uncounts a freed storage in one) the exception is printed and dropped
("Exception ignored in ..."): the search goes on with a count left half-updated. Inside a context manager's
``__enter__`` or ``__exit__`` it can leave a dispatch mode pushed. While ``interrupts_deferred()`` is active
(in the main thread), SIGINT only sets a flag; ``raise_if_interrupted()``, called where every count is whole
(before each op a counting device sees, before each training step and trial), raises ``KeyboardInterrupt``
there, and the flag is raised on the way out of the outermost block at the latest (also when another error
leaves it: the ``KeyboardInterrupt`` then takes its place, that error as its context).

A second Ctrl-C before that raises at once, as if nothing were deferred: the user insists. Not inside shielded
code (``shield_code``: the accounting, which counts and uncounts storages, the latter in weak-reference
callbacks): raised there, it would leave a count half-updated, or be dropped by Python. There the second Ctrl-C
stays deferred, and is raised at the next safe point. A ``KeyboardInterrupt`` Python drops anyway (raised at once
in someone else's weak-reference callback or ``__del__``, which Python reports through ``sys.unraisablehook``)
is deferred again, never lost.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

_state: dict[str, Any] = {"depth": 0, "pending": False, "previous": None, "unraisable": None, "held": 0}
_shielded: set[str] = set()  # the files (``co_filename``) of code a Ctrl-C never raises inside


def shield_code(filename: str) -> None:
    """Never raise a Ctrl-C (not even a second one) while code of ``filename`` (a module's ``__file__``) is
    anywhere on the stack: it stays deferred until the next safe point."""
    _shielded.add(filename)


def _in_shielded_code(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename in _shielded:
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if not _state["pending"]:
        _state["pending"] = True  # the first Ctrl-C: at the next safe point
        return
    if _in_shielded_code(frame):
        return  # a second one amid the accounting: it stays pending, raised at the next safe point
    _state["pending"] = False  # a second Ctrl-C: now
    raise KeyboardInterrupt


def _on_unraisable(unraisable: Any) -> None:
    """A ``KeyboardInterrupt`` Python drops (raised in a weak-reference callback, a ``__del__``): deferred again,
    so the next safe point raises it; anything else goes to the hook that was there before."""
    if _state["depth"] and unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        _state["pending"] = True
        return
    (_state["unraisable"] or sys.__unraisablehook__)(unraisable)


def raise_if_interrupted() -> None:
    """``KeyboardInterrupt`` here, if Ctrl-C came while interrupts were deferred (not inside ``interrupts_held``)."""
    if _state["pending"] and not _state["held"]:
        _state["pending"] = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """A deferred Ctrl-C waits for the end of this block: ``raise_if_interrupted`` raises nothing inside it (for
    work that cannot be undone when stopped half-way, such as an optimizer step). A second Ctrl-C still raises at
    once outside shielded code."""
    _state["held"] += 1
    try:
        yield
    finally:
        _state["held"] -= 1


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C sets a flag instead of raising anywhere (see the module); nested blocks share the outermost's
    handler. Outside the main thread (where no handler can be set) Python's own handling stands."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outermost = _state["depth"] == 0
    if outermost:
        _state["previous"], _state["pending"] = signal.signal(signal.SIGINT, _on_sigint), False
        _state["unraisable"], sys.unraisablehook = sys.unraisablehook, _on_unraisable
    _state["depth"] += 1
    try:
        yield
    except BaseException as error:
        if _leave(outermost) and isinstance(error, Exception):
            raise KeyboardInterrupt  # noqa: B904 (the error that was leaving is its context)
        raise
    if _leave(outermost):
        raise KeyboardInterrupt


def _leave(outermost: bool) -> bool:
    """Leave a block; for the outermost, put the handlers back and return whether a Ctrl-C is still pending
    (cleared: it is raised now, or already on its way as a ``KeyboardInterrupt``)."""
    _state["depth"] -= 1
    if not outermost:
        return False
    signal.signal(signal.SIGINT, _state["previous"])
    _state["previous"] = None
    if sys.unraisablehook is _on_unraisable:
        sys.unraisablehook = _state["unraisable"]
    _state["unraisable"] = None
    pending, _state["pending"] = _state["pending"], False
    return pending
