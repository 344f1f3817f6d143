"""Campaigns over many seeds and sites for the faults beyond the core (``benchmarks/fault_campaigns.py`` runs
them in full for ``make reliability``; ``tests/project/test_fault_campaigns.py`` a few cases of each):

- **cache**: a search cached, then one edit of what decides memory (a forward's code, a child's, a helper its
  forward calls, a plain attribute, a checkpointing flag, a loss's captured value, a simulated device's
  rounding) and the same search again. It *holds* when the second search is measured, not served, and answers
  what an uncached search of the edited workload answers; a search with no edit must be served.
- **interrupt**: a real SIGINT at a seeded site (the k-th storage the accounting uncounts, inside its weak
  reference callback; the k-th op a counting device sees; the k-th op of a trace). It *holds* when the search
  raises ``KeyboardInterrupt``, the model and optimizer are bitwise as before, no dispatch mode is left pushed,
  the SIGINT handler is Python's again, and the next search finds the clean answer.

Each returns a ``Tally``: cases tried, held and broke, with the first few broken ones described.
"""

from __future__ import annotations

import functools
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.devices.accounting import LiveBytes
from batchfit.devices.fake_values import TraceFakeMode


@dataclass
class Tally:
    """What a campaign found."""

    tried: int = 0
    held: int = 0
    broke: int = 0
    broken: list[str] = field(default_factory=list)

    def record(self, case: str, problem: str | None) -> None:
        self.tried += 1
        if problem is None:
            self.held += 1
        else:
            self.broke += 1
            if len(self.broken) < 5:
                self.broken.append(f"{case}: {problem}")


# -- the cache ----------------------------------------------------------------------------------------------

SOURCE = """
import torch
from torch import nn
from torch.nn import functional as F

def helper(x):
    return HELPER

class Child(nn.Linear):
    def forward(self, x):
        return CHILD

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.first, self.child = nn.Linear(width, width), Child(width, width)
        self.repeat, self.p, self.checkpointing = 1, 0.0, False

    def forward(self, x):
        for _ in range(LOOPS * self.repeat):
            x = helper(torch.relu(self.first(x)))
        x = F.dropout(self.child(x), self.p, self.training)
        return x
"""
ORIGINAL = {"LOOPS": "1", "HELPER": "x * 2", "CHILD": "super().forward(x)"}
CODE_EDITS = {
    "forward edited (a loop run 3 times)": {"LOOPS": "3"},
    "helper swapped (a copy made)": {"HELPER": "x.repeat(1, 2)[:, : x.shape[1]] * 2"},
    "child's forward edited": {"CHILD": "super().forward(torch.cat([x, x])[: x.shape[0]])"},
}


def _block_class(edits: dict[str, str]) -> type:
    """``Block`` from ``SOURCE`` with ``edits``, in a module of the same name every time (a user's file edited)."""
    source = SOURCE
    for name, text in {**ORIGINAL, **edits}.items():
        source = source.replace(name, text)
    namespace: dict[str, Any] = {"__name__": "campaign_models"}
    exec(compile(source, "campaign_models.py", "exec"), namespace)
    return namespace["Block"]


def _search(seed: int, edits: dict[str, str], change: Callable[[nn.Module], None], loss_scale: float,
            rounding: int, cache: Any) -> bf.SearchResult:  # fmt: skip
    torch.manual_seed(seed)
    width = 8 * (1 + seed % 4)
    block = _block_class(edits)(width)
    change(block)
    model = nn.Sequential(block, nn.Linear(width, 4))

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output * loss_scale, targets)

    device = bf.SimulatedDevice("1MiB", rounding_bytes=rounding)
    batch = (torch.randn(3, width), torch.randint(0, 4, (3,)))
    return bf.find_max_batch_size(model, batch, loss_fn=loss, optimizer=torch.optim.Adam(model.parameters()),
                                  device=device, cache=cache, trace=False)  # fmt: skip


def _set(attribute: str, value: Any, child: bool = False) -> Callable[[nn.Module], None]:
    def change(block: nn.Module) -> None:
        setattr(block.child if child else block, attribute, value)

    return change


