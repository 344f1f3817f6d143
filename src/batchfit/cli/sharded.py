"""The CLI's sharded side: the parallelism options (``--gpus``, ``--nodes``, ``--fsdp``, ...) turned into
``Parallelism`` settings, and what ``batchfit estimate`` prints and writes for a model built from its config
(an LLM preset or a config.json), per rank.

The work is in ``batchfit.workflows`` (``estimate_config``, ``plan_sharded``) over ``batchfit.parallel``; this
module parses and prints.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Annotated
from typing import Any

import typer

from batchfit.cli.common import console
from batchfit.cli.common import print_answer
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError

if TYPE_CHECKING:  # the library loads when a command runs, not with its help: imported inside the functions
    import rich.table

    from batchfit.parallel.settings import Parallelism
    from batchfit.parallel.trace import ShardedEstimate
    from batchfit.workflows.sharded_estimate import ConfigEstimate

Gpus = Annotated[
    int | None,
    typer.Option(
        help="GPUs in all (over every node). A plan spreads the global batch over them; with a model, memory is "
        "per rank, under FSDP2 over a fake process group."
    ),
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

    @property
    def asked(self) -> bool:
        """Whether a parallelism was asked for (ranks, nodes, FSDP2 or its CPU offload): the workload's route
        is then sharded (``batchfit.workflows.route_workload``).

        >>> ParallelOptions().asked, ParallelOptions(gpus=8).asked, ParallelOptions(cpu_offload=True).asked
        (False, True, True)
        """
        return any((self.gpus is not None, self.nodes is not None, self.fsdp, self.hybrid_shard, self.cpu_offload))

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

    def choices(self, checkpointing: str) -> list[Parallelism]:
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
) -> list[Parallelism]:
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


def estimate_sharded(
    workload: str,
    capacity: str,
    batch_size: int | None,
    seq_len: int | None,
    choices: list[Parallelism],
    json_path: Path | None,
    quiet: bool,
) -> None:
    """Per rank, for each activation-checkpointing choice: the largest micro-batch within ``capacity``
    and the breakdown at ``batch_size`` (else at that largest size); which choice reaches ``batch_size``
    (``batchfit.workflows.estimate_config``), printed and written."""
    from batchfit.cli.common import write_json
    from batchfit.cli.progress import ConsoleProgress
    from batchfit.workflows.ranks import capacity_of
    from batchfit.workflows.ranks import describe_parallelism
    from batchfit.workflows.routing import DEFAULT_SEQ_LEN
    from batchfit.workflows.sharded_estimate import estimate_config

    if not quiet:
        capacity_bytes, label = capacity_of(capacity)
        console.print(
            f"batchfit estimate: [bold]{workload}[/] at sequence {seq_len or DEFAULT_SEQ_LEN}, "
            f"{describe_parallelism(choices[0])}, on {label} ({format_bytes(capacity_bytes)} usable per rank), traced "
            "with torch's fully_shard over a fake process group: nothing runs on a GPU.",
            highlight=False,
        )
    found = estimate_config(
        workload, capacity, choices, batch_size=batch_size, seq_len=seq_len, progress=ConsoleProgress()
    )
    if quiet:
        print_answer(found.choices[0].largest.batch_size)
    else:
        _print_sharded(found)
    if json_path is not None:
        write_json(json_path, found.to_dict())


def _print_sharded(found: ConfigEstimate) -> None:
    from batchfit.workflows.ranks import host_line

    for choice in found.choices:
        console.print(breakdown_table(choice.at, choice.parallelism.activation_checkpointing))
        if choice.at.host_peak_bytes is not None:
            console.print(host_line(choice.at), highlight=False)
        console.print(
            f"[bold green]Activation checkpointing {choice.parallelism.activation_checkpointing}: the largest "
            f"micro-batch per rank is {choice.largest.batch_size} x {choice.at.seq_len} tokens "
            f"({choice.largest.traces} traces).[/]",
            highlight=False,
        )
    if found.batch_size is not None:
        reaching = found.fitting()
        verdict = f"with activation checkpointing {' or '.join(reaching)}" if reaching else "with no choice asked for"
        console.print(f"Micro-batch {found.batch_size} per rank fits {verdict}.", highlight=False)
    console.print(
        "Not traced: NCCL's buffers, the CUDA context beyond the preset's reserve, allocator fragmentation. "
        "No GPU has checked these figures.",
        style="dim",
    )


def breakdown_table(estimate: ShardedEstimate, checkpointing: str) -> rich.table.Table:
    """The per-rank breakdown at one micro-batch, largest part first."""
    from rich.table import Table

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
    except (ValueError, OverflowError):  # not a number, or inf
        raise InputError(f"--global-batch-tokens must be a count such as 32768 or 4M, got {text!r}") from None
    if tokens < 1:
        raise InputError(f"--global-batch-tokens must be at least 1, got {text!r}")
    return tokens
