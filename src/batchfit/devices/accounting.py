"""Live-bytes accounting: count every tensor storage alive while a trial runs.

A ``TorchDispatchMode`` sees every op below autograd (forward, backward and optimizer ops alike).
Each storage an op reads or makes is counted once, when first seen, and uncounted when the
storage is freed (a weak reference to the untyped storage: PyTorch keeps a storage's Python
object alive as long as the storage itself, so the callback fires when the memory is released).

Two things sharded training (FSDP2) does that no dispatch mode sees as memory are counted too:
- a DTensor (a sharded parameter, its gradient, its optimizer state) is a wrapper whose own
  storage reports the global size and allocates nothing: wrappers are opened down to their local
  tensors, which hold the rank's memory;
- FSDP2 grows and frees its all-gathered parameters with ``UntypedStorage.resize_``, which is no
  op: while a mode is active ``resize_`` is watched (and restored on the way out, also after an
  error), so a storage counts at its size after each resize, from the resize on. A resize made while
  no mode watched (FSDP2 brought to rest after a step that raised frees its gathered copies
  outside the trial: ``batchfit.step.state.reset_sharded_iteration``) is counted when the next mode
  begins or tensors are registered.

With a caching allocator (``batchfit.devices.caching_allocator``), every storage counted is also a request to
it and every storage freed a free: a step fits when the allocator serves every request within the capacity, as
on a GPU, not when the live bytes fit; the reserved bytes and their peak are the allocator's.

An out-of-memory error is raised where the allocation passed the limit, as CUDA raises it, also
inside a sharded model's step: FSDP2 is brought back to rest after it (``reset_sharded_iteration``).
One case runs on: a rank of a process group whose collectives really run (``torchrun`` with gloo
or NCCL, each rank on a simulated device of its own) cannot stop its sharded step half-way, since
the other ranks would wait in its next collective or join the wrong one. A counter holding DTensor
shards there lets the step run past the limit to the end of the ``mode()`` block and raises the
error then, with the message of the first allocation that passed the limit (the rank's real memory
may pass the capacity meanwhile, by what that one trial needs). One rank over torch's fake process
group (``batchfit.parallel.one_rank``) has no peers to wait: its errors come at once.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import deque
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from batchfit.devices.caching_allocator import Block
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.devices.interrupts import raise_if_interrupted
from batchfit.devices.interrupts import shield_code
from batchfit.devices.loss_storage import REDUCED_LOSS_OPS
from batchfit.devices.loss_storage import with_kept_storage
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError

# A Ctrl-C never raises inside this module's code (a second one included: see ``batchfit.devices.interrupts``):
# the weak-reference callback that uncounts a freed storage would drop it half-way, a count half-updated.
shield_code(__file__)

# The simulated OOM message carries the CPU allocator's wording so that tools matching OOMs by
# message (Lightning, accelerate) recognise it as well.
PEER_OOM_WORDING = "DefaultCPUAllocator: can't allocate memory"


def local_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors holding ``tensor``'s memory: itself, or a wrapper subclass's inner tensors (a
    DTensor's local shard), opened all the way down.

    >>> [t.shape for t in local_tensors(torch.zeros(2, 3))]
    [torch.Size([2, 3])]
    """
    if type(tensor) is not torch.Tensor and is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # a flattened name may hold no tensor (a mesh)
                yield from local_tensors(inner)
    else:
        yield tensor


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

    ``rounding_bytes`` rounds every storage up like the CUDA caching allocator (512-byte blocks). With an
    ``allocator`` (a ``CachingAllocator`` whose capacity is the limit), the out-of-memory error comes where it
    cannot serve a request, and ``reserved_bytes`` and ``peak_reserved_bytes`` are its own.
    """

    def __init__(
        self,
        *,
        limit_bytes: int | None = None,
        rounding_bytes: int = 1,
        name: str = "device",
        allocator: CachingAllocator | None = None,
    ):
        if rounding_bytes < 1:
            raise InputError(f"rounding_bytes must be at least 1, got {rounding_bytes}")
        self.limit_bytes = limit_bytes
        self.rounding_bytes = rounding_bytes
        self.allocator = allocator
        self.allocator_at_start: CachingAllocator | None = None  # its state when the last mode() began
        self.unserved_bytes: int | None = None  # a request the allocator could not serve, until it is raised
        self.name = name
        self.live_bytes = 0
        self.exact_live_bytes = 0  # without rounding: exactly linear in the batch size
        self.peak_bytes = 0
        self.timeline: list[int] = []
        self.exact_timeline: list[int] = []
        self.ledger: Ledger | None = None
        # storage key -> (ref, bytes, exact bytes, the allocator's block or None)
        self._refs: dict[int, tuple[weakref.ref, int, int, Block | None]] = {}
        self.uncounted: frozenset[int] = frozenset()  # storage keys never counted while a mode is active
        # A process group's worker thread (gloo) may drop the last reference to a buffer: such a
        # release is queued, and settled by the counting thread before it next counts, so two
        # threads never change the counts at once (and no lock slows the counting down).
        self._thread = threading.get_ident()
        self._released_elsewhere: deque[tuple[int, weakref.ref]] = deque()
        self._sharded_keys: set[int] = set()  # storage keys of DTensors' local shards (sharded state)
        self._restart_log()

    def _restart_log(self) -> None:
        """Forget the storages logged so far (``storage_log``): a new trial starts."""
        self._born: list[int] = []
        self._freed: list[int] = []
        self._made_nbytes: list[int] = []
        self._events: list[int] = []  # index + 1 when a logged storage is made, -(index + 1) when it is freed
        self._open: dict[int, int] = {}  # storage key -> its index in the lists, while it lives
        self._marks: list[tuple[int, str]] = []  # (position in _events, what begins there): steps and phases

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.rounding_bytes) * self.rounding_bytes

    def _released(self, key: int, ref: weakref.ref) -> None:
        """The storage ``key`` (its weak reference ``ref``) was freed, maybe on another thread."""
        if threading.get_ident() == self._thread:
            self._forget(key, ref)
        else:
            self._released_elsewhere.append((key, ref))

    def settle(self) -> None:
        """Uncount the storages freed on other threads since the last call."""
        while self._released_elsewhere:
            self._forget(*self._released_elsewhere.popleft())

    def _forget(self, key: int, ref: weakref.ref | None = None) -> None:
        """Uncount the storage ``key`` (only if ``ref`` is still its reference, when given)."""
        entry = self._refs.get(key)
        if entry is None or (ref is not None and entry[0] is not ref):
            return
        del self._refs[key]
        index = self._open.pop(key, None)
        if index is not None:
            self._freed[index] = len(self.timeline)
            self._events.append(-(index + 1))
        self.live_bytes -= entry[1]
        self.exact_live_bytes -= entry[2]
        if entry[3] is not None:
            self.allocator.free(entry[3])

    def track(self, tensor: Any) -> int:
        """Count ``tensor``'s storage if it is not counted yet (a wrapper subclass such as a
        DTensor: its local tensors' storages); return the bytes it added."""
        if not isinstance(tensor, torch.Tensor):
            return 0
        if type(tensor) is not torch.Tensor and is_traceable_wrapper_subclass(tensor):
            return self._track_wrapper(tensor)
        if tensor.layout != torch.strided:
            return 0
        storage = tensor.untyped_storage()
        if storage._cdata in self._refs and not (self._released_elsewhere and self._reused(storage._cdata)):
            return 0  # counted already: most tensors an op reads
        return self._count(storage)

    def _track_wrapper(self, tensor: torch.Tensor) -> int:
        added = 0
        sharded = _is_dtensor(tensor)
        for local in local_tensors(tensor):
            added += self.track(local)
            if sharded:
                self._sharded_keys.add(local.untyped_storage()._cdata)
        return added

    def steps_must_finish(self) -> bool:
        """True when a step measured now must run to its end even past the limit: this counter
        holds a DTensor's local shard (the model is sharded: FSDP2, tensor parallel) and other
        ranks really run its collectives with this one (``peers_wait``): stopped half-way, its step
        would leave them waiting in its next collective, or joining the wrong one."""
        self._sharded_keys = {key for key in self._sharded_keys if key in self._refs}
        return bool(self._sharded_keys) and peers_wait()

    def _count(self, storage: torch.UntypedStorage) -> int:
        key = storage._cdata
        if key in self.uncounted or key in self._refs:
            return 0
        exact_nbytes = storage.nbytes()
        if exact_nbytes == 0:
            return 0
        nbytes = self._rounded(exact_nbytes)
        block = None
        if self.allocator is not None:
            block = self.allocator.malloc(exact_nbytes)
            if block is None and self.unserved_bytes is None:
                self.unserved_bytes = exact_nbytes
        ref = weakref.ref(storage, lambda dead, k=key: self._released(k, dead))
        self._refs[key] = (ref, nbytes, exact_nbytes, block)
        self._open[key] = len(self._born)
        self._events.append(len(self._born) + 1)
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

    def _reused(self, key: int) -> bool:
        """Whether ``key``, counted, belongs to a storage freed on another thread (so this is a
        new storage at the same address), once those releases are settled."""
        self.settle()
        return key not in self._refs

    def resized(self, storage: torch.UntypedStorage) -> int:
        """``storage`` was just resized (``UntypedStorage.resize_``): uncounted at its old size,
        counted anew at its new one (none after ``resize_(0)``), as if freed and made now;
        returns the bytes it adds."""
        if storage._cdata in self.uncounted:
            return 0
        self._forget(storage._cdata)
        return self._count(storage)

    def keys_of(self, tensors: Iterable[Any]) -> list[int]:
        """The storage keys of ``tensors`` (to tell the ledger their role): a wrapper subclass's
        (a DTensor's) are its local tensors'."""
        return [
            local.untyped_storage()._cdata
            for tensor in tensors
            if isinstance(tensor, torch.Tensor)
            for local in local_tensors(tensor)
        ]

    def track_all(self, tensors: Iterable[Any]) -> None:
        """Count tensors that existed before the trial (parameters, buffers, optimizer state), and
        the storages resized since a mode last watched (``recount_resized``)."""
        self.recount_resized()
        for tensor in tensors:
            self.track(tensor)

    def recount_resized(self) -> None:
        """Count again, at their size now, the counted storages resized while no mode watched
        ``resize_``: FSDP2 brought to rest after a step that raised frees its gathered copies with
        ``resize_(0)`` outside the trial (``batchfit.step.state.reset_sharded_iteration``)."""
        self.settle()
        for ref, _, exact_nbytes, _ in list(self._refs.values()):
            storage = ref()
            if storage is not None and storage.nbytes() != exact_nbytes:
                self.resized(storage)

    def mark(self, label: str) -> None:
        """Note that ``label`` begins here in the event log: ``"step"`` before each step of a trial, ``"end"``
        after its last, a phase's name where one ends (``step_marks`` reads them back)."""
        self._marks.append((len(self._events), label))

    def step_marks(self) -> list[tuple[int, str]]:
        """The marks since ``mode()`` began: (position in ``event_log``, label), in order."""
        return list(self._marks)

    def event_log(self) -> np.ndarray:
        """The order storages were made and freed since ``mode()`` began: ``i + 1`` when the storage ``i`` of
        ``storage_log`` was made, ``-(i + 1)`` when it was freed (what the allocator saw, in order)."""
        return np.array(self._events, dtype=np.int64)

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
        return -(-sizes // self.rounding_bytes) * self.rounding_bytes

    def over_limit(self) -> bool:
        """Past the limit: a request the allocator could not serve, or (counting exactly) more live bytes."""
        if self.allocator is not None:
            return self.unserved_bytes is not None
        return self.limit_bytes is not None and self.live_bytes > self.limit_bytes

    @property
    def reserved_bytes(self) -> int | None:
        """What the allocator holds from the device (``None``: no allocator, bytes counted exactly)."""
        return self.allocator.stats.reserved_bytes if self.allocator is not None else None

    @property
    def peak_reserved_bytes(self) -> int | None:
        return self.allocator.stats.peak_reserved_bytes if self.allocator is not None else None

    def empty_cache(self) -> None:
        """Give the allocator's cached blocks back (``torch.cuda.empty_cache``); nothing when counting exactly."""
        if self.allocator is not None:
            self.allocator.empty_cache()

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        if self.allocator is not None:
            self.allocator.reset_peak()

    def oom_message(self, nbytes: int) -> str:
        """The out-of-memory error's message; clears the request the allocator could not serve."""
        if self.allocator is not None and self.unserved_bytes is not None:
            return self._allocator_oom_message()
        return (
            f"{self.name} out of memory: tried to allocate {format_bytes(nbytes)} with "
            f"{format_bytes(self.live_bytes - nbytes)} live of {format_bytes(self.limit_bytes)} "
            f"({self.live_bytes} bytes requested in all, limit {self.limit_bytes} bytes). "
            f"Simulated; worded like the CPU allocator for other tools: {PEER_OOM_WORDING}."
        )

    def _allocator_oom_message(self) -> str:
        """Worded as CUDA's caching allocator words it, so that what matches its message matches this one."""
        requested, self.unserved_bytes = self.unserved_bytes, None
        stats = self.allocator.stats
        return (
            f"{self.name} out of memory (CUDA out of memory, simulated): tried to allocate {format_bytes(requested)}; "
            f"{format_bytes(stats.allocated_bytes)} allocated, "
            f"{format_bytes(stats.reserved_bytes - stats.allocated_bytes)} reserved but unallocated, "
            f"{format_bytes(self.allocator.free_bytes())} free of {format_bytes(self.allocator.capacity_bytes)}. "
            "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            f"to avoid fragmentation. Worded like the CPU allocator for other tools: {PEER_OOM_WORDING}."
        )

    def mode(self, uncounted: Iterable[Any] = ()) -> TorchDispatchMode:
        """A dispatch mode that counts what every op reads and makes while it is active, except
        the storages of ``uncounted`` tensors, and appends the live bytes after each op to
        ``timeline`` and ``exact_timeline`` (cleared here)."""
        self.recount_resized()
        self.timeline = []
        self.exact_timeline = []
        self._restart_log()
        self._thread = threading.get_ident()
        self.unserved_bytes = None
        self.allocator_at_start = self.allocator.copy() if self.allocator is not None else None
        return _CountingMode(self, frozenset(self.keys_of(uncounted)))


def peers_wait() -> bool:
    """True under a process group of two ranks or more whose collectives really run (``torchrun``
    with gloo or NCCL), where a rank's sharded step must not stop half-way; ``False`` without one,
    and over torch's fake process group (every backend ``fake``: collectives return at once, no
    rank waits). ``torch.distributed`` is never imported here.

    >>> peers_wait()
    False
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    backends = [entry.rpartition(":")[2] for entry in dist.get_backend_config().split(",")]  # "cpu:fake,cuda:fake"
    return any(backend != "fake" for backend in backends)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # imported by whoever made a DTensor
    return module is not None and isinstance(tensor, module.DTensor)


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
        self._resize_before: Any = None  # UntypedStorage's own resize_ entry before __enter__
        self.defer_oom = False  # a sharded model's rank: its step runs on, the error is raised at exit
        self.deferred_oom: str | None = None  # the message of the first allocation past the limit

    def __enter__(self) -> _CountingMode:
        self.counter.uncounted = self.uncounted  # only while active: a freed key may be reused later
        self.defer_oom = self.counter.steps_must_finish()
        self.deferred_oom = None
        entered = super().__enter__()
        self._watch_resize()
        return entered

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._unwatch_resize()
        finally:
            self.counter.uncounted = frozenset()
            super().__exit__(*exc_info)
            self.counter.settle()
        if self.deferred_oom is not None and exc_info[0] is None:
            raise torch.OutOfMemoryError(self.deferred_oom)

    def _oom_now(self, requested: int) -> str | None:
        """The counter is past its limit: the out-of-memory message to raise now, or ``None`` when
        the step must run on (the first such message is then kept for ``__exit__``)."""
        message = self.counter.oom_message(requested)
        if not self.defer_oom:
            return message
        if self.deferred_oom is None:
            self.deferred_oom = f"{message} Raised when the step ended: a sharded model's step cannot stop half-way."
        return None

    def _watch_resize(self) -> None:
        """Count every ``UntypedStorage.resize_`` (no op a dispatch mode sees) while active."""
        self._resize_before = torch.UntypedStorage.__dict__.get("resize_")
        original = torch.UntypedStorage.resize_
        counter = self.counter

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before_nbytes = storage.nbytes()
            result = original(storage, size)
            requested = counter.resized(storage)
            if counter.over_limit() and (message := self._oom_now(requested)) is not None:
                original(storage, before_nbytes)  # a real allocator leaves the storage as it was
                counter.resized(storage)
                raise torch.OutOfMemoryError(message)
            counter.timeline.append(counter.live_bytes)
            counter.exact_timeline.append(counter.exact_live_bytes)
            return result

        torch.UntypedStorage.resize_ = resize_

    def _unwatch_resize(self) -> None:
        if self._resize_before is None:
            del torch.UntypedStorage.resize_  # back to the method it inherits
        else:
            torch.UntypedStorage.resize_ = self._resize_before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A deferred Ctrl-C: here, where every count is whole; never at a prim query (``prim.device``), which C++
        # asks from code that cannot pass a Python error on (raised there, the process aborts).
        if getattr(func, "namespace", None) != "prim":
            raise_if_interrupted()
        counter = self.counter
        if counter._released_elsewhere:
            counter.settle()
        for arg in args:
            for tensor in _tensors_in(arg):
                counter.track(tensor)
        out = func(*args, **(kwargs or {}))
        if func in REDUCED_LOSS_OPS:  # a fake kernel's reduced loss lacks the storage the real one keeps
            out = with_kept_storage(func, args, kwargs or {}, out)
        requested = sum(counter.track(tensor) for tensor in _tensors_in(out))
        if counter.over_limit() and (message := self._oom_now(requested)) is not None:
            del out  # a real allocator never hands out the block: nothing may keep it alive
            raise torch.OutOfMemoryError(message)
        counter.timeline.append(counter.live_bytes)
        counter.exact_timeline.append(counter.exact_live_bytes)
        return out
