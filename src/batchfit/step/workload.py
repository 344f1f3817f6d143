"""Workload: the model, one sample batch, the loss, the optimizer and AMP, and how one step runs."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.step.batching import batch_length
from batchfit.step.batching import compact_batch
from batchfit.step.batching import tensor_bytes
from batchfit.step.batching import tensor_leaves

MODES = ("train", "eval", "generate")
AMP_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

_CALL_HELP = {
    "loss_fn": "pass loss_fn(output, targets) -> scalar tensor, e.g. torch.nn.functional.cross_entropy",
    "step_fn": "pass step_fn(model, batch) -> scalar loss tensor",
}

LossFn = Callable[[Any, Any], torch.Tensor]
StepFn = Callable[[torch.nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
PhaseMark = Callable[[str], None]


def amp_dtype_of(value: torch.dtype | str | None) -> torch.dtype | None:
    """``torch.float16``, ``torch.bfloat16`` or ``None``, from a dtype or a name such as ``"bf16"``.

    >>> amp_dtype_of("bf16")
    torch.bfloat16
    """
    if value is None or value in (torch.float16, torch.bfloat16):
        return value
    if isinstance(value, str) and value.lower() in AMP_DTYPES:
        return AMP_DTYPES[value.lower()]
    raise InputError(f"amp_dtype must be torch.float16, torch.bfloat16, 'fp16', 'bf16' or None, got {value!r}")


def _check_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    own = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if foreign:
        raise InputError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not the model's: build it "
            "from model.parameters() of the model you pass"
        )


def _built_optimizer(
    optimizer: torch.optim.Optimizer | OptimizerFactory | None, model: torch.nn.Module
) -> torch.optim.Optimizer | None:
    """``optimizer`` itself, or what the factory ``optimizer(model.parameters())`` returns; either
    must hold only ``model``'s parameters."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise InputTypeError("optimizer must be a torch.optim.Optimizer or a factory params -> Optimizer")
        made = optimizer(model.parameters())
        if not isinstance(made, torch.optim.Optimizer):
            raise InputTypeError(
                f"the optimizer factory returned {type(made).__name__}, not a torch.optim.Optimizer: "
                "return one, e.g. lambda params: torch.optim.AdamW(params)"
            )
        optimizer = made
    _check_optimizer(optimizer, model)
    return optimizer


