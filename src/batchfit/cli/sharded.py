"""The CLI's sharded side: the parallelism options, and ``batchfit estimate`` for a model built from its
config (an LLM preset or a config.json), per rank, traced with torch's FSDP2 over a fake process group.

Computing is in ``batchfit.parallel``; this module turns options into ``Parallelism`` settings and
prints or writes what the traces say.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated
from typing import Any

import typer
from rich.table import Table

from batchfit._version import versions
from batchfit.cli.common import console
from batchfit.cli.report import write_json
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError

DEFAULT_SEQ_LEN = 4096  # a model from its config trains on token ids: this many per sample unless --seq-len

Gpus = Annotated[
    int | None,
    typer.Option(help="Ranks in all (GPUs over every node): memory per rank, under FSDP2 over a fake process group."),
]
Nodes = Annotated[int | None, typer.Option(help="Nodes; with --gpus-per-node, the ranks are their product.")]
GpusPerNode = Annotated[int | None, typer.Option(help="Ranks per node (hybrid shard splits within a node).")]
Fsdp = Annotated[bool, typer.Option("--fsdp", help="FSDP2 full shard (the default with more than one rank).")]
HybridShard = Annotated[
    bool, typer.Option("--hybrid-shard", help="FSDP2 hybrid shard: split within a node, replicate across nodes.")
]
ParamDtype = Annotated[
    str | None,
    typer.Option(help="FSDP2 mixed precision: the dtype parameters are gathered and computed in, e.g. bf16."),
]
ReduceDtype = Annotated[
    str | None, typer.Option(help="FSDP2 mixed precision: the dtype gradients are reduced in, e.g. fp32.")
]
CpuOffload = Annotated[
    bool,
    typer.Option(
        "--cpu-offload",
        help="FSDP2's CPU offload: sharded parameters, gradients and optimizer state in host memory, the "
        "optimizer step on the CPU (traced on a fake accelerator; with a model from its config).",
    ),
]
Checkpointing = Annotated[
    str,
    typer.Option(
        help="none, selective (torchtitan's op-level policy: each block keeps every other matmul's and the "
        "attention's outputs, recomputes the rest), full (every repeated block recomputed), or several to "
        "compare: none,selective,full."
    ),
]


@dataclass(frozen=True)
class ParallelOptions:
    """The world and sharding options ``find``, ``estimate`` and ``plan`` share (see ``parallel_options``)."""

    gpus: int | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    fsdp: bool = False
    hybrid_shard: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False

    def wanted(self, workload: str) -> bool:
        """Whether the command takes the sharded path (see ``wants_sharded``)."""
        return self.cpu_offload or wants_sharded(workload, self.gpus, self.nodes, self.fsdp, self.hybrid_shard)

    def refuse_unused(self, rank: int = 0) -> None:
        """One line, exit code 2, for the options only a sharded run reads when the run is not sharded: they
        would be ignored without a word."""
        given = [
            f"--{name}"
            for name, value in (("param-dtype", self.param_dtype), ("reduce-dtype", self.reduce_dtype))
            if value
        ]
        given += ["--gpus-per-node"] if self.gpus_per_node is not None else []
        given += ["--rank"] if rank else []
        if given:
            raise InputError(
                f"{', '.join(given)} only {'apply' if len(given) > 1 else 'applies'} to a sharded run: add --gpus N (or --nodes and "
                "--gpus-per-node), "
                "or drop them"
            )

    def world(self) -> tuple[int, int | None]:
        """The ranks in all and per node (see ``world_size_of``)."""
        return world_size_of(self.gpus, self.nodes, self.gpus_per_node)

    def choices(self, checkpointing: str) -> list[Any]:
        """One ``Parallelism`` per activation-checkpointing choice (see ``parallelisms``)."""
        return parallelisms(
            self.world(), self.hybrid_shard, self.param_dtype, self.reduce_dtype, checkpointing, self.cpu_offload
        )


NO_PARALLEL_OPTIONS = ParallelOptions()

OPTION_TYPES = {
    "gpus": (Gpus, None),
    "nodes": (Nodes, None),
    "gpus_per_node": (GpusPerNode, None),
    "fsdp": (Fsdp, False),
    "hybrid_shard": (HybridShard, False),
    "param_dtype": (ParamDtype, None),
    "reduce_dtype": (ReduceDtype, None),
    "cpu_offload": (CpuOffload, False),
}


def parallel_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """A typer command with the options of ``ParallelOptions`` (``--gpus``, ``--nodes``, ...)
    added to its signature, which receives them as one ``parallel: ParallelOptions`` argument."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "parallel"]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
        for name, (annotation, default) in OPTION_TYPES.items()
    ]

    @functools.wraps(command)
    def with_options(*args: Any, **kwargs: Any) -> Any:
        parallel = ParallelOptions(**{name: kwargs.pop(name) for name in OPTION_TYPES})
        return command(*args, parallel=parallel, **kwargs)

    with_options.__signature__ = signature.replace(parameters=[*own, *added])
    with_options.__annotations__ = {p.name: p.annotation for p in (*own, *added)}
    return with_options


