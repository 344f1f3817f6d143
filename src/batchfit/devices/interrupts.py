"""Ctrl-C, taken where the accounting is whole.

Python raises ``KeyboardInterrupt`` at whatever bytecode runs when SIGINT arrives. Inside a weak-reference
callback (the live-byte accounting uncounts a freed storage in one) the exception is printed and dropped
("Exception ignored in ..."): the search goes on with a count left half-updated. Inside a context manager's
``__enter__`` or ``__exit__`` it can leave a dispatch mode pushed. While ``interrupts_deferred()`` is active
(in the main thread), SIGINT only sets a flag; ``raise_if_interrupted()``, called where every count is whole
(before each op a counting device sees, before each training step and trial), raises ``KeyboardInterrupt``
there, and the flag is raised on the way out of the outermost block at the latest. A second Ctrl-C before that
raises at once, as if nothing were deferred: the user insists.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_state = {"depth": 0, "pending": False, "previous": None}


def _on_sigint(signum: int, frame: Any) -> None:
    if _state["pending"]:  # a second Ctrl-C: now
        _state["pending"] = False
        raise KeyboardInterrupt
    _state["pending"] = True


def raise_if_interrupted() -> None:
    """``KeyboardInterrupt`` here, if Ctrl-C came while interrupts were deferred."""
    if _state["pending"]:
        _state["pending"] = False
        raise KeyboardInterrupt


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
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if outermost:
            signal.signal(signal.SIGINT, _state["previous"])
            _state["previous"] = None
    if outermost:
        raise_if_interrupted()
