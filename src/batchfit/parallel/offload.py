"""FSDP2's CPU offload, traced in a child process of batchfit's own.

A ``RankSession`` with ``Parallelism(cpu_offload=True)`` cannot trace in the caller's process: it
needs the fake accelerator (``batchfit.parallel.accelerator``), whose registration changes torch
for the whole process and for good. So it starts ``python -m batchfit.parallel.offload`` (the same
interpreter and import path), which registers the accelerator, opens the same ``RankSession``
there and answers each ``trace`` with its ``ShardedEstimate``; the child is stopped when the
session closes. Messages are pickles on the child's stdin and on a copy of its stdout (its own
stdout goes to stderr, so nothing printed there can break them). The model spec must therefore
pickle: a preset name, a config.json path, a dict, a transformers config, or a function or class
importable from a module.

Errors cross over as they were raised (an ``InputError`` stays one); one that does not pickle
becomes a ``RuntimeError`` naming it, with the child's traceback. This module is the child's side;
the parent's, ``ChildSession``, lives in ``batchfit.parallel.child_session`` (re-exported here).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import IO
from typing import Any

from batchfit.parallel import accelerator
from batchfit.parallel.child_session import CLOSE_SECONDS as CLOSE_SECONDS
from batchfit.parallel.child_session import NOISE as NOISE
from batchfit.parallel.child_session import ChildSession as ChildSession
from batchfit.parallel.child_session import unpicklable_error
from batchfit.parallel.trace import RankSession


def _error_reply(error: BaseException) -> tuple[str, BaseException]:
    """An error as the parent will raise it: itself if it pickles, else a ``RuntimeError`` naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return "error", error
    except Exception:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return "error", RuntimeError(f"{type(error).__name__} while tracing CPU offload: {error}\n{text}")


def _options(pickled: bytes) -> dict[str, Any]:
    """The session's options, read in the child: one-line error if something in them cannot be
    imported here (a function of the parent's ``__main__``)."""
    try:
        return pickle.loads(pickled)
    except (AttributeError, ImportError, pickle.UnpicklingError) as error:
        raise unpicklable_error("model and optimizer", error) from None


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """The child's loop: open the session, answer every trace, close on request or end of input."""
    accelerator.register()
    session = None
    try:
        while True:
            try:
                message = pickle.load(requests)
            except EOFError:
                return
            if message[0] == "close":
                return
            try:
                if message[0] == "open":
                    _, path, seq_len, pickled = message
                    sys.path[:] = path  # the parent's, before its pickles are read
                    options = _options(pickled)
                    session = RankSession(options.pop("model"), seq_len, **options).__enter__()
                    reply: tuple[str, Any] = ("ok", None)
                else:
                    reply = ("ok", (session.trace(message[1]), session.steps_run))
            except BaseException as error:  # every error goes back to the parent, which raises it
                reply = _error_reply(error)
            pickle.dump(reply, replies)
            replies.flush()
    finally:
        if session is not None:
            session.__exit__(None, None, None)


def main() -> None:
    """Serve one parent: replies go to a copy of stdout, and stdout itself to stderr."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        _serve(sys.stdin.buffer, replies)
        replies.close()
    finally:
        sys.stderr.flush()
        os._exit(0)  # a checkpointed backward on the fake accelerator can abort at interpreter exit


if __name__ == "__main__":
    main()
