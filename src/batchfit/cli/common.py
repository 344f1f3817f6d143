"""What every ``batchfit`` command shares: the typer app, the consoles, option types and error handling."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import json
import sys
import traceback
from collections.abc import Callable
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.files import STDOUT
from batchfit.files import atomic_write_text
from batchfit.files import check_writable
from batchfit.files import standard_output

app = typer.Typer(
    help="What batch size should I train with on this hardware?\n\nExample: batchfit find gpt-tiny --device sim:8GiB",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
console = Console()
errors = Console(stderr=True)

# What the user can fix: bad input (every one batchfit raises on purpose is an InputError), an answer that
# does not exist (nothing fits), and a path that cannot be read or written. Anything else is a bug.
USER_ERRORS = (InputError, NoBatchFitsError, OSError)
# typer's exits and usage errors pass through as they are. Recent typer carries its own copy of click and
# older ones re-export click's classes: the usage errors' base class is read off typer's, never imported.
USAGE_ERROR = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException")
TYPER_EXITS = (typer.Exit, typer.Abort, USAGE_ERROR)
REPORT_REQUEST = (
    "batchfit stopped on an error it did not expect. If the traceback above ends in your own code (the "
    "workload, the model, the loss), the fix is there; otherwise it is a bug in batchfit: please report it "
    "with the traceback and the output of: python -c 'import batchfit; print(batchfit.versions())'"
)


NO_SETTINGS_FOR_CONFIG = (
    "--set passes settings to a workload's own function; a model built from its config takes --seq-len and the "
    "sharding options: drop --set, or give your own workload (file.py:function)"
)


class LrScaling(str, Enum):
    linear = "linear"
    sqrt = "sqrt"
    none = "none"


class Goal(str, Enum):
    accuracy = "accuracy"
    speed = "speed"
    memory = "memory"


class Mode(str, Enum):
    train = "train"
    eval = "eval"
    generate = "generate"


class Amp(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"


class Allocator(str, Enum):
    exact = "exact"
    cuda = "cuda"
    cuda_expandable = "cuda-expandable"


AllocatorOption = Annotated[
    Allocator | None,
    typer.Option(
        help="What decides a fit: cuda (PyTorch's caching allocator, modelled with this process's "
        "PYTORCH_CUDA_ALLOC_CONF; a GPU preset's default), cuda-expandable (with expandable_segments:True), "
        "or exact (the live bytes; a --capacity's default)."
    ),
]


class Framework(str, Enum):
    torch = "torch"
    mlx = "mlx"


WorkloadArg = Annotated[str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")]
SeqLen = Annotated[int | None, typer.Option(help="Sequence length, for workloads that take one.")]
ImageSize = Annotated[int | None, typer.Option(help="Image side in pixels, for workloads that take one.")]
AmpOption = Annotated[Amp | None, typer.Option(help="Mixed precision: bf16 or fp16.")]
Debug = Annotated[bool, typer.Option(help="Show tracebacks.")]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="A parameter of the workload's function, KEY=VALUE (repeat it), typed as the function annotates it: "
        "--set n_layer=12 --set dropout=0.0.",
    ),
]
FrameworkOption = Annotated[
    Framework | None,
    typer.Option(
        help="torch or mlx: what a module:function workload returns (default: either; built-ins know their own)."
    ),
]
KeepOutput = Annotated[
    bool,
    typer.Option(
        "--keep-output/--drop-output",
        help="Model the loop people write, whose output (logits) stays alive until after backward "
        "(default), or one whose loss call drops it, as Lightning's training_step and the HF Trainer do.",
    ),
]
CacheDir = Annotated[
    Path | None, typer.Option(help="The cache folder (default: $BATCHFIT_CACHE_DIR, else the user cache folder).")
]


def write_json(path: str | Path, document: dict[str, Any]) -> Path:
    """Write ``document`` as indented JSON: a file atomically, ``-`` to standard output, a device or a FIFO
    through (``batchfit.files``)."""
    return atomic_write_text(path, json.dumps(document, indent=2) + "\n")


def check_outputs(json_path: Path | None = None, plot: Path | None = None) -> None:
    """Fail before the work, not after it, when an output cannot be written (its folder does not exist, it is a
    folder, a socket...), or a plot is asked for and matplotlib is missing. An output to ``-`` keeps stdout for
    that document alone: until the command ends, what else it prints goes to stderr (under ``--quiet``, the
    answer too)."""

    for path in (json_path, plot):
        if path is not None:
            check_writable(path)
    to_stdout = [path for path in (json_path, plot) if path is not None and str(path) == STDOUT]
    if len(to_stdout) > 1:
        raise InputError(f"--json {STDOUT} and --plot {STDOUT} both ask for standard output: give one a file path")
    if plot is not None:
        from batchfit.cli.plots import load_pyplot

        load_pyplot()
    if not to_stdout:
        return
    # The running command's context (click's, or the copy recent typer carries: read off typer's Context) closes
    # when the command ends, and undoes what it was given to hold.
    click_globals = importlib.import_module(typer.Context.__mro__[1].__module__.rpartition(".")[0] + ".globals")
    context = click_globals.get_current_context(silent=True)
    if context is None:
        return  # not in a command: ``-`` is sys.stdout of the moment
    kept = _ANSWER_STREAM.get()
    if kept is None:
        context.with_resource(standard_output(sys.stdout))
        context.with_resource(contextlib.redirect_stdout(sys.stderr))
    else:  # --quiet: answer_alone already sends the rest to stderr; the answer goes there too, and it resets this
        context.with_resource(standard_output(kept))
        _ANSWER_STREAM.set(sys.stderr)


_ANSWER_STREAM: contextvars.ContextVar[Any] = contextvars.ContextVar("answer_stream", default=None)


@contextlib.contextmanager
def answer_alone(quiet: bool) -> Iterator[None]:
    """With ``--quiet`` stdout is batchfit's: it carries the answer (``print_answer``) and nothing else, so
    ``BS=$(batchfit find ... --quiet)`` reads a number; whatever else writes to stdout meanwhile (a workload
    that prints its parameter count) goes to stderr."""
    if not quiet:
        yield
        return
    token = _ANSWER_STREAM.set(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _ANSWER_STREAM.reset(token)


def print_answer(value: object) -> None:
    """The answer on stdout: the stream ``answer_alone`` kept for it under ``--quiet``, else the console's."""
    stream = _ANSWER_STREAM.get()
    if stream is None:
        console.print(value)
    else:
        print(value, file=stream, flush=True)