@dataclass
class Workload:
    """What a probe runs: ``model``, one ``sample_batch``, ``loss_fn``, ``optimizer``, ``amp_dtype``.

    Calling convention (as in the classic binary search for the batch size): a sample
    ``(inputs, targets)`` runs ``loss_fn(model(inputs), targets)``; a mapping runs
    ``model(**batch)`` and uses ``output.loss`` unless ``loss_fn(output, batch)`` is given; anything
    else runs ``model(batch)`` and ``loss_fn(output, batch)``. ``step_fn(model, batch) -> loss``
    overrides all of it. ``mode="eval"`` runs the forward pass only, under ``torch.no_grad()``.
    ``mode="generate"`` runs generation under ``torch.no_grad()``, so the KV cache is in the probe
    (generation needs more memory than a forward pass): ``step_fn(model, batch)`` if given (e.g.
    ``lambda m, b: m.generate(**b, max_new_tokens=64)``), else ``model.generate(inputs,
    max_new_tokens=max_new_tokens)`` (a mapping batch is passed as keywords, without ``labels``).
    ``keep_output=True`` (the default) keeps the model's output alive until after backward, as the
    loop people write does (``outputs = model(**batch); loss = outputs.loss; loss.backward()``, or
    ``logits = model(x)`` held the same way); ``keep_output=False`` lets it die inside the loss
    call, as Lightning's ``training_step`` and the Hugging Face Trainer do. A ``step_fn`` step
    holds what ``step_fn`` holds: it returns only the loss.
    ``accumulating=True`` runs each step as a later micro-batch of a gradient-accumulation window:
    the gradients exist (as zeros) before the forward, so their memory is held through forward and
    backward, as in training with ``gradient_accumulation_steps > 1``.

    Construction checks every field and converts exactly four, each documented on its field:
    an optimizer factory is called once (``optimizer``), an AMP spelling such as ``"bf16"``
    becomes its ``torch.dtype`` (``amp_dtype``), a sample tensor that is a view of a larger tensor
    is kept as a compact copy of its own elements (``sample_batch``: only its rows count, as only
    they reach a GPU), and a missing ``name`` becomes the model's class name. Nothing else is
    changed, and the model, batch and optimizer passed in are never touched.

    >>> model = torch.nn.Linear(4, 2)
    >>> work = Workload(model, (torch.randn(8, 4), torch.randint(0, 2, (8,))),
    ...                 loss_fn=torch.nn.functional.cross_entropy,
    ...                 optimizer=lambda params: torch.optim.SGD(params, lr=0.1), amp_dtype="bf16")
    >>> work.sample_length, type(work.optimizer).__name__, work.amp_dtype, work.name
    (8, 'SGD', torch.bfloat16, 'Linear')
    """

    model: torch.nn.Module
    """The module a step trains (or evaluates); its parameters are restored after every probe."""
    sample_batch: Any
    """One real batch from the data loader: any nesting of tensors sharing a leading batch
    dimension; batches of other sizes are built from its rows. A leaf that is a view of a larger
    tensor (``X[:8]``) is kept as a copy of its own elements, so the rest of ``X`` is never counted."""
    loss_fn: LossFn | None = None
    """``loss_fn(output, targets)`` (or ``(output, batch)``) returning a scalar tensor, by the
    calling convention; ``None`` uses ``output.loss`` for a mapping batch."""
    optimizer: torch.optim.Optimizer | OptimizerFactory | None = None
    """The optimizer over ``model.parameters()``, or ``None`` to skip the optimizer step. A factory
    ``params -> Optimizer`` is accepted: it is called once, at construction, with
    ``model.parameters()``, and this field holds the optimizer it returned from then on."""
    amp_dtype: torch.dtype | str | None = None
    """The autocast dtype, ``torch.float16`` or ``torch.bfloat16``, or ``None`` for no AMP. The
    spellings ``"fp16"``, ``"float16"``, ``"bf16"`` and ``"bfloat16"`` are accepted and stored
    as the ``torch.dtype`` they name, so this field always reads as a ``torch.dtype`` or ``None``."""
    mode: str = "train"
    """``"train"`` (forward, backward, optimizer step), ``"eval"`` (forward under no_grad) or
    ``"generate"`` (generation under no_grad)."""
    step_fn: StepFn | None = None
    """``step_fn(model, batch) -> loss`` (in generate mode: the generation), replacing the
    calling convention."""
    name: str | None = None
    """What reports call the workload; ``None`` is stored as the model's class name."""
    max_new_tokens: int = 16
    """Tokens ``model.generate`` produces per probe in ``mode="generate"``."""
    accumulating: bool = False
    """Run each step as a later micro-batch of an accumulation window (gradients held through
    forward and backward)."""
    keep_output: bool = True
    """Hold the model's output until after backward, as a hand-written loop does (``False``: it
    dies inside the loss call, as in Lightning's ``training_step`` or the Hugging Face Trainer).
    Applies to the calling convention; a ``step_fn`` returns only the loss."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise InputTypeError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.amp_dtype = amp_dtype_of(self.amp_dtype)
        batch_length(self.sample_batch)  # a sample without one batch length fails here, naming the fix
        self.sample_batch = compact_batch(self.sample_batch)  # a view of a larger tensor keeps only its rows
        if self.mode == "generate":
            _check_generation(self)
        if self.mode == "train" and not any(p.requires_grad for p in self.model.parameters()):
            raise InputError("the model has no parameters that require grad, so it cannot train: use mode='eval'")
        for name in ("accumulating", "keep_output"):
            if not isinstance(getattr(self, name), bool):
                raise InputTypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("loss_fn", "step_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise InputTypeError(f"{name} must be a function, got {getattr(self, name)!r}: {_CALL_HELP[name]}")
        self.optimizer = _built_optimizer(self.optimizer, self.model)
        self.name = self.name or type(self.model).__name__

    @property
    def sample_length(self) -> int:
        """Rows in ``sample_batch`` (its batch dimension), derived from it on every read."""
        return batch_length(self.sample_batch)

    # -- what a step holds -------------------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors the workload holds between steps: parameters, buffers and grads in the order
        ``model.to(device)`` places them (``placement_order``), then the optimizer's state."""
        held = placement_order(self.model)
        if self.optimizer is not None:
            for entries in self.optimizer.state.values():
                held += [v for v in entries.values() if isinstance(v, torch.Tensor)]
        return held

    def sample_bytes(self) -> int:
        return sum(t.element_size() * t.numel() for t in tensor_leaves(self.sample_batch))

    # -- running a step ------------------------------------------------------------------------

    def _forward(self, batch: Any) -> Any:
        """The loss (or, in eval mode without a loss, the output) for ``batch``."""
        return compute_loss(
            self.model, batch, loss_fn=self.loss_fn, step_fn=self.step_fn, need_loss=self.mode == "train"
        )

    def _loss_holding(self, batch: Any, held: LoopVariables | None) -> Any:
        """The loss for a training step. With ``keep_output``, ``held`` takes the output as soon as
        the model returns it and then the loss, as a loop's ``outputs = model(...)`` and ``loss =
        ...`` rebind their variables: the previous step's values die at those two moments."""
        if not self.keep_output:
            return self._forward(batch)
        held = held if held is not None else LoopVariables()
        if self.step_fn is not None:
            held.loss = self.step_fn(self.model, batch)
            return held.loss
        held.output, targets = call_by_convention(self.model, batch)
        held.loss = loss_of(held.output, targets, batch, loss_fn=self.loss_fn)
        return held.loss

    @property
    def loop(self) -> str:
        """Which training loop a probe models, in words (what ``batchfit find`` reports)."""
        if self.mode != "train":
            return f"{self.mode} under no_grad"
        if self.step_fn is not None:
            return "step_fn(model, batch) -> loss"
        if self.keep_output:
            return "the output held through backward, as in a hand-written loop"
        return "the output dropped before backward, as in Lightning's training_step or the HF Trainer"

    def train_step(
        self,
        batch: Any,
        device_type: str,
        scaler: Any,
        mark: PhaseMark,
        held: LoopVariables | None = None,
        note: PhaseMark | None = None,
    ) -> None:
        """One full step, marking each phase's end: forward and loss (``mark("forward")``),
        backward (``mark("backward")``), optimizer step and ``zero_grad`` (``mark("optimizer")``);
        ``note("zero_grad")`` just before ``zero_grad``, where a loop may put it instead (at the top of
        the next step).

        With ``keep_output``, ``held`` keeps the output and the loss as a loop's variables do:
        the previous step's output lives through this forward, this step's through backward, the
        optimizer step and the next forward."""
        if self.accumulating:
            hold_gradients(self.model)
        with autocast(device_type, self.amp_dtype):
            loss = self._loss_holding(batch, held)
        _check_loss(loss)
        mark("forward")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        del loss
        mark("backward")
        if self._optimizer_step(scaler, note or (lambda label: None)):
            mark("optimizer")

    def _optimizer_step(self, scaler: Any, note: PhaseMark) -> bool:
        """The optimizer step and ``zero_grad`` (``note("zero_grad")`` between them); ``False`` when there
        is no optimizer (the gradients are dropped all the same)."""
        if self.optimizer is None:
            note("zero_grad")
            self.model.zero_grad(set_to_none=True)
            return False
        if scaler is not None:
            # A probe must run the step even when a fresh scaler's first scale overflows (it would
            # skip it, and the optimizer state would never be measured); the state is restored anyway.
            scaler.unscale_(self.optimizer)
            self.optimizer.step()
            scaler.update()
        else:
            self.optimizer.step()
        note("zero_grad")
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def eval_step(self, batch: Any, device_type: str, mark: PhaseMark, held: LoopVariables | None = None) -> None:
        """One forward pass, or with ``mode="generate"`` one generation, under ``torch.no_grad()``
        (``mark("forward")``); with ``keep_output`` the output replaces ``held.output``, as in
        ``train_step``."""
        self.model.eval()
        with torch.no_grad(), autocast(device_type, self.amp_dtype):
            output = self._generate(batch) if self.mode == "generate" else self._forward(batch)
        if held is not None and self.keep_output:
            held.output = output
        del output
        mark("forward")

    def _generate(self, batch: Any) -> Any:
        if self.step_fn is not None:
            return self.step_fn(self.model, batch)
        if isinstance(batch, Mapping):
            inputs = {key: value for key, value in batch.items() if key != "labels"}
            return self.model.generate(**inputs, max_new_tokens=self.max_new_tokens)
        inputs = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
        return self.model.generate(inputs, max_new_tokens=self.max_new_tokens)

    def make_scaler(self, device_type: str) -> Any:
        """A GradScaler for fp16 training where the device type has one, else ``None``."""
        if self.mode != "train" or self.amp_dtype != torch.float16:
            return None
        try:
            return torch.amp.GradScaler(device_type)
        except (RuntimeError, ValueError):  # device type without a GradScaler
            return None


