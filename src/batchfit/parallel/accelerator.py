"""A fake accelerator for fake tensors, so FSDP2's CPU offload runs as it does on a GPU.

On a CPU mesh, FSDP2's ``CPUOffloadPolicy`` does nothing: host and device are one. To trace it,
one rank runs on a device of another type that holds nothing: torch's PrivateUse1 dispatch key,
registered from Python (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``)
under the name ``fakegpu`` with a device module of no-op streams and events. Under
``FakeTensorMode`` a tensor only carries its device (its data are meta), so FSDP2's own code puts
the sharded parameters, their gradients and the optimizer state on the host, copies shards to the
device before each all-gather and reduced gradients back after each reduce-scatter, and runs the
optimizer step on the host; each storage is counted on the device it sits on.

Two things make the device run the kernels the CPU trace runs (measured byte for byte against
the CPU mesh's trace of a tiny transformer and a grouped-query Llama, with and without
checkpointing, in fp32 and bf16):

- SDPA is composite, and its backend choice is consulted only for devices with a C++
  registration: on PrivateUse1 it would always take the math path, keeping a (batch, heads,
  seq, seq) score matrix that no fused kernel keeps. A kernel at ``AutogradPrivateUse1`` (active
  in every thread, also where checkpointing recomputes in backward) calls what the CPU calls.
- A few ops have a CPU kernel and a composite one (``silu_backward`` in torch 2.13); a device
  without kernels gets the composite, several small ops with temporaries of their own. A kernel
  registered at ``PrivateUse1`` (never run under fake tensors) makes torch use the op's autograd
  kernel, as on the CPU.

Where a GPU's kernels differ from the CPU's, the device follows the GPU's: dropout keeps a
one-byte mask (``native_dropout``), and AdamW keeps each parameter's ``step`` on the host.

The registration is process-wide and permanent (``torch.accelerator.is_available()`` turns True,
``DataLoader(pin_memory=True)`` stops working), so batchfit registers it only in a child process
of its own (``batchfit.parallel.offload``), never in the caller's.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from batchfit.errors import InputError

NAME = "fakegpu"
_LIBRARIES: list[Any] = []  # torch.library registrations live as long as their Library object


class _DeviceModule:
    """``torch.fakegpu``: one device, index 0, with torch.cpu's no-op streams and events."""

    Stream = torch.cpu.Stream
    Event = torch.cpu.Event
    current_stream = staticmethod(torch.cpu.current_stream)
    stream = staticmethod(torch.cpu.stream)
    synchronize = staticmethod(torch.cpu.synchronize)

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(index: int) -> None:
        pass

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        # Asked by the autocast that non-reentrant checkpointing builds for its recompute, inside
        # backward on autograd's device thread: missing, it raises there and the process aborts.
        return [torch.float16, torch.bfloat16]


def is_registered() -> bool:
    """Whether this process has the fake accelerator."""
    return getattr(torch, NAME, None) is not None


def register() -> torch.device:
    """Register the fake accelerator in this process (once) and return its device. Process-wide
    and permanent: call it only in a process of its own, before its first backward (autograd
    sizes its per-device queues then, and a device added later breaks its next backward)."""
    if not is_registered():
        _check_free()
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(rename=NAME, backend_module=_DeviceModule())
        library = torch.library.Library("aten", "IMPL")
        _LIBRARIES.append(library)
        library.impl("scaled_dot_product_attention", _attention_as_on_cpu, "AutogradPrivateUse1")
        for name in composite_only_here():
            library.impl(name.removeprefix("aten::"), _never_runs, "PrivateUse1")
    return torch.device(NAME, 0)


def _check_free() -> None:
    """One line if this torch cannot give the fake accelerator PrivateUse1: too old, or the key is
    taken by an installed backend (an out-of-tree device loaded at import)."""
    import torch.utils.backend_registration as registration

    if not hasattr(registration, "_setup_privateuseone_for_python_backend"):
        raise InputError(
            f"tracing CPU offload needs torch's Python backend registration, which torch {torch.__version__} lacks: "
            "upgrade torch (2.13 has it) or drop cpu_offload"
        )
    taken = torch._C._get_privateuse1_backend_name()
    if taken != "privateuseone":
        raise InputError(
            f"tracing CPU offload runs on torch's PrivateUse1 device, which {taken!r} (an installed backend) holds in "
            "a new Python process here: trace it where that backend is not installed, or drop cpu_offload"
        )


def composite_only_here() -> list[str]:
    """The aten ops the CPU runs through their autograd kernel that a PrivateUse1 device without
    kernels would run as their composite decomposition (read from torch's dispatch tables)."""
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
            continue
        table = torch._C._dispatch_dump_table(name)
        on_cpu = re.search(r"^AutogradCPU: .*\[(.*)\]$", table, re.M)
        here = re.search(r"^AutogradPrivateUse1: .*\[(.*)\]$", table, re.M)
        if on_cpu and here and on_cpu.group(1) == "autograd kernel" and here.group(1) == "math kernel":
            found.append(name)
    return found


def _never_runs(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(f"the {NAME} device has no kernels: it runs only under FakeTensorMode")


def _attention_as_on_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``aten::scaled_dot_product_attention`` on the fake accelerator, as the CPU runs it: dense
    4-d inputs without dropout go to the CPU's flash kernel (grouped-query K/V as they are, a
    boolean mask made additive), the rest to the math path."""
    if dropout_p == 0.0 and query.dim() == 4 and key.dim() == 4:
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device)
            minus_inf = torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=attn_mask.device)
            attn_mask = torch.where(attn_mask, zero, minus_inf)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )[0]
    if enable_gqa and key.size(-3) != query.size(-3):
        repeats = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale
    )[0]


def moved_to(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` with every parameter and buffer moved to ``device`` and registered again (a fake
    tensor's device cannot be changed in place); tied parameters stay tied."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in moved:
                    moved[id(param)] = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
                module._parameters[name] = moved[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = moved.setdefault(id(buffer), buffer.to(device))
    return model