def cache_edits() -> dict[str, dict[str, Any]]:
    """Every edit the campaign makes, as the keyword arguments of ``_search`` it changes."""
    edits: dict[str, dict[str, Any]] = {name: {"edits": edit} for name, edit in CODE_EDITS.items()}
    edits["repeat = 2"] = {"change": _set("repeat", 2)}
    edits["a dropout's p"] = {"change": _set("p", 0.5)}
    edits["a checkpointing flag"] = {"change": _set("checkpointing", True)}
    edits["a child's gradient_checkpointing"] = {"change": _set("gradient_checkpointing", True, child=True)}
    edits["a loss's captured value"] = {"loss_scale": 2.0}
    edits["the device's rounding"] = {"rounding": 1}
    return edits


def cache_campaign(seeds: range, folder: Any) -> Tally:
    tally = Tally()
    plain = {"edits": {}, "change": lambda block: None, "loss_scale": 1.0, "rounding": 512}
    for seed in seeds:
        for name, edit in [("no edit", {}), *cache_edits().items()]:
            store = folder / f"{seed}-{len(name)}-{abs(hash(name)) % 10**6}"
            _search(seed, **plain, cache=store)
            again = _search(seed, **{**plain, **edit}, cache=store)
            if not edit:
                tally.record(f"seed {seed}, {name}", None if again.cached else "measured again, not served")
                continue
            truth = _search(seed, **{**plain, **edit}, cache=False)
            problem = None
            if again.cached:
                problem = f"served {again.batch_size} from the cache (the truth: {truth.batch_size})"
            elif again.batch_size != truth.batch_size:
                problem = f"answered {again.batch_size}, the truth {truth.batch_size}"
            tally.record(f"seed {seed}, {name}", problem)
    return tally


# -- Ctrl-C ---------------------------------------------------------------------------------------------------


