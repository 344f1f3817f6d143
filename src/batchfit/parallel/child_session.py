"""``ChildSession``: the parent's side of tracing FSDP2's CPU offload in a child process of batchfit's own
(the child is ``python -m batchfit.parallel.offload``: see that module). ``RankSession`` opens one, so this module
imports nothing of the parallel layer.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from typing import IO
from typing import Any

from batchfit.errors import InputError

CLOSE_SECONDS = 60.0  # how long a closing child may take before it is killed
# What the child's stderr says that means nothing here: c10d asks a process group with a backend per
# device type (the host's and the fake accelerator's) for hooks of the default type, which it lacks.
NOISE = ("No backend of type 0 found for Process Group",)


def unpicklable_error(what: str, error: Exception) -> InputError:
    """The one-line error for a ``what`` (the model and optimizer) that cannot cross to the child."""
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
            raise unpicklable_error("model and optimizer", error) from None
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
