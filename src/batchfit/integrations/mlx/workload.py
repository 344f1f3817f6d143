"""MlxWorkload: an MLX model, one sample batch, the loss and the optimizer, and how one step runs."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.integrations.mlx.backend import MLX
from batchfit.integrations.mlx.backend import MlxBackend
from batchfit.integrations.mlx.batch import as_mlx
from batchfit.integrations.mlx.batch import batch_length
from batchfit.integrations.mlx.batch import bytes_per_sample
from batchfit.step.workload import call_by_convention

LossFn = Callable[[Any, Any], mx.array]
StepFn = Callable[[nn.Module, Any], mx.array]


@dataclass
class MlxWorkload:
    """What an MLX probe runs: ``model``, one ``sample_batch``, ``loss_fn``, ``optimizer``.

    The calling convention is torch's (``batchfit.Workload``): a pair ``(inputs, targets)`` runs
    ``loss_fn(model(inputs), targets)``; a mapping runs ``model(**batch)`` and uses its ``"loss"``
    unless ``loss_fn(output, batch)`` is given; anything else runs ``model(batch)`` and
    ``loss_fn(output, batch)``; ``step_fn(model, batch) -> loss`` overrides all of it. One step is
    ``nn.value_and_grad``, ``optimizer.update`` and one ``mx.eval`` of the loss, the parameters and
    the optimizer state, as an MLX training loop runs it. The sample may nest MLX (or NumPy) arrays
    in tuples, lists, dicts, namedtuples and dataclasses.

    >>> model = nn.Linear(4, 2)
    >>> work = MlxWorkload(model, (mx.zeros((8, 4)), mx.zeros((8,), dtype=mx.int32)),
    ...                    loss_fn=lambda out, y: nn.losses.cross_entropy(out, y, reduction="mean"),
    ...                    optimizer=optim.SGD(learning_rate=0.1))
    >>> work.sample_length, work.parameter_count()
    (8, 10)
    """

    framework: ClassVar[str] = "mlx"

    model: nn.Module
    sample_batch: Any
    loss_fn: LossFn | None = None
    optimizer: optim.Optimizer | None = None
    step_fn: StepFn | None = None
    name: str | None = None
    sample_length: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise InputTypeError(f"model must be an mlx.nn.Module, got {type(self.model).__name__}")
        if self.optimizer is not None and not isinstance(self.optimizer, optim.Optimizer):
            raise InputTypeError(
                f"optimizer must be an mlx.optimizers.Optimizer or None, got {type(self.optimizer).__name__}"
            )
        if not tree_flatten(self.model.trainable_parameters()):
            raise InputError("the model has no trainable parameters, so it cannot train: unfreeze some")
        self.sample_batch = as_mlx(self.sample_batch)
        self.sample_length = batch_length(self.sample_batch)
        self.name = self.name or type(self.model).__name__

    def backend(self) -> MlxBackend:
        """How the search runs this workload: ``batchfit.integrations.mlx.backend.MLX``."""
        return MLX

    def bytes_per_sample(self) -> int:
        """Bytes one sample of the batch takes: no batch larger than the free memory over this fits."""
        return bytes_per_sample(self.sample_batch)

    def parameter_count(self) -> int:
        return sum(value.size for _, value in tree_flatten(self.model.parameters()))

    def loss(self, model: nn.Module, batch: Any) -> mx.array:
        """The scalar loss of ``model`` on ``batch``, by the calling convention."""
        if self.step_fn is not None:
            return _checked(self.step_fn(model, batch))
        output, targets = call_by_convention(model, batch)
        if self.loss_fn is not None:
            return _checked(self.loss_fn(output, targets))
        if isinstance(batch, Mapping):
            return _checked(_loss_entry(output))
        raise InputError("this batch needs a loss: pass loss_fn(output, targets) or step_fn(model, batch)")

    def train_step(self, batch: Any, mark: Callable[[str], None] = lambda phase: None) -> None:
        """One full step. MLX is lazy: building the graph is the ``forward`` phase (``mark("forward")``
        at its end) and the one ``mx.eval`` that then runs forward, backward and the update together
        ends the step (``mark("optimizer")``)."""
        loss, grads = nn.value_and_grad(self.model, self.loss)(self.model, batch)  # made per step: no reference cycle
        if self.optimizer is not None:
            self.optimizer.update(self.model, grads)
        mark("forward")
        if self.optimizer is not None:
            mx.eval(loss, self.model.parameters(), self.optimizer.state)
        else:
            mx.eval(loss, grads)
        mark("optimizer")


def _loss_entry(output: Any) -> Any:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise InputError("the model's output has no 'loss': pass loss_fn(output, batch) or step_fn(model, batch)")
    return loss


def _checked(loss: Any) -> mx.array:
    if not isinstance(loss, mx.array):
        raise InputTypeError(f"the loss must be an mx.array, got {type(loss).__name__}: return a scalar from loss_fn")
    if loss.size != 1:
        raise InputError(
            f"the loss must be a scalar, got shape {tuple(loss.shape)}: reduce it in loss_fn (e.g. .mean())"
        )
    return loss.reshape(())
