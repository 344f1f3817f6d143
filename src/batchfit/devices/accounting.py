"""Live-bytes accounting: count every tensor storage alive while a trial runs.

A ``TorchDispatchMode`` sees every op below autograd (forward, backward and optimizer ops alike).
Each storage an op reads or makes is counted once, when first seen, and uncounted when the
storage is freed (a weak reference to the untyped storage: PyTorch keeps a storage's Python
object alive as long as the storage itself, so the callback fires when the memory is released).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchfit.devices.units import format_bytes
from batchfit.errors import InputError

# The simulated OOM message carries the CPU allocator's wording so that tools matching OOMs by
# message (Lightning, accelerate) recognise it as well.
PEER_OOM_WORDING = "DefaultCPUAllocator: can't allocate memory"
LARGE_BLOCK_OVER_BYTES = 2**20  # storages over 1 MiB are rounded to ``large_rounding_bytes``


class Ledger:
    """Who each storage is: a role per storage that outlives it, and the live storages at the
    highest peak, so the peak can be split into parameters, gradients, activations, ...

    Storages get the role ``tag`` that is current when they appear; ``assign`` changes the role
    of storages later found to be gradients, optimizer state or saved activations.
    """

    def __init__(self) -> None:
        self.tag = "temporaries"
        self.roles: dict[int, str] = {}  # serial -> role
        self.serials: dict[int, int] = {}  # storage key -> serial of the live storage with that key
        self.sizes: dict[int, int] = {}  # serial -> bytes
        self.max_bytes = -1
        self.at_peak: list[int] = []  # serials live at the highest peak
        self.peak_phase = ""
        self.phase = "batch"

    def created(self, key: int, nbytes: int) -> None:
        serial = len(self.sizes)
        self.serials[key] = serial
        self.sizes[serial] = nbytes
        self.roles[serial] = self.tag

    def observe(self, live_bytes: int, live_keys: Iterable[int]) -> None:
        if live_bytes > self.max_bytes:
            self.max_bytes = live_bytes
            self.at_peak = [self.serials[key] for key in live_keys]
            self.peak_phase = self.phase

    def assign(self, keys: Iterable[int], role: str) -> None:
        for key in keys:
            if key in self.serials:
                self.roles[self.serials[key]] = role

    def breakdown(self) -> dict[str, int]:
        """Bytes per role of the storages live at the highest peak (they sum to that peak)."""
        totals: dict[str, int] = {}
        for serial in self.at_peak:
            role = self.roles[serial]
            totals[role] = totals.get(role, 0) + self.sizes[serial]
        return totals


class LiveBytes:
    """Counts the bytes of live storages and raises ``torch.OutOfMemoryError`` past ``limit_bytes``.

    ``rounding_bytes`` rounds every storage up like the CUDA caching allocator (512-byte blocks);
    ``large_rounding_bytes`` rounds storages over 1 MiB to a coarser block (2 MiB segments).
    """

    def __init__(
        self,
        *,
        limit_bytes: int | None = None,
        rounding_bytes: int = 1,
        name: str = "device",
        large_rounding_bytes: int | None = None,
    ):
        if rounding_bytes < 1:
            raise InputError(f"rounding_bytes must be at least 1, got {rounding_bytes}")
        self.limit_bytes = limit_bytes
        self.rounding_bytes = rounding_bytes
        self.large_rounding_bytes = large_rounding_bytes
        self.name = name
        self.live_bytes = 0
        self.exact_live_bytes = 0  # without rounding: exactly linear in the batch size
        self.peak_bytes = 0
        self.timeline: list[int] = []
        self.exact_timeline: list[int] = []
        self.ledger: Ledger | None = None
        self._refs: dict[int, weakref.ref] = {}
        self.uncounted: frozenset[int] = frozenset()  # storage keys never counted while a mode is active
        self._restart_log()

    def _restart_log(self) -> None:
        """Forget the storages logged so far (``storage_log``): a new trial starts."""
        self._born: list[int] = []
        self._freed: list[int] = []
        self._made_nbytes: list[int] = []
        self._open: dict[int, int] = {}  # storage key -> its index in the lists, while it lives

    def _rounded(self, nbytes: int) -> int:
        block = self.rounding_bytes
        if self.large_rounding_bytes is not None and nbytes > LARGE_BLOCK_OVER_BYTES:
            block = self.large_rounding_bytes
        return -(-nbytes // block) * block

    def _release(self, key: int, nbytes: int, exact_nbytes: int) -> None:
        index = self._open.pop(key, None)
        if index is not None:
            self._freed[index] = len(self.timeline)
        if self._refs.pop(key, None) is not None:
            self.live_bytes -= nbytes
            self.exact_live_bytes -= exact_nbytes

    def track(self, tensor: Any) -> int:
        """Count ``tensor``'s storage if it is not counted yet; return the bytes it added."""
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return 0
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._refs or key in self.uncounted:
            return 0
        exact_nbytes = storage.nbytes()
        if exact_nbytes == 0:
            return 0
        nbytes = self._rounded(exact_nbytes)
        self._refs[key] = weakref.ref(storage, lambda _ref, k=key, n=nbytes, e=exact_nbytes: self._release(k, n, e))
        self._open[key] = len(self._born)
        self._born.append(len(self.timeline))
        self._freed.append(-1)
        self._made_nbytes.append(exact_nbytes)
        self.live_bytes += nbytes
        self.exact_live_bytes += exact_nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.ledger is not None:
            self.ledger.created(key, nbytes)
            self.ledger.observe(self.live_bytes, self._refs)
        return nbytes

    def keys_of(self, tensors: Iterable[Any]) -> list[int]:
        """The storage keys of ``tensors`` (to tell the ledger their role)."""
        return [t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)]

    def track_all(self, tensors: Iterable[Any]) -> None:
        """Count tensors that existed before the trial (parameters, buffers, optimizer state)."""
        for tensor in tensors:
            self.track(tensor)

    def storage_log(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every storage counted since ``mode()`` began: the index of the first ``timeline`` entry
        that counts it, of the first that no longer does (the timeline's length if it still
        lives), and its bytes before rounding. Two trials' logs give each storage's line in the
        batch size (``batchfit.search.memory_model.StorageLines``)."""
        freed = np.array(self._freed, dtype=np.int64)
        return (
            np.array(self._born, dtype=np.int64),
            np.where(freed < 0, len(self.timeline), freed),
            np.array(self._made_nbytes, dtype=np.int64),
        )

    def rounded(self, sizes: np.ndarray) -> np.ndarray:
        """``sizes`` (bytes) rounded up to the blocks this counter counts them in."""
        block = np.full_like(sizes, self.rounding_bytes)
        if self.large_rounding_bytes is not None:
            block = np.where(sizes > LARGE_BLOCK_OVER_BYTES, self.large_rounding_bytes, block)
        return -(-sizes // block) * block

    def over_limit(self) -> bool:
        return self.limit_bytes is not None and self.live_bytes > self.limit_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def oom_message(self, nbytes: int) -> str:
        return (
            f"{self.name} out of memory: tried to allocate {format_bytes(nbytes)} with "
            f"{format_bytes(self.live_bytes - nbytes)} live of {format_bytes(self.limit_bytes)} "
            f"({self.live_bytes} bytes requested in all, limit {self.limit_bytes} bytes). "
            f"Simulated; worded like the CPU allocator for other tools: {PEER_OOM_WORDING}."
        )

    def mode(self, uncounted: Iterable[Any] = ()) -> TorchDispatchMode:
        """A dispatch mode that counts what every op reads and makes while it is active, except
        the storages of ``uncounted`` tensors, and appends the live bytes after each op to
        ``timeline`` and ``exact_timeline`` (cleared here)."""
        self.timeline = []
        self.exact_timeline = []
        self._restart_log()
        return _CountingMode(self, frozenset(self.keys_of(uncounted)))


def _tensors_in(value: Any) -> Iterable[Any]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


class _CountingMode(TorchDispatchMode):
    def __init__(self, counter: LiveBytes, uncounted: frozenset[int] = frozenset()):
        super().__init__()
        self.counter = counter
        self.uncounted = uncounted  # storage keys of host data (the sample): read, never counted

    def __enter__(self) -> _CountingMode:
        self.counter.uncounted = self.uncounted  # only while active: a freed key may be reused later
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self.counter.uncounted = frozenset()
        return super().__exit__(*exc_info)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        counter = self.counter
        for arg in args:
            for tensor in _tensors_in(arg):
                counter.track(tensor)
        out = func(*args, **(kwargs or {}))
        requested = sum(counter.track(tensor) for tensor in _tensors_in(out))
        if counter.over_limit():
            message = counter.oom_message(requested)
            del out  # a real allocator never hands out the block: nothing may keep it alive
            raise torch.OutOfMemoryError(message)
        counter.timeline.append(counter.live_bytes)
        counter.exact_timeline.append(counter.exact_live_bytes)
        return out
