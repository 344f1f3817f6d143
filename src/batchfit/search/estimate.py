"""Memory without the hardware: a traced estimate with a breakdown, and an analytic first guess.

``estimate_memory`` runs the training step on fake tensors (``TraceDevice``) and splits the peak
into parameters, gradients, optimizer state, activations (saved for backward), the batch and
temporaries, by tagging every storage as it appears. ``analytic_estimate`` is the textbook formula
(parameters + gradients + optimizer state + batch size × activations per sample), corrected:
optimizer state by optimizer and in the parameters' dtype (fp32 under torch AMP), momentum
counted, activations from the model's structure rather than b·s·h per layer, and checkpointing
keeping each block's input rather than "one layer".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch

from batchfit.devices.accounting import Ledger
from batchfit.devices.allocator_replay import replay_loops
from batchfit.devices.allocator_settings import allocator_label
from batchfit.devices.interrupts import interrupts_deferred
from batchfit.devices.simulated import SimulatedDevice
from batchfit.devices.trace import UNLIMITED_BYTES
from batchfit.devices.trace import WORKSPACES
from batchfit.devices.trace import TraceDevice
from batchfit.devices.trace import as_trace_device
from batchfit.devices.trace import tracing
from batchfit.devices.trace import undercount_message
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.search.prober import Prober
from batchfit.step.batching import resize_batch
from batchfit.step.batching import tensor_leaves
from batchfit.step.workload import Workload
from batchfit.step.workload import autocast
from batchfit.step.workload import placement_order

BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "batch", "temporaries")
EstimateDevice = TraceDevice | SimulatedDevice | int | str | None


def _largest_part(parts: dict[str, int]) -> str:
    """``"activations (1.2 GiB)"``: the largest of ``parts`` and its size."""
    name, nbytes = max(parts.items(), key=lambda item: item[1])
    return f"{name.replace('_', ' ')} ({format_bytes(nbytes)})"


@dataclass(frozen=True)
class AnalyticEstimate:
    """Component bytes from formulas; ``peak_bytes`` is their sum (no temporaries)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    batch: int

    @property
    def peak_bytes(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.batch

    def to_dict(self) -> dict[str, int]:
        """The components and ``peak_bytes``, JSON-ready."""
        return {**asdict(self), "peak_bytes": self.peak_bytes}

    def summary(self) -> str:
        """One sentence: the analytic peak and its largest component.

        >>> AnalyticEstimate(2**20, 2**20, 2**21, 2**22, 1024).summary()
        'The analytic estimate is 8.0 MiB, the largest part activations (4.0 MiB).'
        """
        return (
            f"The analytic estimate is {format_bytes(self.peak_bytes)}, the largest part {_largest_part(asdict(self))}."
        )


@dataclass
class MemoryEstimate:
    """The traced peak at ``batch_size`` and what it is made of, at the moment of the peak.

    ``breakdown`` has the keys parameters, gradients, optimizer_state, activations, batch and
    temporaries (with, for a GPU, the workspaces cuBLAS and the attention kernels take), and sums to ``peak_bytes``; ``peak_phase`` is where the peak happens.
    ``undercounted_ops`` names the ops whose fake kernels make less memory than the real ones by
    an amount the trace cannot compute (the CPU LSTM's workspace is computed for fp32 and bf16,
    not for other dtypes): while it is not empty the peak is a lower bound.

    ``not_counted`` names, in words, what a trace for a GPU ran that only the card can size (cuDNN's
    convolution workspaces): the real peak is higher by that much, and ``fits`` is no verdict where it
    matters.

    Where the device models a caching allocator (a GPU preset's default), ``allocator`` names it,
    ``reserved_peak_bytes`` is what it reserves at the peak (with the capacity as on the card: its
    cache freed and the request retried where it runs short), and ``served`` says whether it could
    serve every request within the capacity: on a GPU that, not the live bytes, decides the fit.
    """

    batch_size: int
    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    capacity_bytes: int | None = None
    analytic: AnalyticEstimate | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    undercounted_ops: tuple[str, ...] = ()
    reserved_peak_bytes: int | None = None
    allocator: str = "exact"
    served: bool | None = None
    not_counted: tuple[str, ...] = ()

    @property
    def fits(self) -> bool | None:
        """Whether the peak stays within the capacity: ``None`` when no capacity was given, or when
        the peak fits but is a lower bound (``undercounted_ops``); ``False`` is always backed.

        >>> MemoryEstimate(8, 2**20, {}, "backward", 2**30, undercounted_ops=("aten::mkldnn_rnn_layer",)).fits is None
        True
        """
        if self.capacity_bytes is None:
            return None
        if self.peak_bytes > self.capacity_bytes or self.served is False:
            return False  # a lower bound over the capacity: the real peak is over it too
        return None if self.undercounted_ops else True

    def summary(self) -> str:
        """One sentence: the peak, where it happens, its largest category, and whether it fits.

        >>> MemoryEstimate(8, 3 * 2**20, {"parameters": 2**20, "activations": 2**21}, "backward", 2**30).summary()
        'At batch size 8 the peak is 3.0 MiB (in backward), the largest part activations (2.0 MiB); it fits in 1.0 GiB.'
        """
        lower_bound = "at least " if self.undercounted_ops else ""
        sentence = f"At batch size {self.batch_size} the peak is {lower_bound}{format_bytes(self.peak_bytes)}"
        sentence += f" (in {self.peak_phase}), the largest part {_largest_part(self.breakdown)}"
        if self.reserved_peak_bytes is not None:
            sentence += f", {format_bytes(self.reserved_peak_bytes)} reserved by the caching allocator"
        if self.capacity_bytes is not None:
            verdict = {True: "it fits in", False: "it does not fit in", None: "it may not fit in"}[self.fits]
            sentence += f"; {verdict} {format_bytes(self.capacity_bytes)}"
            if self.served is False and self.peak_bytes <= self.capacity_bytes:
                sentence += " (the caching allocator cannot serve every request: fragmentation)"
        if self.undercounted_ops:
            sentence += f", as the trace under-counts {', '.join(self.undercounted_ops)}"
        if self.not_counted:
            sentence += f"; not counted: {'; '.join(self.not_counted)}"
        return sentence + "."

    def to_dict(self) -> dict[str, Any]:
        """Every field, ``fits`` and the analytic estimate, JSON-ready."""
        return {
            "batch_size": self.batch_size,
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "undercounted_ops": list(self.undercounted_ops),
            "allocator": self.allocator,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "served": self.served,
            "not_counted": list(self.not_counted),
            "analytic": self.analytic.to_dict() if self.analytic else None,
            **self.extra,
        }


class _Tagger:
    """Moves the ledger's tag along the step and names storages once their role is known."""

    def __init__(self, ledger: Ledger, device: TraceDevice, workload: Workload):
        self.ledger, self.counter, self.workload = ledger, device.counter, workload

    def __call__(self, phase: str) -> None:
        ledger = self.ledger
        if phase == "step":
            ledger.tag = "batch"  # the step's batch, copied in next
        elif phase == "batch":
            ledger.tag, ledger.phase = "temporaries", "forward"
        elif phase == "forward":
            live = [key for key in self.counter._refs if ledger.roles[ledger.serials[key]] == "temporaries"]
            ledger.assign(live, "activations")  # made in forward and still alive: saved for backward
            ledger.phase = "backward"
        elif phase == "backward":
            ledger.assign(self.counter.keys_of(p.grad for p in self.workload.model.parameters()), "gradients")
            ledger.phase = "optimizer"
        elif phase == "optimizer":
            ledger.assign(self.counter.keys_of(_optimizer_tensors(self.workload.optimizer)), "optimizer_state")
            ledger.phase = "forward"


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for entries in optimizer.state.values() for v in entries.values() if isinstance(v, torch.Tensor)]


