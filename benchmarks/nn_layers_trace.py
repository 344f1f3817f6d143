"""Benchmark: which ``torch.nn`` layers the trace runs, and whether it counts them right.

Every module class in ``torch.nn`` is listed (found by walking the namespace, so a new torch
release adds rows by itself). Each layer that takes a batch is built with small arguments inside
a tiny model with a loss: a ``Linear`` first (so even a layer without parameters trains), the
layer, and the mean of what it returns (loss modules are the loss themselves). Each model runs
``estimate_memory`` on a ``TraceDevice`` and, at the same batch size, one real trial on a
``SimulatedDevice`` (``probe_batch_size``); the table gives the traced peak over the real one.
A layer the trace cannot run must fail with a one-line ``TraceError`` (the search then probes for
real); containers and abstract bases are listed as not applicable.

Rewrites only its own section of benchmarks/TRACE.md (between the section's heading and the next
heading of the same level), so the other benchmarks' sections stay.

    python benchmarks/nn_layers_trace.py
"""

from __future__ import annotations

import inspect
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import rnn as rnn_utils

import batchfit as bf
from batchfit.devices.trace import TraceDevice
from batchfit.devices.units import format_bytes
from batchfit.errors import TraceError
from batchfit.files import atomic_write_text
from batchfit.search.estimate import estimate_workload
from batchfit.step.batching import tensor_leaves

HERE = Path(__file__).parent
TRACE_MD = HERE / "TRACE.md"
SECTION = "## torch.nn layers on the trace"
BATCH = 16  # the batch size both the trace and the real trial run
SAMPLE_ROWS = 4
FEATURES = 32  # width of the input the first Linear reads
TOLERANCE = 0.01  # traced / real within 1% counts as a match
NOT_LAYERS = {  # module classes no batch runs through by themselves
    "Module": "abstract base",
    "Container": "container",
    "Sequential": "container",
    "ModuleList": "container",
    "ModuleDict": "container",
    "ParameterList": "container",
    "ParameterDict": "container",
    "RNNBase": "abstract base (its subclasses LSTM, GRU, RNN are rows)",
    "RNNCellBase": "abstract base (its subclasses are rows)",
    "DataParallel": "a wrapper that needs GPUs",
    "SyncBatchNorm": "needs a GPU and a process group (its forward refuses CPU tensors)",
}


def mean_loss(output: Any, batch: Any) -> torch.Tensor:
    """The mean of every floating tensor ``output`` holds (a loss module's output is its own mean)."""
    leaves = [t for t in tensor_leaves(output) if t.is_floating_point()]
    return sum(t.float().mean() for t in leaves)


class Dense(nn.Module):
    """``Linear(FEATURES, prod(shape))``, viewed as ``(batch, *shape)``, then ``layer``."""

    def __init__(self, layer: nn.Module, shape: tuple[int, ...], after: Callable | None = None):
        super().__init__()
        self.shape, self.after = shape, after
        self.pre = nn.Linear(FEATURES, math.prod(shape))
        self.layer = layer

    def forward(self, x: torch.Tensor) -> Any:
        out = self.layer(self.pre(x).view(x.shape[0], *self.shape))
        return self.after(out) if self.after else out


class Pair(nn.Module):
    """Two inputs from one: ``layer(a, b)`` with ``a``, ``b`` the two halves of a Linear's output."""

    def __init__(self, layer: nn.Module, shape: tuple[int, ...], count: int = 2):
        super().__init__()
        self.shape, self.count = shape, count
        self.pre = nn.Linear(FEATURES, count * math.prod(shape))
        self.layer = layer

    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> Any:
        parts = self.pre(x).view(x.shape[0], self.count, *self.shape).unbind(1)
        return self.layer(*parts, *extra.values())


class Predict(nn.Module):
    """A loss module as the layer: ``loss(post(Linear(x)), target)``."""

    def __init__(self, loss: nn.Module, shape: tuple[int, ...], post: Callable | None = None):
        super().__init__()
        self.shape, self.post = shape, post
        self.pre = nn.Linear(FEATURES, math.prod(shape))
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pred = self.pre(x).view(x.shape[0], *self.shape)
        return self.loss(self.post(pred) if self.post else pred, target)