def capacity_of(capacity: str) -> tuple[int, str]:
    """The usable bytes per rank and a label, from a GPU preset (``h100-80gb``) or a size (``80GiB``).

    >>> capacity_of("64MiB")
    (67108864, 'a 64.0 MiB device')
    """
    from batchfit.devices.presets import is_preset
    from batchfit.devices.presets import preset
    from batchfit.devices.trace import trace_capacity_bytes

    capacity_bytes = trace_capacity_bytes(capacity)  # a one-line error names both forms
    return capacity_bytes, preset(capacity).label if is_preset(capacity) else f"a {format_bytes(capacity_bytes)} device"


def wants_sharded(workload: str, gpus: int | None, nodes: int | None, fsdp: bool, hybrid_shard: bool) -> bool:
    """Whether ``batchfit estimate`` takes the sharded path: a model from its config, or a parallelism asked for.

    >>> wants_sharded("llama-3-8b", None, None, False, False), wants_sharded("gpt-tiny", None, None, False, False)
    (True, False)
    """
    return from_config(workload) or gpus is not None or nodes is not None or fsdp or hybrid_shard


def from_config(workload: str) -> bool:
    """Whether ``workload`` names a model built from its config: an LLM preset or a config.json.

    >>> from_config("llama-3-8b"), from_config("my/config.json"), from_config("train.py:make")
    (True, True, False)
    """
    from batchfit.parallel.models import LLM_PRESETS

    return workload in LLM_PRESETS or workload.endswith(".json")