def _register_roles(ledger: Ledger, device: TraceDevice, work: Workload) -> None:
    groups = [
        ("parameters", placement_order(work.model, gradients=False)),
        ("gradients", [p.grad for p in work.model.parameters() if p.grad is not None]),
        ("optimizer_state", _optimizer_tensors(work.optimizer)),
    ]
    for role, tensors in groups:
        ledger.tag = role
        device.register(tensors)
    ledger.tag = "batch"  # what the trial makes first: the batch (the sample itself is host data, never counted)


def _target_device(device: EstimateDevice, capacity: int | str | None, caller: str) -> TraceDevice | None:
    """The device ``device=`` (or the deprecated ``capacity=``) names, as a TraceDevice."""
    if capacity is not None:
        if device is not None:
            raise InputTypeError(f"{caller} takes device= or the deprecated capacity=, not both: pass device= alone")
        warnings.warn(
            f"{caller}(capacity=...) is deprecated: pass device=... (a capacity, a GPU preset or a TraceDevice)",
            DeprecationWarning,
            stacklevel=3,
        )
        device = capacity
    return as_trace_device(device)


def estimate_workload(
    workload: Workload,
    batch_size: int,
    *,
    device: EstimateDevice = None,
    steps: int = 2,
    analytic: bool = True,
    capacity: int | str | None = None,
) -> MemoryEstimate:
    """``estimate_memory`` for a ``Workload``; ``capacity=`` is deprecated (pass ``device=``)."""
    target = _target_device(device, capacity, "estimate_workload")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be an integer of at least 1, got {batch_size!r}")
    tracer = target.unlimited() if target is not None else TraceDevice(UNLIMITED_BYTES)
    with interrupts_deferred(), tracing():
        fake = tracer.prepare(workload)
        ledger = tracer.counter.ledger = Ledger()
        _register_roles(ledger, tracer, fake)
        tagger = _Tagger(ledger, tracer, fake)
        with Prober(fake, tracer, steps=steps, phase_hook=tagger, settle_steps=0) as prober:  # no limit to meet
            trial = prober.probe(batch_size)
    parts = ledger.breakdown()
    breakdown = {key: parts.get(key, 0) for key in BREAKDOWN_KEYS}
    breakdown["temporaries"] += parts.get(WORKSPACES, 0)  # a GPU's cuBLAS workspaces
    reserved_peak, served = _allocator_outcome(tracer, trial, target)
    if tracer.undercounted_ops:
        hint = "this estimate is a lower bound; measure with `batchfit find --device sim:CAPACITY` instead"
        warnings.warn(f"batchfit: {undercount_message(tracer.undercounted_ops)}: {hint}", stacklevel=2)
    return MemoryEstimate(
        batch_size=batch_size,
        peak_bytes=trial.peak_bytes,
        breakdown=breakdown,
        peak_phase=ledger.peak_phase,
        capacity_bytes=None if target is None else target.capacity_bytes(),
        analytic=analytic_estimate(workload, batch_size) if analytic else None,
        undercounted_ops=tracer.undercounted_ops,
        reserved_peak_bytes=reserved_peak,
        allocator=allocator_label(tracer.allocator_settings),
        served=served,
        not_counted=tracer.not_counted,
    )