class Tokens(nn.Module):
    """``layer(tokens)`` for integer inputs, then a Linear."""

    def __init__(self, layer: nn.Module, width: int):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(width, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(tokens))


class Encoder(nn.Module):
    """Tokens through ``nn.TransformerEncoder`` (about 0.9M parameters at the defaults), with an
    optional key padding mask and an optional causal mask made in ``forward``."""

    def __init__(self, vocab: int = 512, width: int = 128, layers: int = 4, causal: bool = False, nested: bool = True):
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=nested)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1]) if self.causal else None
        return self.head(self.encoder(self.embed(tokens), mask=mask, src_key_padding_mask=padding))


class Attention(nn.Module):
    """``nn.MultiheadAttention`` self-attention on a Linear's output, with optional masks."""

    def __init__(self, width: int = 64, heads: int = 4, seq: int = 24, need_weights: bool = True, causal: bool = False):
        super().__init__()
        self.seq, self.width, self.need_weights, self.causal = seq, width, need_weights, causal
        self.pre = nn.Linear(FEATURES, seq * width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        h = self.pre(x).view(x.shape[0], self.seq, self.width)
        mask = nn.Transformer.generate_square_subsequent_mask(self.seq) if self.causal else None
        out, _ = self.attention(
            h, h, h, key_padding_mask=padding, need_weights=self.need_weights, attn_mask=mask, is_causal=False
        )
        return out


class Packed(nn.Module):
    """An LSTM over a packed batch of sequences of different lengths."""

    def __init__(self, seq: int = 12, width: int = 16):
        super().__init__()
        self.seq, self.width = seq, width
        self.pre = nn.Linear(FEATURES, seq * width)
        self.lstm = nn.LSTM(width, 32, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.pre(x).view(x.shape[0], self.seq, self.width)
        packed = rnn_utils.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        return self.lstm(packed)[0].data


class Unpool(nn.Module):
    """``MaxPoolNd(return_indices=True)`` then ``MaxUnpoolNd``."""

    def __init__(self, dims: int, shape: tuple[int, ...]):
        super().__init__()
        self.shape = shape
        self.pre = nn.Linear(FEATURES, math.prod(shape))
        self.pool = getattr(nn, f"MaxPool{dims}d")(2, return_indices=True)
        self.unpool = getattr(nn, f"MaxUnpool{dims}d")(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unpool(*self.pool(self.pre(x).view(x.shape[0], *self.shape)))


@dataclass(frozen=True)
class Case:
    """One row: ``build()`` returns the model and its sample batch (a dict: ``model(**batch)``)."""

    name: str
    cls: str  # the torch.nn class the row is about
    build: Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]
    mode: str = "train"


def features() -> torch.Tensor:
    return torch.randn(SAMPLE_ROWS, FEATURES)


def dense_case(cls: str, shape: tuple[int, ...], *args: Any, after: Callable | None = None, **kwargs: Any) -> Case:
    return Case(cls, cls, lambda: (Dense(getattr(nn, cls)(*args, **kwargs), shape, after), {"x": features()}))


def pair_case(cls: str, shape: tuple[int, ...], *args: Any, count: int = 2, **kwargs: Any) -> Case:
    return Case(cls, cls, lambda: (Pair(getattr(nn, cls)(*args, **kwargs), shape, count), {"x": features()}))


def loss_case(
    cls: str, shape: tuple[int, ...], target: Callable[[], torch.Tensor], post: Callable | None = None
) -> Case:
    return Case(cls, cls, lambda: (Predict(getattr(nn, cls)(), shape, post), {"x": features(), "target": target()}))


def token_case(cls: str, *args: Any, **kwargs: Any) -> Case:
    def build() -> tuple[nn.Module, dict]:
        return Tokens(getattr(nn, cls)(*args, **kwargs), 16), {"tokens": torch.randint(0, 50, (SAMPLE_ROWS, 12))}

    return Case(cls, cls, build)


def padding_mask(seq: int, valid: tuple[int, ...] = (20, 24, 13, 17)) -> torch.Tensor:
    """True where a row is padding (each row's tokens are left-aligned, as the fast path wants)."""
    return torch.arange(seq)[None, :] >= torch.tensor(valid)[:, None]


def encoder_case(name: str, mode: str, padded: bool, **kwargs: Any) -> Case:
    def build() -> tuple[nn.Module, dict]:
        batch = {"tokens": torch.randint(0, 512, (SAMPLE_ROWS, 24))}
        if padded:
            batch["padding"] = padding_mask(24)
        return Encoder(**kwargs), batch

    return Case(name, "TransformerEncoder", build, mode)


def attention_case(name: str, padded: bool, mode: str = "train", **kwargs: Any) -> Case:
    def build() -> tuple[nn.Module, dict]:
        batch = {"x": features()}
        if padded:
            batch["padding"] = padding_mask(24)
        return Attention(**kwargs), batch

    return Case(name, "MultiheadAttention", build, mode)


C1, C2, C3 = (4, 32), (4, 16, 16), (4, 8, 8, 8)  # channels first: 1d, 2d and 3d feature maps
SEQ = (10, 8, 16)  # (sequence, batch first) for the recurrent layers: (batch, seq, features)
SEQ_SHAPE = (12, 16)


def labels(classes: int, shape: tuple[int, ...] = ()) -> Callable[[], torch.Tensor]:
    return lambda: torch.randint(0, classes, (SAMPLE_ROWS, *shape))


def floats(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.rand(SAMPLE_ROWS, *shape)


def signs(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randint(0, 2, (SAMPLE_ROWS, *shape)).float() * 2 - 1


def convolutions() -> list[Case]:
    cases = []
    for dims, shape in ((1, C1), (2, C2), (3, C3)):
        cases += [
            dense_case(f"Conv{dims}d", shape, 4, 8, 3, padding=1),
            dense_case(f"ConvTranspose{dims}d", shape, 4, 8, 3, stride=2),
            dense_case(f"LazyConv{dims}d", shape, 8, 3),
            dense_case(f"LazyConvTranspose{dims}d", shape, 8, 3),
            dense_case(f"MaxPool{dims}d", shape, 2),
            dense_case(f"AvgPool{dims}d", shape, 2),
            dense_case(f"AdaptiveMaxPool{dims}d", shape, 3),
            dense_case(f"AdaptiveAvgPool{dims}d", shape, 3),
            dense_case(f"LPPool{dims}d", shape, 2, 2),
            Case(f"MaxUnpool{dims}d", f"MaxUnpool{dims}d", lambda d=dims, s=shape: (Unpool(d, s), {"x": features()})),
            dense_case(f"BatchNorm{dims}d", shape, 4),
            dense_case(f"LazyBatchNorm{dims}d", shape),
            dense_case(f"InstanceNorm{dims}d", shape, 4, affine=True),
            dense_case(f"LazyInstanceNorm{dims}d", shape),
            dense_case(f"Dropout{dims}d", shape),
            dense_case(f"ZeroPad{dims}d", shape, 1),
            dense_case(f"ConstantPad{dims}d", shape, 1, 0.5),
            dense_case(f"ReflectionPad{dims}d", shape, 1),
            dense_case(f"ReplicationPad{dims}d", shape, 1),
            dense_case(f"CircularPad{dims}d", shape, 1),
        ]
    cases += [
        dense_case("FractionalMaxPool2d", C2, 2, output_ratio=0.5),
        dense_case("FractionalMaxPool3d", C3, 2, output_ratio=0.5),
        dense_case("PixelShuffle", (8, 8, 8), 2),
        dense_case("PixelUnshuffle", C2, 2),
        dense_case("ChannelShuffle", C2, 2),
        dense_case("Upsample", C2, scale_factor=2, mode="bilinear"),
        dense_case("UpsamplingNearest2d", C2, scale_factor=2),
        dense_case("UpsamplingBilinear2d", C2, scale_factor=2),
        dense_case("Fold", (4 * 4, 49), output_size=(8, 8), kernel_size=2),
        dense_case("Unfold", C2, kernel_size=3),
        dense_case("LocalResponseNorm", C2, 2),
        dense_case("CrossMapLRN2d", C2, 3),
        dense_case("Softmax2d", C2),
        dense_case("FeatureAlphaDropout", C2),
    ]
    return cases


ACTIVATIONS = [
    "CELU",
    "ELU",
    "GELU",
    "GLU",
    "Hardshrink",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "Identity",
    "LeakyReLU",
    "LogSigmoid",
    "Mish",
    "PReLU",
    "RReLU",
    "ReLU",
    "ReLU6",
    "SELU",
    "SiLU",
    "Sigmoid",
    "Softplus",
    "Softshrink",
    "Softsign",
    "Tanh",
    "Tanhshrink",
]


def elementwise() -> list[Case]:
    cases = [dense_case(name, (64,)) for name in ACTIVATIONS]
    cases += [
        dense_case("Threshold", (64,), 0.1, 0.0),
        dense_case("Softmax", (64,), dim=-1),
        dense_case("Softmin", (64,), dim=-1),
        dense_case("LogSoftmax", (64,), dim=-1),
        dense_case("Dropout", (64,)),
        dense_case("AlphaDropout", (64,)),
        dense_case("Linear", (64,), 64, 64),
        dense_case("LazyLinear", (64,), 64),
        dense_case("LayerNorm", (8, 16), 16),
        dense_case("RMSNorm", (8, 16), 16),
        dense_case("GroupNorm", C2, 2, 4),
        dense_case("Flatten", C2),
        dense_case("Unflatten", (64,), 1, (8, 8)),
        pair_case("Bilinear", (16,), 16, 16, 8),
        pair_case("CosineSimilarity", (16,)),
        pair_case("PairwiseDistance", (16,)),
    ]
    return cases


def recurrent() -> list[Case]:
    width = SEQ_SHAPE[1]
    cases = []
    for cls in ("LSTM", "GRU", "RNN"):
        cases.append(dense_case(cls, SEQ_SHAPE, width, 32, num_layers=2, batch_first=True, after=lambda o: o[0]))
    for cls in ("LSTMCell", "GRUCell", "RNNCell"):
        cases.append(dense_case(cls, (width,), width, 32))
    cases.append(
        Case(
            "LSTM (packed sequence)",
            "LSTM",
            lambda: (Packed(), {"x": features(), "lengths": torch.tensor([12, 7, 9, 3])}),
        )
    )
    return cases


def attention() -> list[Case]:
    seq = 24
    return [
        encoder_case("TransformerEncoder (train, padding mask)", "train", True),
        encoder_case("TransformerEncoder (train, causal mask)", "train", False, causal=True),
        encoder_case("TransformerEncoder (eval, padding mask: nested tensors)", "eval", True),
        encoder_case("TransformerEncoder (eval, no mask: fused layer)", "eval", False),
        encoder_case("TransformerEncoder (eval, causal mask)", "eval", False, causal=True),
        attention_case("MultiheadAttention (train, padding mask)", True),
        attention_case("MultiheadAttention (train, causal mask)", False, causal=True),
        attention_case("MultiheadAttention (train, no weights)", False, need_weights=False),
        attention_case("MultiheadAttention (eval, padding mask: fast path)", True, mode="eval", need_weights=False),
        Case(
            "TransformerEncoderLayer",
            "TransformerEncoderLayer",
            lambda: (Dense(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), (seq, 16)), {"x": features()}),
        ),
        Case(
            "TransformerEncoderLayer (eval: fused)",
            "TransformerEncoderLayer",
            lambda: (Dense(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), (seq, 16)), {"x": features()}),
            "eval",
        ),
        pair_case("TransformerDecoderLayer", (seq, 16), 16, 2, 32, batch_first=True),
        Case(
            "TransformerDecoder",
            "TransformerDecoder",
            lambda: (
                Pair(nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, batch_first=True), 2), (seq, 16)),
                {"x": features()},
            ),
        ),
        pair_case("Transformer", (seq, 16), 16, 2, 1, 1, 32, batch_first=True),
    ]


