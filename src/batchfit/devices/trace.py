"""TraceDevice: the simulated device's accounting with nothing computed and nothing allocated.

The workload is copied with every tensor replaced by a fake one (``FakeTensorMode``, CPU
kernels: shapes, dtypes and storages, no data), so a trial at batch 4096 costs about what one
at batch 1 costs. The meta device is not used: it decomposes scaled-dot-product attention and
over-counts transformers. The user's model and optimizer are never touched. This module holds
the device, the copy of the workload it traces, and ``as_trace_device`` (what an estimate runs on).

Two guards keep the trace honest. An op whose fake kernel makes less than the real one (the CPU
LSTM's workspace, col2im's storage) gets what it lacks where its size is known, counted like any
output; where it is not (an unmeasured dtype, a torch build whose kernel disagrees), the op is
recorded in ``TraceDevice.undercounted_ops``, so an estimate can say it is a lower bound: see
``undercounts`` (``UNDERCOUNTING_OPS``, ``lstm_workspace_bytes``). And an error on fake tensors is
sorted by ``is_users_error``: the user's own ``ValueError``/``TypeError`` (it would raise on the
real device too) against what fake tensors cannot do (a ``TraceError``: fall back to real
probing): see ``trace_errors``.

Stock layers that ask their data a question (``nn.TransformerEncoder`` checking whether a mask is
causal, ``nn.GaussianNLLLoss`` its variances, ``nn.AdaptiveLogSoftmaxWithLoss`` picking rows by
target, ``nn.CTCLoss`` and ``pack_padded_sequence`` reading lengths) get the answer the real step
gets: the trace keeps real copies of the values it can know (from the sample and buffers, never the
parameters; see ``fake_values``). The nested-tensor fast path of ``nn.TransformerEncoder`` runs on
a dense stand-in of the nested buffer's size (see ``value_rules``). What is left, a question about
values made from the parameters, is a one-line ``TraceError``.

The names other modules use from those modules (``tracing``, ``is_users_error``,
``undercount_message``, ``UNDERCOUNTING_OPS``, ...) are importable from here too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterable
from collections.abc import Iterator

import torch

from batchfit.devices.accounting import LiveBytes
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.allocator_settings import allocator_label
from batchfit.devices.allocator_settings import resolve_allocator
from batchfit.devices.base import CountingDevice
from batchfit.devices.cuda_autocast import cuda_autocast
from batchfit.devices.cuda_kernels import CUBLAS_HANDLES
from batchfit.devices.cuda_kernels import CudaScratch
from batchfit.devices.cuda_kernels import CudaTarget
from batchfit.devices.cuda_kernels import cublas_workspace_bytes
from batchfit.devices.cuda_kernels import cuda_attention
from batchfit.devices.cuda_kernels import cuda_dropout
from batchfit.devices.fake_values import TraceFakeMode
from batchfit.devices.presets import ACCELERATORS
from batchfit.devices.presets import is_preset
from batchfit.devices.presets import preset
from batchfit.devices.presets import usable_bytes
from batchfit.devices.simulated import CUDA_BLOCK_BYTES
from batchfit.devices.simulated import SimulatedDevice
from batchfit.devices.simulated import modelled_allocator
from batchfit.devices.trace_errors import is_users_error
from batchfit.devices.trace_errors import trace_error
from batchfit.devices.trace_errors import tracing
from batchfit.devices.transformers_checks import real_value_checks
from batchfit.devices.undercounts import UNDERCOUNTING_OPS
from batchfit.devices.undercounts import UndercountWatch
from batchfit.devices.undercounts import lstm_workspace_bytes
from batchfit.devices.undercounts import undercount_message
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes
from batchfit.errors import InputError
from batchfit.step.batching import map_tensors
from batchfit.step.workload import Workload

__all__ = [  # with the names moved to trace_errors and undercounts that callers import from here
    "TRACE_DEVICE_HELP",
    "UNDERCOUNTING_OPS",
    "UNLIMITED_BYTES",
    "WORKSPACES",
    "TraceDevice",
    "as_trace_device",
    "is_users_error",
    "lstm_workspace_bytes",
    "trace_capacity_bytes",
    "trace_error",
    "traced_before",
    "tracing",
    "undercount_message",
]

WORKSPACES = "workspaces"  # the ledger's role of what a GPU's libraries hold beside the tensors (cuBLAS)
UNLIMITED_BYTES = 1 << 60  # a capacity no trace reaches: an estimate measures the whole peak
TRACE_DEVICE_HELP = (
    "give a TraceDevice or SimulatedDevice, 'trace:CAPACITY' or 'sim:CAPACITY' (e.g. 'sim:40GiB'), "
    "a GPU preset such as 'a100-40gb', a capacity such as '40GiB' or a byte count, or None"
)


def is_cuda_preset(capacity: object) -> bool:
    """Whether ``capacity`` names a GPU that runs PyTorch's CUDA caching allocator (NVIDIA, and AMD's ROCm,
    whose HIP allocator is the same code); Apple's presets run MPS's own."""
    return isinstance(capacity, str) and is_preset(capacity) and not capacity.strip().lower().startswith("apple")


def target_of(capacity: object) -> CudaTarget | None:
    """The GPU a trace for ``capacity`` runs for: an NVIDIA or AMD preset's compute capability, else ``None``
    (a capacity in bytes says nothing of the kernels: the trace runs the CPU's)."""
    if not is_cuda_preset(capacity):
        return None
    return CudaTarget(sm=preset(capacity).compute_capability)


def trace_capacity_bytes(capacity: int | str, reserve_bytes: int | None = None) -> int:
    """Bytes from a size (``"40GiB"``) or a GPU preset name (``"a100-40gb"``)."""
    if isinstance(capacity, str) and is_preset(capacity):
        return usable_bytes(capacity, reserve_bytes)
    try:
        return parse_bytes(capacity)
    except ValueError:
        if not isinstance(capacity, str):
            raise
        names = ", ".join(ACCELERATORS)
        raise InputError(f"capacity {capacity!r} is neither a size like '40GiB' nor a GPU preset ({names})") from None


class _FakeWorkloadBuilder:
    """Copies a workload with fake tensors in place of real ones: nothing copied for real but the
    values the step may ask about (the sample and small buffers, see ``fake_values.SHADOW_MAX_BYTES``).

    The model's and the optimizer's fakes are made on ``device`` (the trace's) from a meta description of
    each tensor, wherever the real one lives (a GPU, ``meta``): the copy never moves (``Module.to`` would swap
    parameters, which torch refuses for one a weak reference points at), and the real tensors are only read."""

    def __init__(self, mode: TraceFakeMode, device: torch.device, foreach: bool = False):
        self.mode = mode
        self.device = device
        self.foreach = foreach  # the copy's optimizer runs foreach where torch would pick it for CUDA tensors

    def fake(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return self.mode.from_tensor(tensor, static_shapes=True)
        with torch.no_grad():
            meta = tensor.detach().to("meta")
        return self.mode.fake_tensor_converter.from_meta_and_device(self.mode, meta, self.device)

    def data(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fake of a tensor the step may ask for values (the sample, a buffer), with a real copy
        of them when small (see ``TraceFakeMode.keep_copy``; a ``meta`` tensor has none)."""
        fake = self.fake(tensor)
        if tensor.device.type != "meta":
            self.mode.keep_copy(fake, tensor)
        return fake

    def constant(self, tensor: torch.Tensor) -> torch.Tensor:
        # Scalars such as Adam's `step` must answer .item(): a constant fake, built from a host clone
        # because constant propagation writes into the tensor it was made from. One that lives with its
        # parameter (a capturable or fused optimizer's) is a plain fake on the trace's device.
        if tensor.device.type != "cpu":
            return self.fake(tensor)
        return self.mode.fake_tensor_converter.from_real_tensor(self.mode, tensor.clone(), make_constant=True)

    def memo(self, work: Workload) -> dict[int, torch.Tensor]:
        memo: dict[int, torch.Tensor] = {}
        for param in work.model.parameters():
            fake = torch.nn.Parameter(self.fake(param), requires_grad=param.requires_grad)
            if param.grad is not None:
                fake.grad = self.fake(param.grad)
            memo[id(param)] = fake
        for buffer in work.model.buffers():
            memo[id(buffer)] = self.data(buffer)
        if work.optimizer is not None:
            for entries in work.optimizer.state.values():
                for value in entries.values():
                    if isinstance(value, torch.Tensor):
                        memo[id(value)] = self.constant(value) if value.numel() == 1 else self.fake(value)
        return memo

    def build(self, work: Workload) -> Workload:
        memo = self.memo(work)
        model = copy.deepcopy(work.model, memo)
        optimizer = copy.deepcopy(work.optimizer, memo) if work.optimizer is not None else None
        if optimizer is not None and self.foreach:
            _foreach_as_on_cuda(optimizer)
        sample = map_tensors(self.data, work.sample_batch)
        return dataclasses.replace(work, model=model, optimizer=optimizer, sample_batch=sample)


def _foreach_as_on_cuda(optimizer: torch.optim.Optimizer) -> None:
    """torch's ``_default_to_fused_or_foreach`` (``torch/optim/optimizer.py``): where ``foreach`` and ``fused`` are
    left unset, plain parameters on CUDA run the ``foreach`` implementation, whose ``step`` holds a temporary as large
    as a whole group of them (``_foreach_sqrt`` of Adam's second moments). Fake parameters fail its type check, so
    the copy's groups say it outright."""
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


class TraceDevice(CountingDevice):
    """Estimate without the hardware: ``capacity`` is bytes, a size such as ``"40GiB"``, or a GPU
    preset such as ``"a100-40gb"`` (its usable memory after the per-process reserve).

    Storages are rounded to 512-byte blocks like the CUDA caching allocator. ``allocator`` says what
    decides a fit, as for ``SimulatedDevice``: ``"cuda"`` (the default for an NVIDIA or AMD preset) models
    PyTorch's caching allocator with this process's ``PYTORCH_CUDA_ALLOC_CONF``, so a size fits when the card's
    allocator could serve every request, fragmentation included; ``"cuda-expandable"`` the same with
    expandable segments; ``"exact"`` (the default for a capacity in bytes) counts live bytes. ``reserved=True``
    is the old name of ``allocator="cuda"``. ``device`` is where the fake tensors claim to be (the real
    device's type, so autocast picks the same kernels); the fake kernels run on the CPU. ``target`` (a
    ``CudaTarget``; by default the preset's, for an NVIDIA or AMD preset) makes the trace run what that GPU runs
    where the CPU would run something else: scaled-dot-product attention takes the kernel CUDA would choose and
    dropout CUDA's fused kernel (``batchfit.devices.cuda_kernels``), autocast casts by CUDA's lists
    (``batchfit.devices.cuda_autocast``), and an optimizer that leaves ``foreach`` and ``fused`` unset runs
    ``foreach``, as torch picks it for CUDA tensors.

    >>> TraceDevice("40GiB").capacity_bytes() == 40 * 2**30
    True
    >>> TraceDevice("h100-80gb").name, TraceDevice("h100-80gb", allocator="cuda-expandable").name
    ('trace:h100-80gb', 'trace:h100-80gb:cuda-expandable')
    """

    simulated = True

    def __init__(
        self,
        capacity: int | str,
        *,
        rounding_bytes: int = CUDA_BLOCK_BYTES,
        reserved: bool = False,
        reserve_bytes: int | None = None,
        device: torch.device | str = "cpu",
        allocator: str | AllocatorSettings | None = None,
        target: CudaTarget | None = None,
    ):
        self._capacity_bytes = trace_capacity_bytes(capacity, reserve_bytes)
        self.target = target if target is not None else target_of(capacity)
        label = capacity if isinstance(capacity, str) and is_preset(capacity) else format_bytes(self._capacity_bytes)
        default = "cuda" if is_cuda_preset(capacity) or reserved else "exact"
        self.allocator_settings = resolve_allocator(default if allocator is None else allocator)
        name = f"trace:{str(label).replace(' ', '')}"
        if allocator is not None and allocator_label(self.allocator_settings) != default:
            name += f":{allocator_label(self.allocator_settings)}"
        counter = LiveBytes(
            limit_bytes=self._capacity_bytes,
            rounding_bytes=rounding_bytes,
            name=name,
            allocator=modelled_allocator(self._capacity_bytes, self.allocator_settings),
        )
        super().__init__(name, torch.device(device), counter)
        self.fake_mode = TraceFakeMode()
        self._undercounted: dict[str, None] = {}  # ordered like first seen
        self.attention_kernels: list[str] = []  # the SDPA kernels the target ran, one per call
        self._not_counted: dict[str, None] = {}  # what only the target card can size, ordered like first seen

    @property
    def undercounted_ops(self) -> tuple[str, ...]:
        """The ops this device has run whose fake output is smaller than the real one and could not
        be completed (see ``UNDERCOUNTING_OPS``): while any is listed, its peaks are lower bounds.

        >>> TraceDevice("1GiB").undercounted_ops
        ()
        """
        return tuple(self._undercounted)

    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def not_counted(self) -> tuple[str, ...]:
        """What a trace for a GPU ran that only the card can size (cuDNN's convolution workspaces), in words."""
        return tuple(self._not_counted)

    def _cuda_workspaces(self) -> list[torch.Tensor]:
        """cuBLAS's workspaces (one per handle: the forward's thread and autograd's), which the first matmul takes
        from the caching allocator and keeps: counted from the start of the step, in the role ``WORKSPACES``."""
        ledger = self.counter.ledger
        tag = ledger.tag if ledger is not None else None
        if ledger is not None:
            ledger.tag = WORKSPACES  # never taken for activations; an estimate reports them with the temporaries
        nbytes = cublas_workspace_bytes(self.target.sm)
        held = [torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device) for _ in range(CUBLAS_HANDLES)]
        if ledger is not None:
            ledger.tag = tag
        return held

    def unlimited(self) -> TraceDevice:
        """A fresh TraceDevice like this one (rounding, allocator, device type) with no
        capacity limit, so a trace measures the whole peak; this device is left as it is.

        >>> TraceDevice("1GiB", allocator="cuda").unlimited().capacity_bytes() > 2**50
        True
        """
        return TraceDevice(
            UNLIMITED_BYTES,
            rounding_bytes=self.counter.rounding_bytes,
            device=self.torch_device,
            allocator=self.allocator_settings or "exact",
            target=self.target,
        )

    def prepare(self, workload: Workload) -> Workload:
        """A copy of ``workload`` with fake tensors: what trials on this device run. A workload
        that cannot be copied (a lock, a generator, a tensor kind fake tensors lack) is a
        ``TraceError``: the real device needs no copy."""
        try:
            gpu = self.target is not None or self.torch_device.type == "cuda"  # fakes fail foreach's type check
            builder = _FakeWorkloadBuilder(self.fake_mode, self.torch_device, foreach=gpu)
            return builder.build(super().prepare(workload))
        except Exception as error:
            raise trace_error(error) from error
        finally:
            _forget_real_tensors(self.fake_mode)

    def host(self) -> contextlib.AbstractContextManager:
        """Where a trial builds its rows: the fake mode its tensors live in, nothing counted."""
        return self.fake_mode

    @contextlib.contextmanager
    def measuring(self, uncounted: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        # The workspaces computed for the fake (CPU) kernels are the CPU's: a trace for a GPU only records
        # (a CUDA LSTM keeps cuDNN's reserve space instead, which only the card sizes).
        watch = UndercountWatch(self._undercounted, complete=self.torch_device.type == "cpu" and self.target is None)
        if not _TRACED:
            _TRACED.append(True)  # this process has paid the fake mode's start-up (see traced_before)
        with contextlib.ExitStack() as stack:
            stack.enter_context(real_value_checks(self.fake_mode))
            if self.target is not None:  # what the GPU runs where the CPU would run something else
                stack.enter_context(cuda_attention(self.fake_mode, self.target, self.attention_kernels))
                stack.enter_context(cuda_dropout(self.fake_mode))
                stack.enter_context(cuda_autocast(self.fake_mode))
            stack.enter_context(self.fake_mode)
            stack.enter_context(self.counter.mode(uncounted))
            stack.enter_context(watch)
            held = self._cuda_workspaces() if self.target is not None else ()
            if self.target is not None:
                stack.enter_context(CudaScratch(self._not_counted))
            yield
            del held


def _forget_real_tensors(mode: TraceFakeMode) -> None:
    """Drop the fake mode's weak references to the real tensors it copied: a parameter a weak reference
    points at cannot be swapped (``torch.utils.swap_tensors``, which ``Module.to`` uses for tensor subclasses
    and under ``torch.__future__.set_swap_module_params_on_conversion``), and the user's model must come out
    of a trace as it went in. (torch's ``MetaConverter`` keeps them in its describer's lookups.)"""
    describer = getattr(getattr(mode.fake_tensor_converter, "meta_converter", None), "describer", None)
    for name in ("lookup_tensor", "lookup_storage"):
        lookup = getattr(describer, name, None)
        if lookup is not None:
            lookup.clear()


_TRACED: list[bool] = []  # one entry once any trace ran in this process; read by traced_before()


def traced_before() -> bool:
    """Whether a trace ran in this process already: the fake mode's one-time start-up (about 0.7 s
    on a 2-core CPU) is then paid, and a new trace costs only its ops."""
    return bool(_TRACED)


def as_trace_device(spec: TraceDevice | SimulatedDevice | int | str | None) -> TraceDevice | None:
    """The TraceDevice ``spec`` names for an estimate on fake tensors: a ``TraceDevice`` itself; a
    ``SimulatedDevice`` or ``"sim:CAPACITY"`` as a device of that capacity; ``"trace:CAPACITY"``,
    a GPU preset (``"a100-40gb"``) or a capacity (bytes or ``"40GiB"``); ``None`` stays ``None``
    (no capacity). Anything else is a ``ValueError`` naming what is accepted.

    >>> as_trace_device("sim:40GiB").capacity_bytes() == as_trace_device(40 * 2**30).capacity_bytes()
    True
    """
    if spec is None or isinstance(spec, TraceDevice):
        return spec
    if isinstance(spec, SimulatedDevice):
        return TraceDevice(
            spec.capacity_bytes(),
            rounding_bytes=spec.counter.rounding_bytes,
            allocator=spec.allocator_settings or "exact",
        )
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise InputError(f"an estimate cannot run on device {spec!r} ({type(spec).__name__}): {TRACE_DEVICE_HELP}")
    capacity, allocator = spec, None
    if isinstance(spec, str) and spec.strip().lower().startswith(("sim:", "trace:")):
        capacity, _, kind = spec.strip().split(":", 1)[1].partition(":")
        allocator = kind or ("exact" if spec.strip().lower().startswith("sim:") else None)
    try:
        return TraceDevice(capacity, allocator=allocator)
    except (ValueError, TypeError):
        presets = ", ".join(ACCELERATORS)
        raise InputError(
            f"an estimate cannot run on device {spec!r}: {TRACE_DEVICE_HELP} (presets: {presets})"
        ) from None
