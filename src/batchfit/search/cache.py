"""ResultCache: search results kept in SQLite (standard library), keyed by fingerprint.

The cache lives in ``$BATCHFIT_CACHE_DIR``, else the user cache folder (``$XDG_CACHE_HOME/batchfit``,
``~/Library/Caches/batchfit`` on macOS, ``%LOCALAPPDATA%\\batchfit\\Cache`` on Windows). Many
processes may read and write it at once (SQLite's locking, a busy timeout, one statement per
write). A cache file that is not a database, or is damaged, is reported in one line and rebuilt;
one that cannot be opened at all turns caching off for the run. A cache problem never stops a
search. Every row carries a checksum of its answer: a row edited by hand, or stored by a build
without checksums, is a miss (and is measured again), never served.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfit.errors import InputError

logger = logging.getLogger("batchfit")

SCHEMA_VERSION = 2  # 2: rows carry a checksum (version 1's rows are kept, and miss)
FILE_NAME = "results.sqlite"
BUSY_TIMEOUT_SECONDS = 30.0
_SCHEMA = """CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY, created REAL NOT NULL, label TEXT NOT NULL, device TEXT NOT NULL,
    batch_size INTEGER, fields TEXT NOT NULL, result TEXT NOT NULL, checksum TEXT)"""
_COLUMNS = "key, created, label, device, batch_size, result, checksum"


def default_cache_dir() -> Path:
    """``$BATCHFIT_CACHE_DIR``, else the platform's user cache folder plus ``batchfit``."""
    if os.environ.get("BATCHFIT_CACHE_DIR"):
        return Path(os.environ["BATCHFIT_CACHE_DIR"]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "batchfit"
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "batchfit" / "Cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchfit"


def _upgrade(connection: sqlite3.Connection) -> None:
    """Bring a new (version 0) or version-1 file to ``SCHEMA_VERSION``, in one transaction, so two
    processes opening it at once upgrade it once. Version 1's rows get no checksum: they miss."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, 1, SCHEMA_VERSION):
            raise sqlite3.DatabaseError(f"schema version {version}, this batchfit writes {SCHEMA_VERSION}")
        if version == 0:
            connection.execute(_SCHEMA)
        elif version == 1:
            connection.execute("ALTER TABLE results ADD COLUMN checksum TEXT")
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise


@dataclass(frozen=True)
class CacheEntry:
    """One stored result: its key, when it was stored, what it was for, and the answer."""

    key: str
    created: float
    label: str
    device: str
    batch_size: int | None
    result: dict[str, Any]


def checksum(key: str, batch_size: int | None, result_text: str) -> str:
    """The SHA-256 of a row's answer (its key, batch size and stored result text), as canonical JSON.

    >>> checksum("k", 8, '{"batch_size": 8}') == checksum("k", 8, '{"batch_size": 9}')
    False
    """
    text = json.dumps([key, batch_size, result_text], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _entries(rows: list[tuple]) -> list[CacheEntry]:
    """The rows whose checksum holds and whose result reads as JSON, as entries."""
    entries = []
    for key, created, label, device, batch_size, result, stored_checksum in rows:
        if stored_checksum != checksum(key, batch_size, result):
            continue
        with contextlib.suppress(ValueError):
            entries.append(CacheEntry(key, created, label, device, batch_size, json.loads(result)))
    return entries


class ResultCache:
    """Stored search results in ``directory`` (default: ``default_cache_dir()``).

    >>> import tempfile
    >>> cache = ResultCache(tempfile.mkdtemp())
    >>> cache.put("k1", {"batch_size": 8}, label="mlp", device="sim:1MiB", fields={})
    >>> cache.get("k1").result["batch_size"], cache.get("other")
    (8, None)
    """

    def __init__(self, directory: str | Path | None = None, *, read_only: bool = False):
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.path = self.directory / FILE_NAME
        self.read_only = read_only  # a sweep's worker reads; its driver alone writes (SQLite keeps one writer)
        self.disabled_reason: str | None = None
        if self.directory.exists() and not self.directory.is_dir():
            raise InputError(
                f"cache dir {self.directory} is a file: give a folder with --cache-dir or BATCHFIT_CACHE_DIR"
            )

    # -- reading and writing ---------------------------------------------------------------------

    def get(self, key: str) -> CacheEntry | None:
        """The entry stored under ``key``, or ``None``: also when the row fails its checksum (edited
        by hand, damaged, or stored without one), which then goes."""
        if self.read_only and not self.path.is_file():
            return None  # nothing stored yet: a reader creates nothing
        rows = self._run(f"SELECT {_COLUMNS} FROM results WHERE key = ?", (key,))
        entries = _entries(rows or [])
        if rows and not entries and not self.read_only:  # a damaged row is a miss, and goes
            if rows[0][-1] is not None:
                logger.info("batchfit: the cached answer %s failed its checksum; measuring again", key[:12])
            self._run("DELETE FROM results WHERE key = ?", (key,))
        return entries[0] if entries else None

    def put(self, key: str, result: dict[str, Any], *, label: str, device: str, fields: dict[str, Any]) -> None:
        """Store ``result`` (JSON-ready) under ``key`` with its checksum, replacing what was there."""
        if self.read_only:
            raise InputError(f"the result cache {self.path} was opened read-only: store through its writer")
        batch_size, text = result.get("batch_size"), json.dumps(result, default=repr)
        fields_text = json.dumps(fields, default=repr)
        row = (key, time.time(), label, device, batch_size, fields_text, text, checksum(key, batch_size, text))
        self._run("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)

    def entries(self) -> list[CacheEntry]:
        """Every stored result that passes its checksum, oldest first."""
        rows = self._run(f"SELECT {_COLUMNS} FROM results ORDER BY created")
        return _entries(rows or [])

    def clear(self) -> int:
        """Delete every stored result; return how many there were."""
        count = len(self._run("SELECT key FROM results") or [])
        self._run("DELETE FROM results")
        return count

    # -- the database ----------------------------------------------------------------------------

    def _run(self, sql: str, parameters: tuple = ()) -> list[tuple] | None:
        """Run one statement; on a damaged file rebuild it once and retry. ``None`` when caching is off."""
        for attempt in (1, 2):
            if self.disabled_reason is not None:
                return None
            try:
                with self._connection() as connection:
                    return connection.execute(sql, parameters).fetchall()
            except (sqlite3.OperationalError, OSError) as error:  # locked past the timeout, unwritable, ...
                self._disable(str(error))
            except sqlite3.DatabaseError as error:  # not a database, malformed
                if attempt == 2 or self.read_only:
                    self._disable(str(error))
                else:
                    self._rebuild(str(error))
        return None

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        if self.read_only:
            with contextlib.closing(sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True)) as connection:
                yield connection  # a file from an older schema reads as a miss (its columns differ)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
        try:
            version = connection.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                _upgrade(connection)
            yield connection
        finally:
            connection.close()

    def _rebuild(self, reason: str) -> None:
        """Put an empty database in place of a damaged one, atomically."""
        logger.warning("batchfit: the result cache %s was unreadable (%s); rebuilt it empty", self.path, reason)
        descriptor, temporary = tempfile.mkstemp(dir=self.directory, prefix=".results-", suffix=".sqlite")
        os.close(descriptor)
        try:
            with contextlib.closing(sqlite3.connect(temporary)) as fresh:
                fresh.execute(_SCHEMA)
                fresh.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                fresh.commit()
            for leftover in ("-journal", "-wal", "-shm"):  # a stale journal must not replay into the new file
                Path(str(self.path) + leftover).unlink(missing_ok=True)
            os.replace(temporary, self.path)
        except OSError as error:
            Path(temporary).unlink(missing_ok=True)
            self._disable(str(error))

    def _disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            logger.warning(
                "batchfit: cannot use the result cache %s (%s); caching is off for this run", self.path, reason
            )
        self.disabled_reason = reason

    def __repr__(self) -> str:
        return f"ResultCache({str(self.directory)!r})"