def _allocator_outcome(tracer: TraceDevice, trial: Any, target: TraceDevice | None) -> tuple[int | None, bool | None]:
    """The modelled allocator's reserved peak and whether it served every request of the training loop: the
    trial's requests and frees replayed with the target's capacity, where there is one (the trace itself ran
    without a limit), as each order of loop runs them, until the allocator settles."""
    counter = tracer.counter
    if counter.allocator is None:
        return None, None
    if target is None:
        return trial.reserved_peak_bytes, None
    _, _, nbytes = counter.storage_log()
    marks = counter.step_marks()
    outcome = replay_loops(
        counter.allocator_at_start, counter.event_log(), nbytes, target.capacity_bytes(), marks=marks
    )
    return (outcome.peak_reserved_bytes if outcome.served else None), outcome.served


def estimate_memory(
    model: torch.nn.Module,
    sample_batch: Any,
    batch_size: int,
    *,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    amp_dtype: torch.dtype | str | None = None,
    device: EstimateDevice = None,
    steps: int = 2,
    mode: str = "train",
    step_fn: Callable | None = None,
    keep_output: bool = True,
    capacity: int | str | None = None,
) -> MemoryEstimate:
    """Peak memory of a training step at ``batch_size``, with a breakdown, on no hardware at all.

    The step always runs on fake tensors (shapes and dtypes, no data, a ``TraceDevice``), so it
    costs about the same at any batch size. ``device`` is the device to judge ``.fits`` against:
    a ``TraceDevice``, a GPU preset such as ``"a100-40gb"``, a capacity (bytes or ``"40GiB"``),
    ``"trace:CAPACITY"``, or a ``SimulatedDevice``/``"sim:CAPACITY"`` meaning a device of that
    capacity; ``None`` leaves ``.fits`` unknown. ``capacity=`` is the deprecated spelling of a
    capacity or preset ``device=``. The model and optimizer are not touched. The workspace a CPU
    ``nn.LSTM`` keeps for backward, which its fake kernel leaves out, is computed from the op's
    shapes and counted; when the step runs an op whose fake kernel makes less memory than the real
    one by an amount the trace cannot compute (such an LSTM in a dtype other than fp32 or bf16),
    it warns, names the op in ``.undercounted_ops``, and ``.fits`` is no "fits" verdict.
    ``keep_output`` chooses the loop, as in ``find_max_batch_size``: by default the model's output
    lives until after backward, as in a hand-written loop.

    >>> model = torch.nn.Linear(256, 256)
    >>> estimate = estimate_memory(model, torch.randn(2, 256), 1024, loss_fn=lambda out, batch: out.sum(),
    ...                            optimizer=torch.optim.Adam(model.parameters()), device="a100-40gb")
    >>> estimate.fits, sum(estimate.breakdown.values()) == estimate.peak_bytes
    (True, True)
    """
    target = _target_device(device, capacity, "estimate_memory")
    workload = Workload(
        model,
        sample_batch,
        loss_fn=loss_fn,
        optimizer=optimizer,
        amp_dtype=amp_dtype,
        mode=mode,
        step_fn=step_fn,
        keep_output=keep_output,
    )
    return estimate_workload(workload, batch_size, device=target, steps=steps)