def embeddings() -> list[Case]:
    return [
        token_case("Embedding", 50, 16),
        token_case("EmbeddingBag", 50, 16, mode="mean"),
        Case(
            "AdaptiveLogSoftmaxWithLoss",
            "AdaptiveLogSoftmaxWithLoss",
            lambda: (
                Predict(nn.AdaptiveLogSoftmaxWithLoss(16, 40, [10, 20]), (16,)),
                {"x": features(), "target": labels(40)()},
            ),
        ),
    ]


def losses() -> list[Case]:
    return [
        loss_case("MSELoss", (8,), floats(8)),
        loss_case("L1Loss", (8,), floats(8)),
        loss_case("HuberLoss", (8,), floats(8)),
        loss_case("SmoothL1Loss", (8,), floats(8)),
        loss_case("CrossEntropyLoss", (10,), labels(10)),
        loss_case("NLLLoss", (10,), labels(10), post=lambda p: p.log_softmax(-1)),
        loss_case("NLLLoss2d", (10, 4, 4), labels(10, (4, 4)), post=lambda p: p.log_softmax(1)),
        loss_case("BCELoss", (8,), floats(8), post=torch.sigmoid),
        loss_case("BCEWithLogitsLoss", (8,), floats(8)),
        loss_case("KLDivLoss", (8,), floats(8), post=lambda p: p.log_softmax(-1)),
        loss_case("PoissonNLLLoss", (8,), floats(8)),
        loss_case("SoftMarginLoss", (8,), signs(8)),
        loss_case("MultiLabelSoftMarginLoss", (8,), lambda: torch.randint(0, 2, (SAMPLE_ROWS, 8)).float()),
        loss_case("MultiMarginLoss", (10,), labels(10)),
        loss_case("MultiLabelMarginLoss", (8,), lambda: torch.tensor([[1, 3, -1, 0, 0, 0, 0, 0]] * SAMPLE_ROWS)),
        loss_case("HingeEmbeddingLoss", (8,), signs(8)),
        Case(
            "MarginRankingLoss",
            "MarginRankingLoss",
            lambda: (Pair(nn.MarginRankingLoss(), (8,)), {"x": features(), "y": signs(8)()}),
        ),
        Case(
            "CosineEmbeddingLoss",
            "CosineEmbeddingLoss",
            lambda: (Pair(nn.CosineEmbeddingLoss(), (8,)), {"x": features(), "y": signs()()}),
        ),
        pair_case("TripletMarginLoss", (8,), count=3),
        pair_case("TripletMarginWithDistanceLoss", (8,), count=3),
        Case(
            "GaussianNLLLoss",
            "GaussianNLLLoss",
            lambda: (Pair(nn.GaussianNLLLoss(), (8,)), {"x": features(), "var": floats(8)()}),
        ),
        Case("CTCLoss", "CTCLoss", ctc_build),
        Case(
            "LinearCrossEntropyLoss",
            "LinearCrossEntropyLoss",
            lambda: (LinearCE(), {"x": features(), "target": labels(10)()}),
        ),
    ]


