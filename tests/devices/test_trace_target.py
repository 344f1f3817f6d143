"""An estimate works on a model wherever it lives (a GPU, ``meta``), and leaves it as it was: never moved, no
weak reference left on its tensors (torch refuses to swap a parameter one points at), bitwise unchanged also
when the trace fails."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from torch import nn

import batchfit as bf
from batchfit.devices.cuda_kernels import CudaTarget
from batchfit.devices.cuda_kernels import choose_backend
from batchfit.devices.trace import TraceDevice
from batchfit.errors import TraceError
from batchfit.search.runner import probe_workload


def model_and_batch(device: str = "cpu") -> tuple[nn.Module, torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 4)).to(device)
    return model, torch.randint(0, 100, (4, 8)), torch.optim.AdamW(model.parameters())


def loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


@contextlib.contextmanager
def swapping_on_conversion():
    """torch's future behaviour: ``Module.to`` swaps every parameter (``torch.utils.swap_tensors``)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("swap", [False, True])
def test_a_model_on_meta_estimates_as_the_same_model_on_the_cpu(swap):
    """A model that lives elsewhere (a GPU; here ``meta``) is copied onto the trace's device from a description
    of its tensors, never moved: it used to fail in ``_apply(): Couldn't swap Embedding.weight``."""
    with swapping_on_conversion() if swap else contextlib.nullcontext():
        estimates = [
            bf.estimate_memory(model, batch, 64, loss_fn=loss, optimizer=optimizer, device="a100-40gb")
            for model, batch, optimizer in (model_and_batch("cpu"), model_and_batch("meta"))
        ]
    assert estimates[0].peak_bytes == estimates[1].peak_bytes and estimates[0].breakdown == estimates[1].breakdown


def test_an_estimate_leaves_no_weak_reference_and_the_model_can_still_be_swapped():
    model, batch, optimizer = model_and_batch()
    bf.estimate_memory(model, batch, 8, loss_fn=loss, optimizer=optimizer, device="a100-40gb")
    assert not any(weakref.getweakrefcount(p) for p in model.parameters())
    assert weakref.getweakrefcount(batch) == 0
    with swapping_on_conversion():
        model.to(torch.float64)  # torch.utils.swap_tensors refuses a parameter with a weak reference
    assert all(p.dtype == torch.float64 for p in model.parameters())