# -- the analytic first guess ---------------------------------------------------------------------


# Optimizer state as multiples of the parameters, in the parameters' dtype (torch makes its state
# with zeros_like(param)), where the textbook formula is often quoted with Adam's state halved "in
# FP16" and none for momentum SGD. Subclasses count as their base class.
def _state_multiple(optimizer: torch.optim.Optimizer) -> int:
    group = optimizer.param_groups[0]
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1
    return 2  # Adamax, NAdam, RAdam, Adadelta and unknown ones: two moments is the common case


def _activation_bytes(workload: Workload, checkpointing: bool) -> int:
    """Activation bytes per sample from one fake forward pass at batch size 1: every leaf
    module's output; with ``checkpointing``, each repeated block's input plus the largest block's
    outputs (recomputed one block at a time)."""
    tracer = TraceDevice(UNLIMITED_BYTES)
    with tracing():
        fake = tracer.prepare(workload)
    blocks = _repeated_blocks(fake.model)
    outputs: list[int] = []
    inside = [0] * len(blocks)
    inputs = [0] * len(blocks)

    def size(value: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensor_leaves(value))

    def leaf_hook(module: torch.nn.Module, args: Any, output: Any, owner: int | None) -> None:
        outputs.append(size(output))
        if owner is not None:
            inside[owner] += size(output)

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, args, i=index: inputs.__setitem__(i, size(args))))
    for module in fake.model.modules():
        if not list(module.children()):
            owner = next((i for i, block in enumerate(blocks) if any(m is module for m in block.modules())), None)
            handles.append(module.register_forward_hook(lambda m, a, o, owner=owner: leaf_hook(m, a, o, owner)))
    try:
        with tracing(), tracer.fake_mode, torch.no_grad(), autocast(tracer.torch_device.type, fake.amp_dtype):
            fake._forward(resize_batch(fake.sample_batch, 1))
    finally:
        for handle in handles:
            handle.remove()
    if checkpointing and blocks:
        return sum(outputs) - sum(inside) + sum(inputs) + max(inside)
    return sum(outputs)


def _repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (children of the first ModuleList/Sequential holding several modules
    of one type): the unit gradient checkpointing recomputes."""
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1 and list(children[0].children()):
                return children
    return []


def analytic_estimate(
    workload: Workload, batch_size: int, *, checkpointing: bool = False, master_weights: bool = False
) -> AnalyticEstimate:
    """The textbook formula, corrected (see the module's docstring). Activations are the outputs of
    every leaf module, per sample, times the batch; with ``checkpointing`` only each repeated
    block's input is kept, plus one block's activations during its recomputation.
    ``master_weights`` adds an fp32 copy of every trainable parameter to the optimizer state,
    as apex/DeepSpeed-style mixed precision keeps for 16-bit parameters (torch's own optimizers
    and AMP keep none: under AMP the parameters themselves stay fp32)."""
    params = [p for p in workload.model.parameters()]
    parameter_bytes = sum(p.numel() * p.element_size() for p in [*params, *workload.model.buffers()])
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    training = workload.mode == "train"
    state = _state_multiple(workload.optimizer) * trainable if training and workload.optimizer is not None else 0
    if training and master_weights:
        state += sum(p.numel() * 4 for p in params if p.requires_grad)
    per_sample = _activation_bytes(workload, checkpointing)
    sample = workload.sample_batch
    batch_bytes = (
        sum(t.numel() * t.element_size() for t in tensor_leaves(sample) if t.dim() > 0) // workload.sample_length
    )
    return AnalyticEstimate(
        parameters=parameter_bytes,
        gradients=trainable if training else 0,
        optimizer_state=state,
        activations=per_sample * batch_size if training else 0,
        batch=batch_bytes * batch_size,
    )
