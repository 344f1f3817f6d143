"""The faces of ``find``, ``estimate``, ``optimal``, ``plan`` and ``list-workloads``: each command's options,
help and example, and a call into its body (``batchfit.cli.find``, ...), imported only when it runs, so
``batchfit --help`` and every ``COMMAND --help`` load no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from batchfit.cli import one_rank
from batchfit.cli import sharded
from batchfit.cli.common import AllocatorOption
from batchfit.cli.common import AmpOption
from batchfit.cli.common import CacheDir
from batchfit.cli.common import Debug
from batchfit.cli.common import Framework
from batchfit.cli.common import FrameworkOption
from batchfit.cli.common import Goal
from batchfit.cli.common import ImageSize
from batchfit.cli.common import KeepOutput
from batchfit.cli.common import LrScaling
from batchfit.cli.common import SeqLen
from batchfit.cli.common import SetOption
from batchfit.cli.common import app
from batchfit.cli.common import cli_errors
from batchfit.search.strategies import STRATEGIES


@app.command(
    "find", epilog="Example: batchfit find gpt-tiny --seq-len 128 --device sim:8GiB --json out.json --plot out.png"
)
@cli_errors
@sharded.parallel_options
def find(
    workload: Annotated[
        str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")
    ] = "gpt-tiny",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps or sim:CAPACITY (e.g. sim:8GiB).")] = "auto",
    strategy: Annotated[str, typer.Option(help=f"One of: {', '.join(STRATEGIES)}.")] = "auto",
    min_batch_size: Annotated[int, typer.Option(help="Smallest size to consider.")] = 1,
    max_batch_size: Annotated[int | None, typer.Option(help="Largest size to consider.")] = None,
    margin: Annotated[str, typer.Option(help="Headroom: bytes, a size like 512MiB, or a fraction like 0.05.")] = "0",
    max_trials: Annotated[int | None, typer.Option(help="Stop after this many trials.")] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(help="Start no trial after this many seconds; answer the largest size confirmed so far."),
    ] = None,
    trace: Annotated[
        bool | None,
        typer.Option(
            "--trace/--no-trace",
            help="With --strategy auto: always (--trace) or never (--no-trace) estimate the edge on fake tensors "
            "first; by default auto spends the cheaper evidence, deciding from what a trial costs.",
        ),
    ] = None,
    cache: Annotated[
        bool,
        typer.Option(
            help="Answer from the result cache when this very search ran before (0 trials); --cache-dir implies it."
        ),
    ] = False,
    cache_dir: CacheDir = None,
    seq_len: SeqLen = None,
    image_size: ImageSize = None,
    amp: AmpOption = None,
    keep_output: KeepOutput = True,
    framework: FrameworkOption = None,
    model_settings: SetOption = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of peak memory against batch size here.")] = None,
    memory_snapshot: Annotated[
        Path | None,
        typer.Option(
            help="Write the answer's trial, run again, as a PyTorch memory snapshot here (on a CUDA GPU, or a "
            "device modelling its caching allocator: sim:CAPACITY:cuda); view it at pytorch.org/memory_viz or "
            "replay it with batchfit allocator."
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the batch size.")] = False,
    soak: Annotated[
        int | None,
        typer.Option(
            help="Answer for a run of this many steps (e.g. 1000), replayed through the caching allocator model "
            "(sim:CAPACITY:cuda): the largest batch that holds for every step; the fresh-cache answer beside it."
        ),
    ] = None,
    eval_every: Annotated[
        int | None, typer.Option(help="With --soak: an evaluation pass every this many steps (e.g. 100).")
    ] = None,
    parallel: sharded.ParallelOptions = sharded.NO_PARALLEL_OPTIONS,
    activation_checkpointing: sharded.Checkpointing = "none",
    rank: one_rank.Rank = 0,
    debug: Debug = False,
) -> None:
    """Find the largest batch size that really fits: every answer is a size a trial ran.

    With --gpus N (or --nodes and --gpus-per-node), the model (built from its config for an LLM
    preset or a config.json, else the workload's own, copied) is sharded with FSDP2 over a fake
    process group of N ranks, and one rank's real trials run on this device: the largest
    micro-batch per rank."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.find import run_find  # torch and the workload load only when it runs

    run_find(**options)


@app.command("estimate", epilog="Example: batchfit estimate gpt-tiny --seq-len 1024 --gpu a100-40gb --batch-size 32")
@cli_errors
@sharded.parallel_options
def estimate(
    workload: Annotated[
        str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")
    ] = "gpt-tiny",
    gpu: Annotated[
        str | None, typer.Option(help="A GPU preset, e.g. a100-40gb, h100-80gb, rtx4090-24gb, apple-64gb.")
    ] = None,
    capacity: Annotated[str | None, typer.Option(help="A memory size instead of a preset, e.g. 40GiB.")] = None,
    reserve: Annotated[
        str | None, typer.Option(help="Override the preset's per-process reserve, e.g. 500MiB or 0.")
    ] = None,
    allocator: AllocatorOption = None,
    margin: Annotated[
        str,
        typer.Option(
            help="Headroom: bytes, a size like 512MiB, or a fraction like 0.05. auto: none, or 5% of the card where "
            "the trace ran something only the card sizes (cuDNN's convolution workspaces)."
        ),
    ] = "auto",
    accumulating: Annotated[
        bool,
        typer.Option(
            help="Estimate a later micro-batch of an accumulation window: the gradients held through forward and "
            "backward, as training with gradient accumulation runs."
        ),
    ] = False,
    batch_size: Annotated[int | None, typer.Option(help="Say whether this batch size fits, and break it down.")] = None,
    seq_len: SeqLen = None,
    image_size: ImageSize = None,
    amp: AmpOption = None,
    keep_output: KeepOutput = True,
    model_settings: SetOption = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the estimate as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the memory curve here.")] = None,
    memory_snapshot: Annotated[
        Path | None,
        typer.Option(
            help="Write the traced trial at the answer (or at --batch-size) as a PyTorch memory snapshot of the "
            "modelled caching allocator here; view it at pytorch.org/memory_viz or replay it with batchfit allocator."
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the largest batch size.")] = False,
    parallel: sharded.ParallelOptions = sharded.NO_PARALLEL_OPTIONS,
    activation_checkpointing: sharded.Checkpointing = "none",
    debug: Debug = False,
) -> None:
    """Estimate memory without the hardware: the largest batch that fits on a GPU, and a breakdown.

    An LLM preset (batchfit list-workloads) or a Hugging Face config.json is built from its config
    on fake tensors and traced per rank: with --gpus N (or --nodes and --gpus-per-node) under
    FSDP2, sharded by torch's own fully_shard over a fake process group."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.estimate import run_estimate  # torch and the workload load only when it runs

    run_estimate(**options)


@app.command("optimal", epilog="Example: batchfit optimal cnn-small --device sim:512MiB --tolerance 0.05 --plot t.png")
@cli_errors
def optimal(
    workload: Annotated[
        str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")
    ] = "gpt-tiny",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps or sim:CAPACITY.")] = "auto",
    max_batch_size: Annotated[int | None, typer.Option(help="The largest batch to time (else found first).")] = None,
    tolerance: Annotated[
        float, typer.Option(help="Pick the smallest batch within this share of the best throughput.")
    ] = 0.05,
    safety_fraction: Annotated[
        float | None, typer.Option(help="Stay below this share of the maximum, e.g. 0.8.")
    ] = None,
    timing_warmup_steps: Annotated[
        int, typer.Option(help="Untimed warm-up steps per batch size, before the timed ones.")
    ] = 2,
    timed_steps: Annotated[
        int, typer.Option(help="Timed steps per batch size (their median counts), after the warm-up steps.")
    ] = 5,
    noise_scale: Annotated[
        float | None, typer.Option(help="B_simple (batchfit critical): also report the goodput-optimal batch (Pollux).")
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option(help="Sequence length, for workloads that take one (adds tokens/s).")
    ] = None,
    image_size: ImageSize = None,
    amp: AmpOption = None,
    keep_output: KeepOutput = True,
    model_settings: SetOption = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG of throughput and memory against batch size here.")
    ] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(help="Time no new batch size after this many seconds (the search for the largest included)."),
    ] = None,
    checkpointing: Annotated[
        str | None,
        typer.Option(
            help="Compare activation-checkpointing policies, applied to the model and undone: auto, or several of "
            "none, selective, selective-matmuls, full, full:K (every K-th block), hf (a Hugging Face model's own); "
            "each one's largest batch and throughput, and the fastest."
        ),
    ] = None,
    debug: Debug = False,
) -> None:
    """Maximum is not optimal: time steps across batch sizes and pick the throughput-optimal one."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.optimal import run_optimal  # torch and the workload load only when it runs

    run_optimal(**options)


@app.command(
    "plan",
    epilog="Example: batchfit plan --micro-batch-size 16 --global-batch-tokens 32768 --seq-len 256 --base-lr 3e-4 --base-batch-size 65536",
)
@cli_errors
@sharded.parallel_options
def plan(
    workload: Annotated[
        str | None, typer.Argument(help="Measure the micro-batch on this workload (else give --micro-batch-size).")
    ] = None,
    micro_batch_size: Annotated[
        int | None,
        typer.Option(
            help="The largest micro-batch that fits, if known: a plan may use a smaller one that divides the "
            "global batch exactly, and says why."
        ),
    ] = None,
    global_batch_size: Annotated[int | None, typer.Option(help="Target global batch in samples.")] = None,
    global_batch_tokens: Annotated[
        str | None,
        typer.Option(
            help="Target global batch in tokens (with --seq-len): a count (491520), or K and M as powers of two "
            "(4M = 4 x 2**20; 0.5M = 524,288)."
        ),
    ] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sample.")] = None,
    devices: Annotated[
        int | None,
        typer.Option(
            help="Data-parallel devices, the same as --gpus (default: torch.distributed's world size, else 1)."
        ),
    ] = None,
    base_lr: Annotated[float | None, typer.Option(help="The learning rate tuned at --base-batch-size.")] = None,
    base_batch_size: Annotated[
        int | None, typer.Option(help="The batch --base-lr was tuned at (same unit as the target).")
    ] = None,
    lr_scaling: Annotated[
        LrScaling, typer.Option(help="linear (Goyal 2017), sqrt (Adam; Malladi 2022) or none.")
    ] = LrScaling.linear,
    warmup_epochs: Annotated[
        int | None, typer.Option(help="Learning-rate warmup epochs (else suggested from the scale).")
    ] = None,
    warmup_steps: Annotated[
        int | None, typer.Option(help="Learning-rate warmup in optimizer steps, instead of epochs.")
    ] = None,
    dataset_size: Annotated[int | None, typer.Option(help="Samples per epoch, for steps per epoch.")] = None,
    epochs: Annotated[int | None, typer.Option(help="Epochs, for total steps.")] = None,
    goal: Annotated[
        Goal | None, typer.Option(help="accuracy, speed or memory: what the warnings and advice aim for.")
    ] = None,
    fine_tuning: Annotated[bool, typer.Option(help="Fine-tuning: small batch and learning rate.")] = False,
    model_family: Annotated[
        str | None, typer.Option(help="gpt2, bert, llama or resnet50-imagenet: a typical target if none is given.")
    ] = None,
    device: Annotated[str, typer.Option(help="Where to measure the micro-batch, with WORKLOAD.")] = "auto",
    margin: Annotated[
        str, typer.Option(help="Headroom kept when measuring: bytes, a size like 512MiB, or a fraction like 0.05.")
    ] = "0",
    keep_output: KeepOutput = True,
    model_settings: SetOption = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write BatchPlan.to_dict() here.")] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="Per rank, for a model built from its config: a GPU preset (h100-80gb) or a size (80GiB)."),
    ] = None,
    parallel: sharded.ParallelOptions = sharded.NO_PARALLEL_OPTIONS,
    activation_checkpointing: Annotated[
        str | None,
        typer.Option(
            help="none, selective, full, or several to compare (a model from its config; default none,full); "
            "one choice for a WORKLOAD of your own with --gpus (default none)."
        ),
    ] = None,
    checkpointing: Annotated[
        str | None,
        typer.Option(
            help="With WORKLOAD and --global-batch-size: measure activation-checkpointing policies on it (auto, or "
            "several of none, selective, selective-matmuls, full, full:K, hf) and plan with the policy, micro-batch "
            "and accumulation that reach the global batch with the most samples/s (by memory with --gpu)."
        ),
    ] = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="With a model from its config and --gpus: confirm each traced answer with one rank's real trials "
            "at it and one above, on --device (auto: a simulated device of the --gpu capacity).",
        ),
    ] = False,
    debug: Debug = False,
) -> None:
    """Plan micro-batch, accumulation, learning rate and warmup for a global batch on N devices.

    With WORKLOAD the micro-batch is measured; when the plan accumulates, it is measured again with
    the window's gradients held through forward and backward (as a later micro-batch runs), and
    the plan uses that answer. An LLM preset or a config.json with --gpu and --gpus N (or --nodes
    and --gpus-per-node) is traced per rank under FSDP2 for each activation-checkpointing choice."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.plan import run_plan  # torch and the workload load only when it runs

    run_plan(**options)


@app.command("list-workloads", epilog="Example: batchfit list-workloads --framework mlx")
def list_workloads(
    framework: Annotated[
        Framework, typer.Option(help="torch, or mlx: the MLX built-ins (find runs them).")
    ] = Framework.torch,
) -> None:
    """Name the built-in workloads, one line each, and the LLM shapes estimate builds from their configs."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.listing import run_list_workloads  # torch and the workload load only when it runs

    run_list_workloads(**options)
