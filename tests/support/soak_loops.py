"""A run written by hand, as the outside check of a soak: a model nobody's trial touched on a fresh
``SimulatedDevice(capacity, allocator="cuda")``, copied onto it by torch's own ``Module._apply`` as ``model.to(device)``
runs it (a tied weight copied once), then step after step a micro-batch of new rows copied in while the last one still
lives (``{k: v.to(device) for k, v in batch.items()}``: a copy per tensor), forward, loss, backward,
``optimizer.step()``, ``zero_grad``; the output and loss live until the next step rebinds them; every ``eval_every``
steps an evaluation pass (a function of its own, under ``no_grad``). Nothing of batchfit's step runs here: only its
device counts. ``allocator_requests`` logs what the allocator model was asked, to set beside what a soak replays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import torch

import batchfit as bf
from batchfit.devices.caching_allocator import CachingAllocator

Shape = tuple[int, int]  # rows, sequence length (or image side)
MakeBatch = Callable[[int, int, torch.Generator], Any]
Request = tuple[str, int, int | None]  # ("malloc", bytes, address or None) or ("free", bytes, address)


@contextlib.contextmanager
def allocator_requests(
    keep: Callable[[CachingAllocator], bool] = lambda allocator: True,
) -> Iterator[list[Request]]:
    """Every request and free a ``CachingAllocator`` is given inside (each one ``keep`` says yes to), in order:
    ``("malloc", bytes, address)`` (``None`` where it was not served) and ``("free", block bytes, address)``."""
    logged: list[Request] = []
    malloc, free = CachingAllocator.malloc, CachingAllocator.free

    def logged_malloc(allocator: CachingAllocator, nbytes: int) -> Any:
        block = malloc(allocator, nbytes)
        if keep(allocator):
            logged.append(("malloc", nbytes, None if block is None else block.ptr))
        return block

    def logged_free(allocator: CachingAllocator, block: Any) -> None:
        if keep(allocator):
            logged.append(("free", block.size, block.ptr))
        free(allocator, block)

    CachingAllocator.malloc, CachingAllocator.free = logged_malloc, logged_free
    try:
        yield logged
    finally:
        CachingAllocator.malloc, CachingAllocator.free = malloc, free


def as_served(requests: Sequence[Request]) -> list[Request]:
    """``requests`` with each run of frees between two requests in address order: the blocks merge alike in any
    order (a loop's ``del out`` and batchfit's dropping of its held output free the same blocks in another)."""
    served: list[Request] = []
    frees: list[Request] = []
    for request in requests:
        if request[0] == "free":
            frees.append(request)
            continue
        served += sorted(frees, key=lambda free: free[2])
        frees = []
        served.append(request)
    return served + sorted(frees, key=lambda free: free[2])


def token_batch(vocab: int, mapping: bool = False) -> MakeBatch:
    """Random next-token batches: ``(ids, next_ids)``, or ``{"input_ids", "labels"}`` for a Hugging Face model."""

    def make(rows: int, length: int, generator: torch.Generator) -> Any:
        ids = torch.randint(0, vocab, (rows, length + (0 if mapping else 1)), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()} if mapping else (ids[:, :-1].clone(), ids[:, 1:].clone())

    return make


def image_batch(classes: int) -> MakeBatch:
    """Random ``(images, labels)`` of ``rows`` RGB images ``side`` pixels square."""

    def make(rows: int, side: int, generator: torch.Generator) -> Any:
        return torch.randn(rows, 3, side, side, generator=generator), torch.randint(
            0, classes, (rows,), generator=generator
        )

    return make


def _to_device(batch: Any) -> Any:
    """``{k: v.to(device) for k, v in batch.items()}`` (or the pair's): a new copy of every tensor."""
    if isinstance(batch, dict):
        return {key: value.clone() for key, value in batch.items()}
    return tuple(value.clone() for value in batch)


def to_device_model(model: torch.nn.Module) -> None:
    """``model.to(device)`` onto the simulated device: torch's own ``Module._apply``, in its order, each storage
    copied once and every copy counted. A tensor already on the device is kept, as ``.to(device)`` returns it:
    ``_apply`` meets a tied weight (GPT-2's ``lm_head.weight`` is ``wte.weight``) once per module that holds it,
    and ``torch.clone`` would copy it again and free the first copy, a hole among the parameters no real run has."""
    placed: set[int] = set()  # storages already on the device

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage()._cdata in placed:
            return tensor
        copy = tensor.clone()
        placed.add(copy.untyped_storage()._cdata)
        return copy

    model._apply(to_device)


def _output(model: torch.nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch[0])


def _loss_of(out: Any, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    return out.loss if isinstance(batch, dict) else loss_fn(out, batch[1])


def _evaluate(model: torch.nn.Module, hosts: Sequence[Any], loss_fn: Callable | None) -> None:
    """An evaluation pass as it is written: a Hugging Face model's ``outputs = model(**batch)`` then ``outputs.loss``
    (the outputs, logits and cache with them, live until the next batch's rebind them), else
    ``loss_fn(model(x), y)`` (the output dies with the expression)."""
    model.eval()
    with torch.no_grad():
        batch = out = val_loss = None
        for host in hosts:
            batch = _to_device(host)
            if isinstance(batch, dict):
                out = model(**batch)
                val_loss = out.loss
            else:
                val_loss = loss_fn(model(batch[0]), batch[1])
    del batch, out, val_loss
    model.train()


def hand_run(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable | None,
    make_batch: MakeBatch,
    train: Sequence[Shape],
    capacity_bytes: int,
    *,
    eval_every: int | None = None,
    evals: Sequence[Shape] = (),
) -> int | None:
    """The run of ``train`` shapes (and an evaluation pass of ``evals`` every ``eval_every`` steps): ``None`` when
    every step ran, else the step (1 is the first) that ran out of memory (in it or in the pass after it)."""
    device = bf.SimulatedDevice(capacity_bytes, allocator="cuda")
    generator = torch.Generator().manual_seed(0)
    kinds = {shape: make_batch(*shape, generator) for shape in {*train, *evals}}  # host rows, one batch per shape
    hosts = [tensor for batch in kinds.values() for tensor in (batch.values() if isinstance(batch, dict) else batch)]
    originals = [t.detach() for t in (*model.parameters(), *model.buffers())]  # kept alive, uncounted
    reached = 0
    model.train()
    try:
        with device.measuring(uncounted=[*originals, *hosts]):
            to_device_model(model)
            batch = out = loss = None
            for shape in train:
                reached += 1
                batch = _to_device(kinds[shape])
                out = _output(model, batch)  # the last output dies here, the last loss at the next line
                loss = _loss_of(out, batch, loss_fn)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if eval_every and reached % eval_every == 0:
                    _evaluate(model, [kinds[shape] for shape in evals], loss_fn)
    except torch.OutOfMemoryError:
        return reached
    finally:
        del out, loss, batch
    return None
