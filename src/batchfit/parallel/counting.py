"""One rank's live bytes under FSDP2: every storage it holds, by role, on fake or real tensors.

The repository's ``LiveBytes`` counts the storage of every tensor an op reads or makes, which
misses two things FSDP2 does. A DTensor (a sharded parameter, its gradient, its optimizer state)
is a wrapper whose own storage has the *global* size and allocates nothing; the rank holds only
its local shard, so wrappers are opened (``__tensor_flatten__``) and their inner tensors
counted. And FSDP2 gathers parameters into storages it grows and shrinks with
``UntypedStorage.resize_`` (never an op a dispatch mode sees), so ``resize_`` is watched while
``measuring()`` is active: a storage is counted at its size after each resize.

Storages are rounded up like the CUDA caching allocator (512-byte blocks) and tagged with a role
(the ``Ledger`` of ``batchfit.devices.accounting``), so the peak splits into categories.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from batchfit.devices.accounting import Ledger
from batchfit.devices.loss_storage import REDUCED_LOSS_OPS
from batchfit.devices.loss_storage import with_kept_storage
from batchfit.devices.simulated import CUDA_BLOCK_BYTES

# Ops whose outputs are communication buffers: FSDP2's copy-in/chunk-cat and the collectives.
COMMUNICATION_NAMESPACES = frozenset({"fsdp", "c10d", "_c10d_functional"})
GATHERED_ROLE = "unsharded_parameters"  # storages grown by resize_: FSDP2's all-gather outputs


def plain_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``value``'s memory: itself, or a wrapper subclass's inner tensors."""
    if not isinstance(value, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        for name in names:
            yield from plain_tensors(getattr(value, name))
    elif value.layout == torch.strided:
        yield value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (nested lists, tuples and dicts), in order: the
    leaves ``torch.utils._pytree`` finds there, without its generic (and slower) machinery.

    >>> [t.shape[0] for t in tensors_in(([torch.zeros(1), 2], {"out": (torch.zeros(3), None)}))]
    [1, 3]
    """
    found: list[torch.Tensor] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            pending.extend(reversed(item))
        elif isinstance(item, dict):
            pending.extend(reversed(list(item.values())))
    return found


class PeakMoment(NamedTuple):
    """A peak: its bytes, the ledger serials of the storages live then, and the phase it fell in."""

    peak_bytes: int
    serials: tuple[int, ...]
    phase: str


class RankBytes:
    """Live and peak bytes of one rank's storages, each with a role in ``ledger``.

    >>> counter = RankBytes()
    >>> ids = torch.zeros(10)
    >>> counter.track(ids, role="batch")
    >>> counter.live_bytes, counter.breakdown()
    (512, {'batch': 512})
    >>> del ids
    >>> counter.live_bytes, counter.peak_bytes
    (0, 512)
    """

    def __init__(self, rounding_bytes: int = CUDA_BLOCK_BYTES):
        self.rounding_bytes = rounding_bytes
        self.sizes: dict[int, int] = {}  # storage key -> counted bytes
        self._refs: dict[int, weakref.ref] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase_peak_bytes = 0  # the peak since start_phase()
        self.tag = "temporaries"  # the role of storages that appear without one
        self.ledger = Ledger()
        self.earlier_peak: PeakMoment | None = None  # the peak before split_peak(), in this ledger
        # A real backend's worker thread (gloo) may drop the last reference to a communication
        # buffer, so a storage can be released on another thread while this one counts.
        self._lock = threading.RLock()

    def rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.rounding_bytes) * self.rounding_bytes

    def track(self, value: Any, role: str | None = None) -> None:
        """Count the storages under ``value`` not counted yet, with ``role`` (else the current ``tag``)."""
        if (
            isinstance(value, torch.Tensor)
            and value.layout == torch.strided
            and not is_traceable_wrapper_subclass(value)
        ):
            self._track_storage(value.untyped_storage(), role)  # a plain tensor: most of them, the short way
            return
        for tensor in plain_tensors(value):
            self._track_storage(tensor.untyped_storage(), role)

    def track_all(self, values: Iterable[Any], role: str) -> None:
        for value in values:
            self.track(value, role)

    def _track_storage(self, storage: torch.UntypedStorage, role: str | None) -> None:
        key = storage._cdata
        if key in self.sizes:
            return
        exact = storage.nbytes()
        if exact == 0:
            return
        nbytes = self.rounded(exact)
        with self._lock:
            self.sizes[key] = nbytes
            self._refs[key] = weakref.ref(storage, lambda _ref, k=key: self._forget(k))
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.phase_peak_bytes = max(self.phase_peak_bytes, self.live_bytes)
            self.ledger.tag = role or self.tag
            self.ledger.created(key, nbytes)
            self.ledger.observe(self.live_bytes, self.sizes)

    def _forget(self, key: int) -> None:
        with self._lock:
            nbytes = self.sizes.pop(key, None)
            if nbytes is not None:
                self.live_bytes -= nbytes
                self._refs.pop(key, None)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized: count it anew at its new size (none when freed to 0)."""
        self._forget(storage._cdata)
        self._track_storage(storage, GATHERED_ROLE)

    def assign(self, values: Iterable[Any], role: str) -> None:
        """Give the live storages under ``values`` the role ``role``."""
        keys = [t.untyped_storage()._cdata for value in values for t in plain_tensors(value)]
        self.ledger.assign(keys, role)

    def bytes_of(self, values: Iterable[Any]) -> int:
        """Counted bytes of the live storages under ``values``, each storage once."""
        keys = {t.untyped_storage()._cdata for value in values for t in plain_tensors(value)}
        return sum(self.sizes.get(key, 0) for key in keys)

    def role_of(self, key: int) -> str:
        return self.ledger.roles[self.ledger.serials[key]]

    def live_keys_with(self, role: str) -> list[int]:
        return [key for key in self.sizes if self.role_of(key) == role]

    def start_phase(self, phase: str) -> None:
        """From now on storages are made in ``phase`` (the ledger's phase), whose own peak starts here."""
        self.ledger.phase = phase
        self.phase_peak_bytes = self.live_bytes

    def restart_peak(self) -> None:
        """Forget the peak so far: the peak and its breakdown cover only what happens from now on."""
        old, self.ledger = self.ledger, Ledger()
        for key, nbytes in self.sizes.items():
            self.ledger.tag = old.roles[old.serials[key]]
            self.ledger.created(key, nbytes)
        self.ledger.phase = old.phase
        self.peak_bytes = self.live_bytes
        self.earlier_peak = None
        self.ledger.observe(self.live_bytes, self.sizes)

    def split_peak(self) -> None:
        """Keep the peak so far as ``earlier_peak`` and take the peak anew from now on, in the
        same ledger: both peaks' storages keep the roles later assigned to them."""
        ledger = self.ledger
        self.earlier_peak = PeakMoment(self.peak_bytes, tuple(ledger.at_peak), ledger.peak_phase)
        ledger.max_bytes = -1
        self.peak_bytes = self.live_bytes
        ledger.observe(self.live_bytes, self.sizes)

    def later_peak(self) -> PeakMoment:
        """The peak since ``split_peak`` (or ``restart_peak``): its bytes, storages and phase."""
        return PeakMoment(self.peak_bytes, tuple(self.ledger.at_peak), self.ledger.peak_phase)

    def breakdown_at(self, moment: PeakMoment) -> dict[str, int]:
        """Bytes by role (as assigned now) of the storages live at ``moment``; they sum to its bytes."""
        totals: dict[str, int] = {}
        ledger = self.ledger
        for serial in moment.serials:
            role = ledger.roles[serial]
            totals[role] = totals.get(role, 0) + ledger.sizes[serial]
        return totals

    def released_by_role(self, release: Callable[[], None]) -> dict[str, int]:
        """Call ``release`` (which drops references) and return the bytes it freed, by role."""
        with self._lock:
            before = {key: (nbytes, self.role_of(key)) for key, nbytes in self.sizes.items()}
        release()
        freed: dict[str, int] = {}
        for key in before.keys() - self.sizes.keys():
            nbytes, role = before[key]
            freed[role] = freed.get(role, 0) + nbytes
        return freed

    def breakdown(self) -> dict[str, int]:
        """Bytes by role at the peak (they sum to ``peak_bytes``)."""
        return self.ledger.breakdown()

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Count what every op reads and makes, and every ``UntypedStorage.resize_``, while active
        (``resize_`` is restored on the way out)."""
        own = torch.UntypedStorage.__dict__.get("resize_")  # None: the method is inherited
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            self.resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        try:
            with _CountingMode(self):
                yield
        finally:
            if own is None:
                del torch.UntypedStorage.resize_  # back to the inherited method, as before
            else:
                torch.UntypedStorage.resize_ = own


class _CountingMode(TorchDispatchMode):
    def __init__(self, counter: RankBytes):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        for tensor in tensors_in((args, kwargs)):
            counter.track(tensor)
        out = func(*args, **kwargs)
        if func in REDUCED_LOSS_OPS:  # a fake kernel's scalar loss, without the storage the real one keeps
            out = with_kept_storage(func, args, kwargs, out)
        role = "communication" if func.namespace in COMMUNICATION_NAMESPACES else None
        for tensor in tensors_in(out):
            counter.track(tensor, role)
        return out


class HostAndDeviceBytes(RankBytes):
    """A ``RankBytes`` for the device whose storages on the CPU go to a second one, ``host``:
    one rank on a fake accelerator (``batchfit.parallel.accelerator``), where FSDP2's CPU offload
    keeps the sharded state on the host. Roles, phases and peaks are kept in both.

    >>> counter = HostAndDeviceBytes()
    >>> state = torch.zeros(256)  # on the CPU: the host
    >>> counter.track(state, role="optimizer_state")
    >>> counter.live_bytes, counter.host.live_bytes, counter.host.breakdown()
    (0, 1024, {'optimizer_state': 1024})
    """

    def __init__(self, rounding_bytes: int = CUDA_BLOCK_BYTES):
        super().__init__(rounding_bytes)
        self.host = RankBytes(rounding_bytes)

    def track(self, value: Any, role: str | None = None) -> None:
        for tensor in plain_tensors(value):
            if tensor.device.type == "cpu":
                self.host._track_storage(tensor.untyped_storage(), role)
            else:
                self._track_storage(tensor.untyped_storage(), role)

    def resized(self, storage: torch.UntypedStorage) -> None:
        if storage._cdata in self.host.sizes:
            self.host.resized(storage)
        else:
            super().resized(storage)

    def assign(self, values: Iterable[Any], role: str) -> None:
        # by device: a host storage's key may equal that of a freed device storage
        tensors = [tensor for value in values for tensor in plain_tensors(value)]
        super().assign([tensor for tensor in tensors if tensor.device.type != "cpu"], role)
        self.host.assign([tensor for tensor in tensors if tensor.device.type == "cpu"], role)

    def start_phase(self, phase: str) -> None:
        super().start_phase(phase)
        self.host.start_phase(phase)

    def restart_peak(self) -> None:
        super().restart_peak()
        self.host.restart_peak()
