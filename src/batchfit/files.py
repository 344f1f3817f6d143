"""Writing output files: a regular file atomically (a temp file in the same folder, then a rename), anything else
only as what it is. A shared leaf beside ``errors``: every layer may import it (the results file of a sweep, the
CLI's reports and plots), and it imports nothing of batchfit but ``errors``.

Where a write goes, by what stands at the path (``check_writable`` applies the same rules, before the work):

* a regular file, or nothing yet: the temp file and the rename, so readers see the old file or the whole new one;
* a symlink: followed to its final target, which is written by these rules (the temp file in the target's folder);
  the link itself stays as it was;
* ``-`` (standard output), a character device (``/dev/null``, a terminal) or a FIFO (a named pipe): opened and
  written through, no temp file, no rename, never unlinked;
* a folder, a socket, a block device: refused with an ``InputError`` naming the fix.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import IO

from batchfit.errors import InputError

STDOUT = "-"
"""The path that means standard output."""

_ATOMIC = "atomic"
_THROUGH = "through"
_STDOUT = "stdout"

_STANDARD_OUTPUT: ContextVar[IO[str] | None] = ContextVar("batchfit_standard_output", default=None)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never half (a regular file;
    other targets as the module says). Returns ``path`` as a ``Path``.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "out.txt"
    >>> atomic_write_bytes(target, b"done").read_bytes()
    b'done'
    """
    target = Path(path)
    how, where = _destination(target)
    if how == _STDOUT:
        _write_stdout(data)
    elif how == _THROUGH:
        _write_through(where, data)
    else:
        _replace(where, data)
    return target


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``atomic_write_bytes`` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def check_writable(path: str | Path) -> Path:
    """``path`` as a ``Path`` if an output can be written there by the module's rules (a regular file or a new one
    in a folder that exists, through symlinks; ``-``; a character device; a FIFO), else an ``InputError`` naming
    the fix: check before the work, not after it.

    >>> check_writable("/")
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: cannot write /: it is a folder; give a file path such as /result.json
    """
    target = Path(path)
    _destination(target)
    return target


@contextlib.contextmanager
def standard_output(stream: IO[str]) -> Iterator[None]:
    """Meanwhile ``-`` writes to ``stream`` rather than to ``sys.stdout`` of the moment: the CLI keeps the real
    stdout here for a ``--json -`` document while its own lines go to stderr."""
    token = _STANDARD_OUTPUT.set(stream)
    try:
        yield
    finally:
        _STANDARD_OUTPUT.reset(token)


def _destination(target: Path) -> tuple[str, Path]:
    """How to write ``target`` (atomically, through, or to stdout) and the path to write: for a symlink, its
    final target."""
    if str(target) == STDOUT:
        return _STDOUT, target
    try:
        mode: int | None = os.stat(target).st_mode  # follows symlinks, /proc's magic ones included
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as error:  # a symlink loop, a folder that may not be searched
        raise InputError(f"cannot write {target}: {error.strerror}; give a file path that can be reached") from None
    final = Path(os.path.realpath(target)) if target.is_symlink() else target
    if mode is None:  # a new file, maybe the missing target of a dangling symlink
        if not final.parent.is_dir():
            raise InputError(f"cannot write {target}: folder {final.parent} does not exist (create it first)")
        return _ATOMIC, final
    if stat.S_ISREG(mode):
        if final is target or (final.exists() and os.path.samefile(final, target)):
            return _ATOMIC, final
        return _THROUGH, target  # a magic link (/dev/stdout into a deleted file): no name to rename onto
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return _THROUGH, target
    if stat.S_ISDIR(mode):
        raise InputError(f"cannot write {target}: it is a folder; give a file path such as {target / 'result.json'}")
    kind = "a socket" if stat.S_ISSOCK(mode) else "a block device" if stat.S_ISBLK(mode) else "no regular file"
    raise InputError(
        f"cannot write {target}: it is {kind}; give a regular file path, a FIFO, or {STDOUT} for standard output"
    )


def _replace(final: Path, data: bytes) -> None:
    """The temp file beside ``final``, written in full and synced, then renamed onto it; removed on failure."""
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, _file_mode(final))  # mkstemp makes it private; keep what a plain open() would give
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_through(target: Path, data: bytes) -> None:
    """Open what stands at ``target`` (a device, a FIFO: that blocks until a reader comes) and write: never creating
    a file, never unlinking one."""
    flags = os.O_WRONLY | getattr(os, "O_NOCTTY", 0)
    if target.is_file():
        flags |= os.O_TRUNC  # a regular file behind a magic link: the document replaces what it held
    with os.fdopen(os.open(target, flags), "wb") as handle:
        handle.write(data)


def _write_stdout(data: bytes) -> None:
    """``data`` on the stream ``standard_output`` kept, else on ``sys.stdout`` of the moment (a test runner's too)."""
    stream = _STANDARD_OUTPUT.get() or sys.stdout
    if stream is None:
        raise InputError(f"cannot write {STDOUT}: this process has no standard output; give a file path")
    stream.flush()  # what was printed before comes first
    buffer = getattr(stream, "buffer", None)
    if buffer is None:
        stream.write(data.decode("utf-8", errors="replace"))
    else:
        buffer.write(data)
        buffer.flush()
    stream.flush()


def _file_mode(target: Path) -> int:
    if target.exists():
        return target.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
