"""Writing files atomically: a temp file in the same folder, then a rename. A shared leaf beside ``errors``:
every layer may import it (the results file of a sweep, the CLI's reports and plots), and it imports nothing of
batchfit but ``errors``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from batchfit.errors import InputError


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never half.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "out.txt"
    >>> atomic_write_bytes(target, b"done").read_bytes()
    b'done'
    """
    target = check_writable(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, _file_mode(target))  # mkstemp makes it private; keep what a plain open() would give
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def check_writable(path: str | Path) -> Path:
    """``path`` as a ``Path`` if a file can be written there (its folder exists, it is no folder),
    else a ``ValueError`` naming the fix: check before the work, not after it."""
    target = Path(path)
    if target.is_dir():
        raise InputError(f"cannot write {target}: it is a folder; give a file path such as {target / 'result.json'}")
    if not target.parent.is_dir():
        raise InputError(f"cannot write {target}: folder {target.parent} does not exist (create it first)")
    return target


def _file_mode(target: Path) -> int:
    if target.exists():
        return target.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``atomic_write_bytes`` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))
