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
becomes a ``RuntimeError`` naming it, with the child's traceback.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import traceback
from typing import IO
from typing import Any

from batchfit.errors import InputError

CLOSE_SECONDS = 60.0  # how long a closing child may take before it is killed
# What the child's stderr says that means nothing here: c10d asks a process group with a backend per
# device type (the host's and the fake accelerator's) for hooks of the default type, which it lacks.
NOISE = ("No backend of type 0 found for Process Group",)


def _unpicklable(what: str, error: Exception) -> InputError:
    return InputError(
        f"cpu_offload traces in a child process, so the {what} must pickle ({type(error).__name__}: {error}): give "
        "a preset name, a config.json path, a dict, a transformers config, or a function importable from a module"
    )


class ChildSession:
    """The child process that traces one rank with CPU offload: ``RankSession(**options)`` over
    ``seq_len`` tokens, opened there at once. A ``RankSession`` with ``cpu_offload`` makes one
    (``with RankSession(model, seq_len, parallelism=Parallelism(world_size=8, cpu_offload=True))``);
    ``trace`` answers as the session's own would, ``close`` stops the child.
    """

    def __init__(self, seq_len: int, options: dict[str, Any]):
        try:
            opening = pickle.dumps(("open", list(sys.path), seq_len, pickle.dumps(options)))
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise _unpicklable("model and optimizer", error) from None
        self._process: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "batchfit.parallel.offload"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        threading.Thread(target=_forward_errors, args=(self._process.stderr,), daemon=True).start()
        try:
            self._ask(opening)
        except BaseException:
            self.close()
            raise

    def trace(self, batch_size: int) -> tuple[Any, int]:
        """The child's ``RankSession.trace(batch_size)``, and the training steps it has run in all."""
        return self._ask(pickle.dumps(("trace", batch_size)))

    def close(self) -> None:
        """Stop the child (it closes its session first); killed if it does not end in time."""
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.poll() is None:
                pickle.dump(("close",), process.stdin)
                process.stdin.flush()
            process.stdin.close()
            process.wait(timeout=CLOSE_SECONDS)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
        finally:
            process.stdout.close()

    def _ask(self, message: bytes) -> Any:
        process = self._process
        if process is None:
            raise InputError("this offload session is closed: trace in a new RankSession")
        try:
            process.stdin.write(message)
            process.stdin.flush()
            status, value = pickle.load(process.stdout)
        except (OSError, EOFError, pickle.UnpicklingError):
            code = process.wait()
            raise RuntimeError(
                f"the child process tracing CPU offload ended without an answer (exit code {code}); its errors are above"
            ) from None
        if status == "error":
            raise value
        return value


def _forward_errors(stream: IO[bytes]) -> None:
    """Copy the child's stderr to this process's, line by line, but for ``NOISE``."""
    with stream:
        for line in stream:
            text = line.decode(errors="replace")
            if not any(noise in text for noise in NOISE):
                sys.stderr.write(text)
                sys.stderr.flush()


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
        raise _unpicklable("model and optimizer", error) from None


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """The child's loop: open the session, answer every trace, close on request or end of input."""
    from batchfit.parallel import accelerator
    from batchfit.parallel.trace import RankSession

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