@dataclass
class LoopVariables:
    """What a hand-written loop's ``batch``, ``outputs`` and ``loss`` variables hold from one step
    into the next (``None`` before the first)."""

    output: Any = None
    loss: Any = None
    batch: Any = None

    def tensor_bytes(self) -> int:
        """Bytes of the tensors held."""
        return tensor_bytes((self.output, self.loss, self.batch))


def placement_order(module: torch.nn.Module, *, gradients: bool = True) -> list[torch.Tensor]:
    """``module``'s parameters (each followed by its gradient, with ``gradients``) and buffers in the order
    ``module.to(device)`` allocates them on a device: torch's ``Module._apply`` visits the children first,
    then the module's own parameters, then its buffers. A caching allocator places what comes first first.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    >>> [tuple(t.shape) for t in placement_order(model)]
    [(3, 2), (3,), (3,), (3,), (3,), (3,), ()]
    """
    placed: list[torch.Tensor] = []
    for child in module.children():
        placed += placement_order(child, gradients=gradients)
    for param in module._parameters.values():
        if param is not None:
            placed.append(param)
            if gradients and param.grad is not None:
                placed.append(param.grad)
    placed += [buffer for buffer in module._buffers.values() if buffer is not None]
    return placed


def hold_gradients(model: torch.nn.Module) -> None:
    """Give every trainable parameter without a gradient a zero one, as an accumulation window's
    earlier micro-batches would have left it."""
    for param in model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)