def _model(seed: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(seed)
    width = 16 * (1 + seed % 3)
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, (torch.randn(4, width), torch.randint(0, 4, (4,))), optimizer


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [*model.state_dict().values(), *(p.grad for p in model.parameters())]
    return [t.clone() for t in tensors] + [v.clone() for s in optimizer.state.values() for v in s.values()]


def _find(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer, trace: bool) -> bf.SearchResult:
    return bf.find_max_batch_size(model, batch, loss_fn=F.cross_entropy, optimizer=optimizer,
                                  device="sim:2MiB", trace=trace)  # fmt: skip


SITES: dict[str, tuple[type, str]] = {
    "the accounting's weak-reference callback": (LiveBytes, "_forget"),
    "an op a counting device sees": (LiveBytes, "track"),
    "an op of a trace": (TraceFakeMode, "__torch_dispatch__"),
}


def _wrapped(owner: type, name: str, on_call: Callable[[int], None]) -> Callable[[], None]:
    """``owner.name`` calling ``on_call(n)`` before its n-th call; returns the function that puts it back."""
    original, calls = getattr(owner, name), [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        on_call(calls[0])
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def _calls(owner: type, name: str, search: Callable[[], Any]) -> int:
    """How many times a clean ``search`` calls ``owner.name``, once warm (a first search in a process runs
    more ops than the next: torch's own first-call set-up)."""
    counts = []
    for _ in range(2):
        seen = [0]
        restore = _wrapped(owner, name, lambda n, seen=seen: seen.__setitem__(0, n))
        try:
            search()
        finally:
            restore()
        counts.append(seen[0])
    return min(counts)


def _interrupted(owner: type, name: str, call: int, search: Callable[[], Any]) -> str | None:
    """``search`` with a SIGINT raised at the ``call``-th call of ``owner.name``: what went wrong, if anything."""

    def interrupt(n: int) -> None:
        if n == call:
            signal.raise_signal(signal.SIGINT)

    restore = _wrapped(owner, name, interrupt)
    try:
        search()
        return "the search ran to its end (no KeyboardInterrupt)"
    except KeyboardInterrupt:
        return None
    finally:
        restore()


def _aftermath(before: list[torch.Tensor], model: nn.Module, optimizer: Any, clean: int, again: Callable) -> str | None:
    if not all(torch.equal(a, b) for a, b in zip(before, _state(model, optimizer), strict=True)):
        return "the model or optimizer changed"
    if torch._C._len_torch_dispatch_stack():
        return "a dispatch mode is still pushed"
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return "the SIGINT handler was not put back"
    if again().batch_size != clean:
        return "the next search answered otherwise"
    return None


def interrupt_campaign(seeds: range) -> Tally:
    tally = Tally()
    for seed in seeds:
        model, batch, optimizer = _model(seed)
        clean = _find(model, batch, optimizer, trace=False).batch_size
        plain = functools.partial(_find, model, batch, optimizer, False)
        for site, (owner, name) in SITES.items():
            search = functools.partial(_find, model, batch, optimizer, owner is TraceFakeMode)
            call = random.Random(f"{seed} {site}").randint(1, _calls(owner, name, search))
            before = _state(model, optimizer)
            problem = _interrupted(owner, name, call, search) or _aftermath(before, model, optimizer, clean, plain)
            tally.record(f"seed {seed}, {site}, call {call}", problem)
    return tally


# -- an OOM inside FSDP2 ---------------------------------------------------------------------------------------

FSDP_SEQ_LEN = 16


def _rank_trial(work: Any, device: Any, batch_size: int) -> bf.Trial:
    from batchfit.parallel.one_rank import RankProber

    with RankProber(work, device, steps=2, limit_bytes=None) as prober:
        return prober.probe(batch_size)


def fsdp_campaign(world_size: int, seeds: range, batch_size: int = 4) -> tuple[Tally, set[str]]:
    """One rank of ``world_size`` (FSDP2 over torch's fake process group): per seed, a ``torch.OutOfMemoryError``
    (one seed in three a ``RuntimeError`` with CUDA's out-of-memory wording) raised before or after a seeded op of a trial's step,
    anywhere in it: the batch, forward, FSDP2's all-gathers and hooks, backward, the reduce-scatters, the
    optimizer step. Holds when that trial fails as out of memory and the next one, on the same prober, is what a
    fresh prober finds (fits, peak) with nothing left counted. Returns the tally and the phases hit."""
    from batchfit.parallel.models import TinyTransformer
    from batchfit.parallel.one_rank import RankProber
    from batchfit.parallel.one_rank import RankWorkload
    from batchfit.parallel.settings import Parallelism
    from fault_injection import Fault as OpFault
    from fault_injection import FaultyDevice
    from fault_injection import Injector
    from fault_injection import phase_hooks

    work = RankWorkload(TinyTransformer, FSDP_SEQ_LEN, Parallelism(world_size=world_size))
    fresh = _rank_trial(work, bf.SimulatedDevice("64MiB"), batch_size)
    injector, tally, phases = Injector(), Tally(), set()
    device = FaultyDevice("64MiB", injector)
    with phase_hooks(injector), RankProber(work, device, steps=2, limit_bytes=None) as prober:
        prober.probe(batch_size)  # the first trial runs more ops (FSDP2's lazy initialisation, DTensor's caches)
        injector.reset(recording=True)
        prober.probe(batch_size)
        ops = len(injector.labels)
        for index, seed in enumerate(seeds):  # seed i draws its op from the i-th of len(seeds) equal stretches
            rng = random.Random(f"fsdp {world_size} {seed}")
            stretch = range(
                index * ops // len(seeds), max((index + 1) * ops // len(seeds), index * ops // len(seeds) + 1)
            )
            op = 0 if index == 0 else rng.choice(stretch)  # the first at the step's first op: the batch's copy
            after, kind = rng.random() < 0.5, "oom" if seed % 3 else "oom-message"
            injector.reset(OpFault(kind, op, after, "injected"))
            problem, fired = _faulted_then_clean(prober, injector, device, batch_size, fresh)
            phases.add(fired)
            tally.record(f"{world_size} ranks, op {op} of {ops} ({'after' if after else 'before'}, {kind})", problem)
    return tally, phases


def _faulted_then_clean(
    prober: Any, injector: Any, device: Any, batch_size: int, fresh: bf.Trial
) -> tuple[str | None, str | None]:
    """The armed trial, then a clean one on the same prober: what went wrong, if anything, and the phase the
    fault fired in."""
    fired = None
    try:
        failed = prober.probe(batch_size)
        fired = injector.fired_phase
        injector.reset()
        if failed.fits or not failed.oom:
            return f"the faulted trial {'fit' if failed.fits else 'failed otherwise'}", fired
        trial = prober.probe(batch_size)
    except Exception as error:  # a trial after the fault raised: the campaign counts it
        return f"{type(error).__name__}: {str(error).splitlines()[-1][:120]}", fired
    left = device.live_bytes() - prober.baseline_bytes
    if (trial.fits, trial.peak_bytes, left) != (True, fresh.peak_bytes, 0):
        return f"next trial fits={trial.fits} peak={trial.peak_bytes} (fresh {fresh.peak_bytes}), {left} B left", fired
    return None, fired