def world_size_of(gpus: int | None, nodes: int | None, gpus_per_node: int | None) -> tuple[int, int | None]:
    """The ranks in all and per node, from ``--gpus`` and/or ``--nodes`` x ``--gpus-per-node``.

    >>> world_size_of(None, 4, 8), world_size_of(16, None, 8), world_size_of(None, None, None)
    ((32, 8), (16, 8), (1, None))
    """
    for flag, value in (("--gpus", gpus), ("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be at least 1, got {value}")
    if nodes is not None and gpus_per_node is None:
        raise InputError("--nodes needs --gpus-per-node (e.g. --nodes 4 --gpus-per-node 8)")
    if nodes is not None:
        product = nodes * gpus_per_node
        if gpus is not None and gpus != product:
            raise InputError(
                f"--gpus {gpus} disagrees with --nodes {nodes} x --gpus-per-node {gpus_per_node} = {product}: give one"
            )
        return product, gpus_per_node
    return (gpus if gpus is not None else gpus_per_node or 1), gpus_per_node


def parallelisms(
    world: tuple[int, int | None],
    hybrid_shard: bool,
    param_dtype: str | None,
    reduce_dtype: str | None,
    checkpointing: str,
    cpu_offload: bool = False,
) -> list[Any]:
    """One ``Parallelism`` per activation-checkpointing choice asked for, in order
    (``"none,selective,full"``: all three). FSDP2 shards even one rank where its mixed precision
    or CPU offload is asked for."""
    from batchfit.parallel.settings import Parallelism

    world_size, gpus_per_node = world
    fsdp = world_size > 1 or param_dtype or reduce_dtype or cpu_offload
    sharding = "hybrid" if hybrid_shard else ("fsdp" if fsdp else "none")
    choices = [choice.strip() for choice in checkpointing.split(",") if choice.strip()]
    if not choices:
        raise InputError("--activation-checkpointing needs none, selective, full, or several: none,selective,full")
    return [
        Parallelism(
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            sharding=sharding,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            activation_checkpointing=choice,
            cpu_offload=cpu_offload,
        )
        for choice in dict.fromkeys(choices)
    ]


def describe_parallelism(parallelism: Any) -> str:
    """One phrase: ``"rank 0 of 8, FSDP2 full shard, bf16 compute, fp32 reduce"``."""
    sharding = {
        "fsdp": "FSDP2 full shard",
        "hybrid": f"FSDP2 hybrid shard ({parallelism.gpus_per_node} per node)",
        "none": "one process, not sharded",
    }[parallelism.sharding]
    parts = [f"rank {parallelism.rank} of {parallelism.world_size}", sharding]
    if parallelism.param_dtype is not None:
        parts.append(f"{str(parallelism.param_dtype).removeprefix('torch.')} compute")
    if parallelism.reduce_dtype is not None:
        parts.append(f"{str(parallelism.reduce_dtype).removeprefix('torch.')} reduce")
    if parallelism.cpu_offload:
        parts.append("CPU offload")
    return ", ".join(parts)


def estimate_sharded(
    workload: str,
    capacity: str,
    batch_size: int | None,
    seq_len: int | None,
    choices: list[Any],
    json_path: Path | None,
    quiet: bool,
) -> None:
    """Per rank, for each activation-checkpointing choice: the largest micro-batch within ``capacity``
    and the breakdown at ``batch_size`` (else at that largest size); which choice reaches ``batch_size``."""
    from batchfit.parallel.fit import largest_batch_size
    from batchfit.parallel.models import model_config
    from batchfit.parallel.trace import trace_rank

    model_config(workload)  # a file that is not a model config, or an unknown name, fails here in one line
    seq_len = seq_len or DEFAULT_SEQ_LEN
    capacity_bytes, label = capacity_of(capacity)
    if not quiet:
        console.print(
            f"batchfit estimate: [bold]{workload}[/] at sequence {seq_len}, {describe_parallelism(choices[0])}, on "
            f"{label} ({format_bytes(capacity_bytes)} usable per rank), traced with torch's fully_shard over a fake "
            "process group: nothing runs on a GPU.",
            highlight=False,
        )
    results = []
    for parallelism in choices:
        with console.status(f"Tracing one rank, activation checkpointing {parallelism.activation_checkpointing}"):
            found = largest_batch_size(workload, seq_len, capacity_bytes, parallelism=parallelism)
            at = found.estimate
            if batch_size is not None and batch_size != found.batch_size:
                at = trace_rank(workload, batch_size, seq_len, parallelism=parallelism)
        results.append((parallelism, found, at))
    if quiet:
        console.print(results[0][1].batch_size)
    else:
        _print_sharded(results, capacity_bytes, batch_size)
    if json_path is not None:
        write_json(json_path, _document(workload, capacity, capacity_bytes, seq_len, results))


def _print_sharded(results: list[tuple[Any, Any, Any]], capacity_bytes: int, batch_size: int | None) -> None:
    for parallelism, found, at in results:
        console.print(breakdown_table(at, parallelism.activation_checkpointing))
        if at.host_peak_bytes is not None:
            console.print(host_line(at), highlight=False)
        console.print(
            f"[bold green]Activation checkpointing {parallelism.activation_checkpointing}: the largest micro-batch "
            f"per rank is {found.batch_size} x {at.seq_len} tokens ({found.traces} traces).[/]",
            highlight=False,
        )
    if batch_size is not None:
        reaching = [p.activation_checkpointing for p, _, at in results if at.peak_bytes <= capacity_bytes]
        verdict = f"with activation checkpointing {' or '.join(reaching)}" if reaching else "with no choice asked for"
        console.print(f"Micro-batch {batch_size} per rank fits {verdict}.", highlight=False)
    console.print(
        "Not traced: NCCL's buffers, the CUDA context beyond the preset's reserve, allocator fragmentation. "
        "No GPU has checked these figures.",
        style="dim",
    )


def host_line(estimate: Any) -> str:
    """With CPU offload: the host memory one rank needs, by part, and a node of its ranks.

    >>> from batchfit.parallel import Parallelism
    >>> from batchfit.parallel.trace import ShardedEstimate
    >>> at = ShardedEstimate(2**30, {"activations": 2**30}, 16, 1, 64, "backward", Parallelism(world_size=16,
    ...     gpus_per_node=8, cpu_offload=True), host_peak_bytes=3 * 2**30, host_breakdown={"optimizer_state": 3 * 2**30})
    >>> host_line(at)
    'Host memory per rank (CPU offload): 3.0 GiB at its peak (optimizer state 3.0 GiB); 24.0 GiB for a node of 8 ranks, pinned by FSDP2 by default.'
    """
    parts = sorted(estimate.host_breakdown.items(), key=lambda item: -item[1])
    listed = ", ".join(f"{name.replace('_', ' ')} {format_bytes(nbytes)}" for name, nbytes in parts)
    per_node = estimate.parallelism.gpus_per_node or estimate.world_size
    return (
        f"Host memory per rank (CPU offload): {format_bytes(estimate.host_peak_bytes)} at its peak ({listed}); "
        f"{format_bytes(per_node * estimate.host_peak_bytes)} for a node of {per_node} ranks, pinned by FSDP2 by default."
    )


def breakdown_table(estimate: Any, checkpointing: str) -> Table:
    """The per-rank breakdown at one micro-batch, largest part first."""
    table = Table(
        title=f"Per rank at micro-batch {estimate.batch_size} (activation checkpointing {checkpointing}, "
        f"peak in {estimate.peak_phase})"
    )
    table.add_column("part")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    for name, nbytes in sorted(estimate.breakdown.items(), key=lambda item: -item[1]):
        if nbytes:
            table.add_row(name.replace("_", " "), format_bytes(nbytes), f"{nbytes / estimate.peak_bytes:.0%}")
    table.add_row("[bold]peak[/]", f"[bold]{format_bytes(estimate.peak_bytes)}[/]", "100%")
    return table


def _document(
    workload: str, capacity: str, capacity_bytes: int, seq_len: int, results: list[tuple[Any, Any, Any]]
) -> dict[str, Any]:
    """The JSON: the first choice's figures at the top (``peak_bytes``, ``breakdown``, ``world_size``,
    ``largest_batch_size``, all per rank), every choice under ``choices``."""
    _, found, at = results[0]
    return {
        "peak_bytes": at.peak_bytes,
        "breakdown": dict(at.breakdown),
        "world_size": at.world_size,
        "largest_batch_size": found.batch_size,
        **at.host_part(),
        "batch_size": at.batch_size,
        "seq_len": seq_len,
        "workload": {"name": workload, "options": {"seq_len": seq_len}},
        "device": {"name": capacity, "capacity_bytes": capacity_bytes, "per_rank": True},
        "parallelism": at.parallelism.to_dict(),
        "choices": [
            {
                "activation_checkpointing": parallelism.activation_checkpointing,
                "largest_batch_size": found.batch_size,
                "estimate": estimate.to_dict(),
                "search": found.to_dict(),
            }
            for parallelism, found, estimate in results
        ],
        "not_traced": ["NCCL buffers", "the CUDA context beyond the preset's reserve", "allocator fragmentation"],
        "versions": versions(),
    }


def parse_tokens(text: str | None) -> int | None:
    """A token count: an integer, or with K, M or G for 2**10, 2**20, 2**30, as LLM papers count
    batches (Llama 3's "4M tokens" is 1,024 sequences of 4,096).

    >>> parse_tokens("4M"), parse_tokens("32768"), parse_tokens(None)
    (4194304, 32768, None)
    """
    if text is None:
        return None
    cleaned = text.strip().upper().replace("_", "").replace(",", "")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(cleaned[-1:], 1)
    digits = cleaned[:-1] if scale > 1 else cleaned
    try:
        tokens = round(float(digits) * scale)
    except ValueError:
        raise InputError(f"--global-batch-tokens must be a count such as 32768 or 4M, got {text!r}") from None
    if tokens < 1:
        raise InputError(f"--global-batch-tokens must be at least 1, got {text!r}")
    return tokens


def measure_per_rank(workload: str, capacity: str, seq_len: int, choices: list[Any]) -> list[tuple[Any, Any]]:
    """The largest micro-batch per rank within ``capacity`` for each parallelism in ``choices``."""
    from batchfit.parallel.fit import largest_batch_size
    from batchfit.parallel.models import model_config

    model_config(workload)  # an unknown name or a file that is not a model config fails here in one line
    capacity_bytes, _ = capacity_of(capacity)
    found = []
    for parallelism in choices:
        with console.status(f"Tracing one rank, activation checkpointing {parallelism.activation_checkpointing}"):
            found.append((parallelism, largest_batch_size(workload, seq_len, capacity_bytes, parallelism=parallelism)))
        console.print(
            f"Traced {describe_parallelism(parallelism)}, activation checkpointing "
            f"{parallelism.activation_checkpointing}: the largest micro-batch per rank is {found[-1][1].batch_size}.",
            highlight=False,
        )
    if found[0][1].estimate.host_peak_bytes is not None:  # the host holds the same state whatever the choice
        console.print(host_line(found[0][1].estimate), highlight=False)
    return found


def choose_checkpointing(found: list[tuple[Any, Any]], seq_len: int, capacity: str) -> tuple[Any, Any]:
    """The choice a plan uses: no activation checkpointing where a micro-batch of 1 fits without it
    (recomputing every block costs about a third more compute per step), else the choice that fits
    the most; a one-line error when none fits even 1."""
    fitting = [(parallelism, largest) for parallelism, largest in found if largest.batch_size >= 1]
    if not fitting:
        tried = ", ".join(parallelism.activation_checkpointing for parallelism, _ in found)
        raise InputError(
            f"not even micro-batch 1 x {seq_len} tokens fits per rank on {capacity} (activation checkpointing "
            f"{tried}): use more ranks, --activation-checkpointing full, a shorter --seq-len or --param-dtype bf16"
        )
    plain = [item for item in fitting if item[0].activation_checkpointing == "none"]
    return plain[0] if plain else max(fitting, key=lambda item: item[1].batch_size)


RECOMPUTE_COST = {  # what each choice costs in backward, as the advice says it
    "full": "about a third more compute per step (every block's forward runs again in backward)",
    "selective": "some more compute per step (each block recomputes its cheap ops and every other matmul in backward)",
}


def checkpointing_advice(found: list[tuple[Any, Any]], chosen: Any, plan: Any) -> list[str]:
    """Advice where another checkpointing choice would need fewer accumulation steps."""
    per_rank = -(-plan.target_samples // plan.devices)  # samples each rank must see per optimizer step
    advice = []
    for parallelism, largest in found:
        if parallelism is chosen or largest.batch_size <= plan.micro_batch_size:
            continue
        steps = -(-per_rank // largest.batch_size)
        if steps < plan.gradient_accumulation_steps:
            advice.append(
                f"activation checkpointing {parallelism.activation_checkpointing} fits {largest.batch_size} per rank: "
                f"{steps} accumulation step(s) instead of {plan.gradient_accumulation_steps}, for "
                + RECOMPUTE_COST[parallelism.activation_checkpointing]
            )
    return advice


def plan_document(plan: Any, found: list[tuple[Any, Any]], chosen: Any, capacity: str) -> dict[str, Any]:
    """The plan's JSON with the sharded part: the parallelism, the chosen checkpointing, and per choice
    the largest micro-batch per rank and the breakdown at it."""
    document = plan.to_dict()
    document["sharding"] = {
        "parallelism": chosen.to_dict(),
        "activation_checkpointing": chosen.activation_checkpointing,
        "device": capacity,
        "per_rank": [
            {
                "activation_checkpointing": parallelism.activation_checkpointing,
                "largest_batch_size": largest.batch_size,
                "peak_bytes": largest.estimate.peak_bytes,
                "breakdown": dict(largest.estimate.breakdown),
                **largest.estimate.host_part(),
            }
            for parallelism, largest in found
        ],
        "not_traced": ["NCCL buffers", "the CUDA context beyond the preset's reserve", "allocator fragmentation"],
    }
    return document


def with_gradients_held(workload: str, capacity: str, seq_len: int, parallelism: Any, largest: Any) -> int:
    """The largest micro-batch per rank when the accumulation window's gradients are alive through
    a later micro-batch: FSDP2 keeps each rank's reduced gradient shards from one micro-batch to the
    next, so the capacity left is smaller by their bytes (``state_bytes["gradients"]`` of the trace)."""
    from batchfit.parallel.fit import largest_batch_size

    gradients = largest.estimate.state_bytes.get("gradients", 0)
    if gradients == 0:  # CPU offload: the gradient shards are held on the host
        return largest.batch_size
    capacity_bytes, _ = capacity_of(capacity)
    with console.status("Tracing again with the accumulation window's gradients held"):
        held = largest_batch_size(workload, seq_len, capacity_bytes - gradients, parallelism=parallelism)
    console.print(
        f"With the window's gradient shards held ({format_bytes(gradients)} per rank), the largest micro-batch "
        f"per rank is {held.batch_size}.",
        highlight=False,
    )
    if held.batch_size < 1:
        raise InputError(
            f"micro-batch 1 fits per rank, but not with the accumulation window's gradients held "
            f"({format_bytes(gradients)}): use more ranks or --activation-checkpointing full"
        )
    return held.batch_size