def _check_generation(workload: Workload) -> None:
    if workload.step_fn is None and not callable(getattr(workload.model, "generate", None)):
        raise InputError(
            f"mode='generate' needs a model with .generate() or step_fn(model, batch) that generates; "
            f"{type(workload.model).__name__} has no .generate"
        )
    if not isinstance(workload.max_new_tokens, int) or workload.max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {workload.max_new_tokens!r}")


def compute_loss(
    model: torch.nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    need_loss: bool = True,
) -> Any:
    """Run ``model`` on ``batch`` by the calling convention and return the loss.

    A pair ``(inputs, targets)`` runs ``loss_fn(model(inputs), targets)``; a mapping runs
    ``model(**batch)`` and uses ``output.loss`` unless ``loss_fn(output, batch)`` is given;
    anything else runs ``model(batch)`` and ``loss_fn(output, batch)``; ``step_fn(model, batch)``
    overrides all of it. Without a loss and with ``need_loss=False``, the output is returned.
    """
    if step_fn is not None:
        return step_fn(model, batch)
    output, targets = call_by_convention(model, batch)
    if loss_fn is None and not need_loss:
        return output
    return loss_of(output, targets, batch, loss_fn=loss_fn)


def loss_of(output: Any, targets: Any, batch: Any, *, loss_fn: LossFn | None = None) -> Any:
    """The loss of ``output`` by the calling convention: ``loss_fn(output, targets)``, else a
    mapping batch's ``output.loss``."""
    if loss_fn is not None:
        return loss_fn(output, targets)
    if isinstance(batch, Mapping):
        return _loss_attribute(output)
    raise InputError("this batch needs a loss: pass loss_fn(output, targets) or step_fn(model, batch)")


def call_by_convention(model: Any, batch: Any) -> tuple[Any, Any]:
    """``(output, targets)``: a mapping runs ``model(**batch)`` (targets: the batch), a pair
    ``(inputs, targets)`` runs ``model(inputs)``, anything else ``model(batch)`` (targets: the batch).
    Any callable model: torch's and MLX's alike."""
    if isinstance(batch, Mapping):
        return model(**batch), batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return model(batch[0]), batch[1]
    return model(batch), batch


def autocast(device_type: str, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device_type``, or a no-op when ``dtype`` is ``None``."""
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=dtype is not None)


def _loss_attribute(output: Any) -> Any:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise InputError(
            "the model's output has no .loss: pass loss_fn(output, batch), or labels in the batch "
            "(Hugging Face models compute the loss when given labels)"
        )
    return loss


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise InputTypeError(
            f"the loss must be a tensor, got {type(loss).__name__}: return a scalar tensor from loss_fn"
        )
    if loss.numel() != 1:
        raise InputError(
            f"the loss must be a scalar, got shape {tuple(loss.shape)}: reduce it in loss_fn (e.g. .mean())"
        )
