"""Words and figures about one rank: the capacity a rank has, its parallelism in one phrase, and its largest
micro-batch with an accumulation window's gradients held."""

from __future__ import annotations

from batchfit.devices.units import format_bytes
from batchfit.parallel.fit import LargestBatch
from batchfit.parallel.fit import largest_batch_size
from batchfit.parallel.models import ModelSpec
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.trace import ShardedEstimate

NOT_TRACED = ["NCCL buffers", "the CUDA context beyond the preset's reserve", "allocator fragmentation"]


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


def describe_parallelism(parallelism: Parallelism) -> str:
    """One phrase.

    >>> describe_parallelism(Parallelism(world_size=8, param_dtype="bf16", reduce_dtype="fp32"))
    'rank 0 of 8, FSDP2 full shard, bfloat16 compute, float32 reduce'
    """
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


def host_line(estimate: ShardedEstimate) -> str:
    """With CPU offload: the host memory one rank needs, by part, and a node of its ranks.

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


def held_gradient_bytes(largest: LargestBatch) -> int:
    """The bytes of the reduced gradient shards a rank keeps from one micro-batch of an accumulation window to the
    next (the trace's ``state_bytes["gradients"]``; 0 with CPU offload, which holds them on the host)."""
    return largest.estimate.state_bytes.get("gradients", 0)


def traced_with_gradients_held(
    workload: ModelSpec, seq_len: int, capacity_bytes: int, parallelism: Parallelism, largest: LargestBatch
) -> LargestBatch:
    """The largest micro-batch per rank as a later micro-batch of an accumulation window: FSDP2 keeps the window's
    gradient shards through it, so it is searched again within the capacity less their bytes, reusing the sizes
    ``largest``'s search traced (``largest`` itself where there are no gradients to hold)."""
    gradients = held_gradient_bytes(largest)
    if gradients == 0 or largest.batch_size == 0:
        return largest
    return largest_batch_size(
        workload, seq_len, capacity_bytes - gradients, parallelism=parallelism, known=largest.traced
    )