class CTC(nn.Module):
    """Log-probabilities over (time, batch, classes) from a Linear, scored by ``nn.CTCLoss``."""

    def __init__(self, steps: int = 12, classes: int = 6):
        super().__init__()
        self.steps, self.classes = steps, classes
        self.pre = nn.Linear(FEATURES, steps * classes)
        self.loss = nn.CTCLoss()

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = self.pre(x).view(x.shape[0], self.steps, self.classes).log_softmax(-1).transpose(0, 1)
        return self.loss(log_probs, targets, input_lengths, target_lengths)


def ctc_build() -> tuple[nn.Module, dict]:
    batch = {
        "x": features(),
        "targets": torch.randint(1, 6, (SAMPLE_ROWS, 5)),
        "input_lengths": torch.tensor([12, 10, 12, 11]),
        "target_lengths": torch.tensor([5, 3, 4, 5]),
    }
    return CTC(), batch


class LinearCE(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(FEATURES, 16)
        self.loss = nn.LinearCrossEntropyLoss(16, 10) if _takes_sizes() else nn.LinearCrossEntropyLoss()

    def forward(self, x, target):
        return self.loss(self.pre(x), target)


def _takes_sizes() -> bool:
    try:
        nn.LinearCrossEntropyLoss(16, 10)
    except TypeError:
        return False
    return True


def cases() -> list[Case]:
    return [*convolutions(), *elementwise(), *recurrent(), *attention(), *embeddings(), *losses()]


def nn_classes() -> list[str]:
    """Every module class ``torch.nn`` exports, by name."""
    return sorted(name for name, obj in vars(nn).items() if inspect.isclass(obj) and issubclass(obj, nn.Module))


@dataclass(frozen=True)
class Row:
    name: str
    traces: str  # "yes", "trial only" (the analytic part of the estimate fails), "no" or "n/a"
    traced_bytes: int | None = None
    real_bytes: int | None = None
    reason: str = ""
    seconds: float = 0.0

    @property
    def ratio(self) -> float | None:
        if self.traced_bytes is None or not self.real_bytes:
            return None
        return self.traced_bytes / self.real_bytes


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def real_peak(model: nn.Module, batch: dict, mode: str) -> int | str:
    try:
        trial = bf.probe_batch_size(
            model,
            batch,
            BATCH,
            loss_fn=mean_loss,
            optimizer=optimizer_for(model),
            mode=mode,
            device=bf.SimulatedDevice("1GiB"),
        )
    except Exception as error:  # a benchmark row, not a library path
        return f"the real step fails too ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    return trial.peak_bytes


def run_case(case: Case) -> Row:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, batch = case.build()
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
            model(**batch)  # a lazy layer takes its shapes from one real call
        start = time.perf_counter()
        traced, reason = traced_peak(model, batch, case.mode)
        traces = "yes" if traced is not None else "no"
        if traced is None:  # is it the trial, or the analytic estimate's forward pass beside it?
            traced, _ = traced_peak(model, batch, case.mode, analytic=False)
            traces = "trial only" if traced is not None else "no"
        seconds = time.perf_counter() - start
        real = real_peak(model, batch, case.mode)
    if isinstance(real, str):
        return Row(case.name, traces, traced, None, real, seconds)
    return Row(case.name, traces, traced, real, reason, seconds)


def traced_peak(model: nn.Module, batch: dict, mode: str, analytic: bool = True) -> tuple[int | None, str]:
    """The estimate's peak (``estimate_memory``; without ``analytic``, the traced trial alone) or
    ``None`` and why not."""
    workload = bf.Workload(model, batch, loss_fn=mean_loss, optimizer=optimizer_for(model), mode=mode)
    try:
        estimate = estimate_workload(workload, BATCH, device=TraceDevice("1GiB"), analytic=analytic)
    except TraceError as error:
        return None, str(error)
    except Exception as error:  # anything but a TraceError is a bug to report
        return None, f"NOT A TraceError: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return estimate.peak_bytes, ""


def verdict(row: Row) -> str:
    if row.traces not in ("yes", "trial only") or row.ratio is None:
        return ""
    if abs(row.ratio - 1) <= TOLERANCE:
        return "match"
    return "under-counts" if row.ratio < 1 else "over-counts"


def table(rows: list[Row]) -> str:
    lines = [
        "| layer | traces? | traced peak / real peak | verdict | reason if not |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = ""
        if row.ratio is not None:
            ratio = f"{format_bytes(row.traced_bytes)} / {format_bytes(row.real_bytes)} ({row.ratio:.3f})"
        reason = row.reason.replace("|", "\\|")
        lines.append(f"| {row.name} | {row.traces} | {ratio} | {verdict(row)} | {reason} |")
    return "\n".join(lines)


def section(rows: list[Row], seconds: float) -> str:
    traced = sum(row.traces == "yes" for row in rows)
    trial_only = sum(row.traces == "trial only" for row in rows)
    matched = sum(verdict(row) == "match" for row in rows)
    layers = sum(row.traces != "n/a" for row in rows)
    return f"""{SECTION}

Generated by `python benchmarks/nn_layers_trace.py` with torch {torch.__version__} ({seconds:.0f} s).

Every module class in `torch.nn` (walked, not hand-listed), each layer built with small arguments
in a tiny model with a loss: a `Linear` first, so a layer without parameters trains too, then the
layer and the mean of its output (a loss module is the loss). Batch {BATCH} from a sample of
{SAMPLE_ROWS} rows, AdamW, two steps. *Traced peak*: `estimate_memory` (`estimate_workload`) on a `TraceDevice`; *real
peak*: one trial at the same batch size on a `SimulatedDevice` (`probe_batch_size`), which runs
the real kernels and counts every storage. A match is within {TOLERANCE:.0%}. A layer the trace
cannot run gives a one-line `TraceError` (the search then probes for real, model by model).

Of {layers} layer rows, {traced} trace in full and {trial_only} only in the trial (the analytic part of
`estimate_memory`, a forward pass beside it, fails: see the row's reason); {matched} match the real peak.

What the trace does for them (src/batchfit/devices/fake_values.py, value_rules.py and undercounts.py): where a step asks its data a
question (whether a mask is causal, whether a padding mask is left-aligned, `torch.any(var < 0)`,
`nonzero` on the targets, a CTC target's length, the lengths a sequence is packed by), the trace
answers it as the real step does, from real copies of the values it can know: the sample's rows,
small buffers and what ops make from only those (never the parameters). The nested-tensor fast
path of `nn.TransformerEncoder` (eval with a padding mask) runs on a dense stand-in with the
nested buffer's bytes. And col2im (`nn.Fold`, the backward of `nn.Unfold`) keeps a storage of
its input's size, as the real kernel does. Before these, 9 rows failed or under-counted: the
causal and nested `TransformerEncoder` rows, `GaussianNLLLoss`, `AdaptiveLogSoftmaxWithLoss`,
`CTCLoss` and the packed `LSTM` (a one-line `TraceError`), `Unfold` (0.78) and `Fold` (0.95).

{table(rows)}
"""


def replace_section(text: str, new: str) -> str:
    """``text`` with this benchmark's section replaced by ``new`` (appended when absent); other
    sections, before and after, unchanged."""
    start = text.find(SECTION)
    if start < 0:
        return text.rstrip("\n") + "\n\n" + new
    following = text.find("\n## ", start + len(SECTION))
    tail = "" if following < 0 else text[following:]
    return text[:start] + new.rstrip("\n") + "\n" + tail


def main() -> None:
    start = time.perf_counter()
    rows: list[Row] = []
    by_class: dict[str, list[Case]] = {}
    for case in cases():
        by_class.setdefault(case.cls, []).append(case)
    for name in nn_classes():
        if name in NOT_LAYERS:
            rows.append(Row(name, "n/a", reason=NOT_LAYERS[name]))
            continue
        if name not in by_class:
            rows.append(Row(name, "n/a", reason="no case built for it in this benchmark"))
            continue
        for case in by_class.pop(name):
            row = run_case(case)
            rows.append(row)
            print(f"{row.name}: {row.traces} {row.ratio} {row.reason[:100]}", flush=True)
    if by_class:
        sys.exit(f"cases for classes torch.nn does not have: {sorted(by_class)}")
    text = TRACE_MD.read_text() if TRACE_MD.exists() else "# Trace cost\n"
    atomic_write_text(TRACE_MD, replace_section(text, section(rows, time.perf_counter() - start)))


if __name__ == "__main__":
    main()