class ValueQuestion(nn.Module):
    """Asks its parameters a question about their values: fake tensors cannot answer it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x[(self.linear(x) > self.linear.weight.mean()).any(dim=1)]  # how many: the parameters' values
        return self.linear(rows).sum() + self.seen


def test_a_failed_estimate_leaves_the_model_and_optimizer_bitwise_as_they_were():
    torch.manual_seed(0)
    model = ValueQuestion()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).backward()
    optimizer.step()  # optimizer state and gradients exist
    before = bf.StateSnapshot.take(model, optimizer)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    with pytest.raises(TraceError, match="cannot trace this workload"):
        bf.estimate_memory(
            model, torch.randn(4, 8), 16, loss_fn=lambda out, batch: out, optimizer=optimizer, device="a100-40gb"
        )
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, optimizer.state.values(), strict=True))
    assert not any(weakref.getweakrefcount(p) for p in model.parameters())
    before.restore()


# -- a trace for a GPU runs what the GPU runs ------------------------------------------------------------------


class Attention(nn.Module):
    """One attention layer through ``F.scaled_dot_product_attention``, with dropout as GPT-2 trains."""

    def __init__(self, width: int = 64, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.qkv, self.heads, self.dropout = nn.Linear(width, 3 * width), heads, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


def traced(
    model: nn.Module, batch: torch.Tensor, rows: int, device: TraceDevice, **options
) -> tuple[bf.Trial, TraceDevice]:
    work = bf.Workload(
        model, batch, lambda out, b: out.float().pow(2).mean(), torch.optim.AdamW(model.parameters()), **options
    )
    tracer = device.unlimited()
    return probe_workload(work, rows, device=tracer), tracer


def test_cuda_picks_its_attention_kernel_by_dtype_mask_and_dropout():
    half, single = torch.zeros(2, 12, 1024, 64, dtype=torch.bfloat16), torch.zeros(2, 12, 1024, 64)
    mask = torch.ones(2, 1, 1024, 1024, dtype=torch.bool)
    h100, a100, t4 = CudaTarget(sm=(9, 0)), CudaTarget(sm=(8, 0)), CudaTarget(sm=(7, 5))
    assert choose_backend(h100, half, half, half, p=0.1, causal=True) == "flash"
    assert choose_backend(h100, single, single, single) == "efficient"  # flash takes 16 bits only
    assert choose_backend(a100, half, half, half, mask=mask) == "efficient"  # flash takes no mask
    fp16 = half.half()
    assert choose_backend(t4, fp16, fp16, fp16) == "efficient"  # flash needs sm80
    assert choose_backend(t4, half, half, half) == "math"  # and below sm80 the efficient kernel takes no bf16
    new_cudnn = CudaTarget(sm=(9, 0), cudnn_version=91900)
    assert choose_backend(new_cudnn, half, half, half, causal=True) == "cudnn"  # preferred past cuDNN 9.15 on sm90
    assert choose_backend(new_cudnn, half, half, half, p=0.1) == "flash"  # cuDNN's dropout comes in sixteenths


def test_a_gpu_trace_keeps_no_score_matrix_where_cuda_runs_flash_attention():
    """On the CPU, attention with dropout keeps three fp32 batch x heads x seq x seq tensors for backward; CUDA's
    flash kernel keeps the output and a log-sum-exp."""
    torch.manual_seed(0)
    model, batch = Attention(), torch.randn(2, 256, 64)
    cpu, _ = traced(model, batch, 8, TraceDevice("40GiB"), amp_dtype="bf16")
    gpu, tracer = traced(model, batch, 8, TraceDevice("h100-80gb"), amp_dtype="bf16")
    scores, workspaces = 8 * 4 * 256 * 256 * 4, 2 * 32 * 2**20  # one fp32 score matrix; cuBLAS's, on Hopper
    assert set(tracer.attention_kernels) == {"flash"}
    assert gpu.peak_bytes - workspaces < cpu.peak_bytes - 2 * scores
    real = torch.randn(2, 4, 16, 8, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(real, real, real)
    assert "ForCpu" in type(out.grad_fn).__name__  # the override ended with the trace


def test_the_gpu_kernels_hold_in_the_recompute_of_activation_checkpointing():
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Attention()

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)

    _, tracer = traced(Checkpointed(), torch.randn(2, 64, 64), 4, TraceDevice("h100-80gb"), amp_dtype="bf16")
    assert tracer.attention_kernels.count("flash") >= 2  # forward and recompute, no CheckpointError


def test_a_gpu_trace_casts_by_cudas_autocast_lists():
    """CUDA runs layer_norm and pow in fp32 under bf16 autocast; the CPU keeps them in bf16. Real autocast on the
    CPU is left as it was."""
    seen: list[torch.dtype] = []
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32))
    model[1].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    for device in (TraceDevice("40GiB"), TraceDevice("a100-40gb")):
        traced(model, torch.randn(2, 32), 4, device, amp_dtype="bf16")
    assert (seen[0], seen[-1]) == (torch.bfloat16, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randn(2, 32)).dtype == torch.bfloat16


def test_a_gpu_trace_keeps_dropouts_boolean_mask_and_runs_the_optimizer_foreach():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.5), nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    cpu = bf.estimate_memory(model, torch.randn(2, 256), 512, loss_fn=loss, optimizer=optimizer, device="1GiB")
    gpu = bf.estimate_memory(model, torch.randn(2, 256), 512, loss_fn=loss, optimizer=optimizer, device="a100-40gb")
    noise, mask = 512 * 256 * 4, 512 * 256  # fp32 noise on the CPU, one byte an element on CUDA
    assert cpu.breakdown["activations"] - gpu.breakdown["activations"] == noise - mask
    assert optimizer.param_groups[0]["foreach"] is None  # the user's optimizer is not touched
    tracer = TraceDevice("a100-40gb")
    fake = tracer.prepare(bf.Workload(model, torch.randn(2, 256), loss, optimizer))
    assert fake.optimizer.param_groups[0]["foreach"] is True  # as torch picks it for CUDA tensors


def test_a_gpu_trace_counts_cublas_workspaces_and_names_what_only_the_card_sizes():
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.LazyLinear(4))
    conv(torch.randn(1, 3, 16, 16))
    estimate = bf.estimate_memory(conv, torch.randn(2, 3, 16, 16), 8, loss_fn=loss, device="h100-80gb")
    assert estimate.breakdown["temporaries"] >= 2 * 32 * 2**20  # one 32 MiB workspace per cuBLAS handle (Hopper)
    assert any("cuDNN's convolution workspaces" in note for note in estimate.not_counted)
    assert "not counted: cuDNN's convolution workspaces" in estimate.summary()
    lstm = nn.LSTM(8, 16, batch_first=True)
    with pytest.warns(UserWarning, match="mkldnn_rnn_layer"):
        guess = bf.estimate_memory(
            lstm, torch.randn(2, 5, 8), 4, loss_fn=lambda out, b: out[0].sum(), device="h100-80gb"
        )
    assert guess.undercounted_ops == ("aten::mkldnn_rnn_layer",) and guess.fits is None  # cuDNN sizes its reserve


def test_transformers_mask_checks_answer_on_fake_tensors_as_on_real_ones():
    """transformers asks the position ids whether sequences are packed, and an attention mask whether it is all
    ones; on fake tensors it used to give up and build an explicit mask (Llama also repeated its keys), so a GPU
    trace ran another kernel than the step: the memory-efficient one where the GPU runs flash."""
    pytest.importorskip("transformers")
    from hf_models import Size
    from hf_models import bert
    from hf_models import llama

    for build, kv_heads in ((llama, 2), (bert, None)):
        model, batch = build(Size(64, 1, 4, 128, 128, 32, kv_heads=kv_heads))
        work = bf.Workload(model, batch, None, torch.optim.AdamW(model.parameters()), amp_dtype="bf16")
        tracer = TraceDevice("h100-80gb").unlimited()
        probe_workload(work, 2, device=tracer)
        assert set(tracer.attention_kernels) == {"flash"}, build.__name__  # no mask: none to pass


def test_while_a_trace_runs_real_tensors_keep_the_cpus_kernels():
    """The GPU's kernels are for the trace's own fake tensors: real ones (another thread's training) run as ever."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from batchfit.devices.cuda_autocast import cuda_autocast
    from batchfit.devices.cuda_kernels import cuda_attention
    from batchfit.devices.cuda_kernels import cuda_dropout

    mode = FakeTensorMode()
    with cuda_attention(mode, CudaTarget()), cuda_dropout(mode), cuda_autocast(mode):
        x = torch.randn(2, 4, 16, 8, requires_grad=True)
        attention = torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.0)
        dropped = torch.nn.functional.dropout(x, 0.5, True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            normed = torch.nn.functional.layer_norm(x.bfloat16(), (8,))
    assert type(attention.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    assert type(dropped.grad_fn).__name__ == "MulBackward0"  # the CPU's noise, not CUDA's fused kernel
    assert normed.dtype == torch.bfloat16  # the CPU's autocast leaves layer_norm alone