def cli_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """One line on stderr and exit code 2 for the user's mistakes (the traceback only with
    --debug); any other error keeps its traceback, asks to be reported, and exits with 1."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with answer_alone(bool(kwargs.get("quiet"))):
                return command(*args, **kwargs)
        except TYPER_EXITS:
            raise  # typer's own exits and usage errors
        except USER_ERRORS as error:
            if kwargs.get("debug"):
                raise
            errors.print(f"[red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except Exception:
            traceback.print_exc()
            errors.print(f"[red]{escape(REPORT_REQUEST)}[/]", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


def parse_margin(text: str) -> int | float | str:
    """``"0.05"`` is a fraction of the capacity, ``"4096"`` bytes, ``"512MiB"`` a size."""
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def header_line(workload: Any, device: Any, command: str = "find") -> str:
    own_count = getattr(workload, "parameter_count", None)  # an MLX workload counts its own
    params = own_count() if own_count is not None else sum(p.numel() for p in workload.model.parameters())
    optimizer = type(workload.optimizer).__name__ if workload.optimizer is not None else "no optimizer"
    line = f"batchfit {command}: [bold]{workload.name}[/] ({params / 1e6:.2f}M parameters, {optimizer}) on [bold]{device.name}[/]"
    if getattr(workload, "loop", None):
        line += f"\nLoop: {escape(workload.loop)} (--keep-output/--drop-output choose)."
    if device.simulated:
        choose = "mlx:CAPACITY" if device.name.startswith("mlx:") else "sim:CAPACITY"
        line += (
            f"\n[yellow]Simulated:[/] a {format_bytes(device.capacity_bytes())} device on the CPU, not a GPU "
            f"measurement (choose with --device {choose})."
        )
    return line
