"""Devices: the simulated accounting, device resolution, and CUDA/MPS logic without the hardware."""

from __future__ import annotations

import threading

import pytest
import torch

import batchfit as bf
from batchfit.devices.accounting import PEER_OOM_WORDING
from batchfit.devices.accounting import LiveBytes
from batchfit.devices.cuda import CudaDevice
from batchfit.devices.mps import MpsDevice
from batchfit.search.prober import Prober
from fake_cuda import FakeCuda
from models import mlp_tuple


def test_capacity_accepts_ints_and_size_strings():
    assert bf.SimulatedDevice(1000).capacity_bytes() == 1000
    assert bf.SimulatedDevice("512MiB").capacity_bytes() == 512 * 2**20
    assert bf.SimulatedDevice("1.5GB").capacity_bytes() == 1_500_000_000
    assert bf.SimulatedDevice("8 GiB").capacity_bytes() == 8 * 2**30


@pytest.mark.parametrize("bad", ["lots", "8 gigs", "-1GiB", "", "0"])
def test_bad_capacity_strings_name_the_fix(bad):
    with pytest.raises(ValueError, match="512MiB|positive"):
        bf.SimulatedDevice(bad)


def test_bad_capacity_types_are_type_errors():
    with pytest.raises(TypeError, match="8GiB"):
        bf.SimulatedDevice(8.5)


def test_live_bytes_count_each_storage_once_and_drop_when_freed():
    counter = LiveBytes(rounding_bytes=1)
    with counter.mode():
        a = torch.ones(100)  # 400 bytes
        view = a[10:20]
        b = a * 2
        assert counter.live_bytes == 800
        del b
        assert counter.live_bytes == 400
        view.add_(1)  # in place on a view: no new storage
        assert counter.live_bytes == 400
    del a, view
    assert counter.live_bytes == 0
    assert counter.peak_bytes == 800


def test_rounding_mimics_the_cuda_allocator_blocks():
    counter = LiveBytes(rounding_bytes=512)
    with counter.mode():
        small = torch.ones(3)  # 12 bytes -> one 512-byte block
        large = torch.ones(200)  # 800 bytes -> 1024
        assert counter.live_bytes == 512 + 1024
        assert counter.exact_live_bytes == 12 + 800
        del small, large


def test_pre_existing_tensors_count_against_the_capacity():
    device = bf.SimulatedDevice(4096, rounding_bytes=1)
    weights = torch.zeros(768)  # 3072 bytes, made before the trial
    device.register([weights])
    assert device.live_bytes() == 3072
    with pytest.raises(torch.OutOfMemoryError) as info, device.measuring():
        torch.ones(512)  # 2048 more: 5120 > 4096
    message = str(info.value)
    assert "tried to allocate 2.0 KiB with 3.0 KiB live of 4.0 KiB" in message
    assert "5120 bytes requested in all, limit 4096 bytes" in message
    assert PEER_OOM_WORDING in message  # Lightning and accelerate match this wording
    assert bf.is_oom(info.value)
    assert device.live_bytes() == 3072  # the failed block is gone, though the traceback is alive


def test_the_timeline_records_live_bytes_after_every_op():
    device = bf.SimulatedDevice(10_000, rounding_bytes=1)
    with device.measuring():
        a = torch.ones(10)
        b = a + 1
        del a
        c = b * 2
    assert device.timeline() == [40, 80, 80]  # after `b*2`, `a` is gone and `c` is live
    del b, c


def test_resolve_device_reads_strings_and_the_models_place():
    model = torch.nn.Linear(2, 2)
    assert isinstance(bf.devices.resolve_device(None, model), bf.CpuDevice)
    assert isinstance(bf.devices.resolve_device("cpu", model), bf.CpuDevice)
    sim = bf.devices.resolve_device("sim:8GiB", model)
    assert isinstance(sim, bf.SimulatedDevice) and sim.capacity_bytes() == 8 * 2**30
    assert bf.devices.resolve_device(sim, model) is sim
    assert bf.CpuDevice().capacity_bytes() > 0


@pytest.mark.parametrize("spec", ["tpu:0", "gpu", "sim:lots"])
def test_unknown_devices_name_the_fix(spec):
    with pytest.raises(ValueError, match="sim:|512MiB"):
        bf.devices.resolve_device(spec, torch.nn.Linear(2, 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_without_cuda_names_the_fix():
    with pytest.raises(ValueError, match="CUDA is not available.*sim:CAPACITY"):
        bf.devices.resolve_device("cuda:0", torch.nn.Linear(2, 2))


def test_cuda_device_reads_the_caching_allocator(monkeypatch):
    fake = FakeCuda()
    fake.patch(monkeypatch)
    device = CudaDevice(1)
    assert device.name == "cuda:1" and device.torch_device == torch.device("cuda", 1)
    assert device.capacity_bytes() == 6000 + 1500  # free memory plus this process's cache
    device.reset_peak()
    assert device.peak_bytes() == 4321 and device.reserved_peak_bytes() == 5432
    device.cleanup()
    device.synchronize()
    assert fake.calls == [("reset", torch.device("cuda", 1)), ("empty_cache",), ("sync", torch.device("cuda", 1))]
    assert device.exact_timeline() is None


def test_cuda_device_records_allocated_bytes_after_every_op(monkeypatch):
    fake = FakeCuda()
    fake.patch(monkeypatch)
    device = CudaDevice(0)
    with device.measuring():  # CPU ops stand in for CUDA ones: the mode reads the allocator after each
        x = torch.ones(3)
        y = x + 1
        del x, y
    assert device.timeline() == [1010, 1020]
    assert CudaDevice(0, record_timeline=False).timeline() is None


def test_mps_capacity_is_metals_recommended_working_set(monkeypatch):
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 12 * 2**30)
    assert MpsDevice().capacity_bytes() == 12 * 2**30


def test_preparing_a_compiled_workload_leaves_the_cuda_device_as_it_was(monkeypatch):
    fake = FakeCuda()
    fake.patch(monkeypatch)
    device = CudaDevice(0)
    model = torch.nn.Linear(2, 2)
    compiled = bf.Workload(torch.compile(model, backend="eager"), torch.zeros(2, 2), loss_fn=lambda out, b: out.sum())
    plain = bf.Workload(model, torch.zeros(2, 2), loss_fn=lambda out, b: out.sum())
    assert device.prepare(compiled) is compiled  # a compiled model is probed compiled...
    view = device.for_workload(compiled)
    assert view is not device and view.timeline() is None  # ...so its trials measure without the timeline
    assert device.record_timeline and device.for_workload(plain) is device  # the device itself is unchanged
    with device.measuring():
        torch.ones(3) + 1
    assert device.timeline() == [1010, 1020]  # the next search still records every op


def test_step_seconds_makes_each_step_cost_that_long_and_changes_no_answer():
    step_seconds = 0.05
    with Prober(mlp_tuple(), bf.SimulatedDevice("160KiB", step_seconds=step_seconds), steps=2) as prober:
        trial = prober.probe(4)
    assert trial.fits and trial.steps == 2
    assert trial.seconds >= 2 * step_seconds
    assert all(seconds >= step_seconds for seconds in trial.step_seconds)
    plain = bf.search_workload(mlp_tuple(), device=bf.SimulatedDevice("160KiB"), trace=False)
    slow = bf.search_workload(mlp_tuple(), device=bf.SimulatedDevice("160KiB", step_seconds=step_seconds), trace=False)
    assert [(t.batch_size, t.fits, t.peak_bytes) for t in slow.trials] == [
        (t.batch_size, t.fits, t.peak_bytes) for t in plain.trials
    ]
    assert slow.batch_size == plain.batch_size
    assert slow.seconds >= step_seconds * sum(t.steps for t in slow.trials if not t.oom)
    assert bf.SimulatedDevice("160KiB").step_seconds == 0.0


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_bad_step_seconds_name_the_fix(bad):
    with pytest.raises(ValueError, match="step_seconds must be a finite number of seconds, 0 or more"):
        bf.SimulatedDevice("1MiB", step_seconds=bad)


@pytest.mark.parametrize("bad", ["1s", True, None])
def test_step_seconds_of_the_wrong_type_are_type_errors(bad):
    with pytest.raises(TypeError, match="step_seconds must be a number of seconds"):
        bf.SimulatedDevice("1MiB", step_seconds=bad)


def test_a_simulated_capacity_the_host_cannot_give_is_refused_before_any_trial(monkeypatch):
    monkeypatch.setattr("batchfit.devices.cpu.available_host_bytes", lambda: 2**30)  # a host with 1 GiB free
    model = torch.nn.Linear(8, 2)
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    trials = []
    with pytest.raises(bf.InputError, match=r"sim:2\.0GiB would need up to 2\.0 GiB .* 1\.0 GiB available"):
        bf.find_max_batch_size(
            model, batch, loss_fn=torch.nn.functional.cross_entropy, device="sim:2GiB", on_trial=trials.append
        )
    assert trials == []
    # within the host's share it runs; and the trace, which allocates nothing, takes any capacity
    assert bf.probe_batch_size(model, batch, 4, loss_fn=torch.nn.functional.cross_entropy, device="sim:512MiB").fits
    estimate = bf.estimate_memory(model, batch, 4, loss_fn=torch.nn.functional.cross_entropy, device="sim:2GiB")
    assert estimate.fits


# -- sharded models (FSDP2): DTensors and UntypedStorage.resize_ ---------------------------------


def _sharded_weight():
    """A 64x64 fp32 weight (16 KiB) sharded over a fake world of 2 ranks: 8 KiB on this rank."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from batchfit.parallel.settings import Parallelism
    from batchfit.parallel.world import fake_world

    world = fake_world(Parallelism(world_size=2))
    mesh = world.__enter__()
    return world, distribute_tensor(torch.zeros(64, 64), mesh, [Shard(0)])


def test_a_dtensor_counts_its_local_shard_not_its_global_size():
    world, weight = _sharded_weight()
    try:
        assert weight.untyped_storage().nbytes() == 16384  # the wrapper's: global, allocates nothing
        counter = LiveBytes(rounding_bytes=1)
        counter.track_all([weight])
        assert counter.live_bytes == 8192
        with counter.mode():
            doubled = weight * 2  # a DTensor too: its local result counts
            assert counter.live_bytes == 2 * 8192
        assert counter.keys_of([doubled]) == [doubled.to_local().untyped_storage()._cdata]
        del doubled
        assert counter.live_bytes == 8192
    finally:
        world.__exit__(None, None, None)


def test_a_storage_resized_to_0_is_uncounted_and_counted_again_when_it_grows():
    counter = LiveBytes(rounding_bytes=1)
    with counter.mode():
        gathered = torch.ones(100)  # 400 bytes, as FSDP2's all-gathered parameters are made
        storage = gathered.untyped_storage()
        storage.resize_(0)  # FSDP2 frees gathered parameters so, after forward
        assert counter.live_bytes == 0
        storage.resize_(400)  # and so gathers them again for backward
        assert counter.live_bytes == 400
        gathered.add_(1)
    assert counter.timeline == [400, 0, 400, 400]  # a resize is an event of the timeline, as an op is
    born, freed, nbytes = counter.storage_log()
    assert nbytes.tolist() == [400, 400]  # one life per size: made by ones, then by the resize
    assert (born.tolist(), freed.tolist()) == ([0, 2], [1, 4])  # freed by resize_(0), born by the regrowth
    del gathered, storage
    assert counter.live_bytes == 0


def test_resize_is_watched_only_while_measuring_and_restored_after_an_error():
    def watched() -> bool:
        return "resize_" in torch.UntypedStorage.__dict__

    counter = LiveBytes(rounding_bytes=1)
    with counter.mode():
        assert watched()
    assert not watched()
    with pytest.raises(ValueError, match="a bad step"), counter.mode():
        raise ValueError("a bad step")
    assert not watched()
    storage = torch.ones(10).untyped_storage()
    storage.resize_(0)
    assert counter.live_bytes == 0  # not measuring: a resize is not counted


def test_a_resize_past_the_capacity_is_an_oom_and_leaves_the_storage_as_it_was():
    device = bf.SimulatedDevice(1000, rounding_bytes=1)
    storage = torch.ones(100).untyped_storage()
    storage.resize_(0)
    with pytest.raises(torch.OutOfMemoryError, match="sim:1000B out of memory|out of memory"), device.measuring():
        storage.resize_(4000)
    assert storage.nbytes() == 0 and device.live_bytes() == 0
    assert "resize_" not in torch.UntypedStorage.__dict__


def test_a_sharded_models_oom_comes_at_once_and_at_the_steps_end_only_when_peers_wait(monkeypatch):
    """Over torch's fake process group no rank waits for this one: the error comes where CUDA raises it.
    Under torchrun (gloo, NCCL) a rank that stopped half-way would leave the others in its next collective."""
    from batchfit.devices import accounting

    world, weight = _sharded_weight()
    try:
        assert not accounting.peers_wait()  # the fake group: collectives return at once
        device = bf.SimulatedDevice(10_000, rounding_bytes=1)
        device.register([weight])  # 8192 bytes of shards: the model is sharded
        finished = []
        with pytest.raises(torch.OutOfMemoryError) as raised, device.measuring():
            torch.ones(1000)  # 4000 more: past the capacity, raised here
            finished.append("ran on")
        assert not finished and "half-way" not in str(raised.value)
        monkeypatch.setattr(accounting, "peers_wait", lambda: True)  # as other ranks really running collectives
        with pytest.raises(torch.OutOfMemoryError, match="step cannot stop half-way"), device.measuring():
            big = torch.ones(1000)  # past the capacity, and the step goes on
            big.add_(1)
            finished.append("ran on")
        assert len(finished) == 1
    finally:
        world.__exit__(None, None, None)
    del weight, big
    assert device.live_bytes() == 0
    with pytest.raises(torch.OutOfMemoryError), device.measuring():  # no shards held: at once again
        torch.ones(3000)
        finished.append("not reached")
    assert len(finished) == 1


def test_a_storage_freed_on_another_thread_is_uncounted_by_the_counting_thread():
    """gloo's worker thread may drop the last reference to a buffer: the counts change only on the
    thread that counts, at its next op, never on two threads at once."""
    counter = LiveBytes(rounding_bytes=1)
    with counter.mode():
        held = [torch.ones(100)]
        releaser = threading.Thread(target=held.clear)
        releaser.start()
        releaser.join()
        assert counter.live_bytes == 400  # freed elsewhere: not yet settled
        kept = torch.ones(1)
        assert counter.live_bytes == 4
        born, freed, _ = counter.storage_log()
        assert freed.tolist() == [1, 2] and born.tolist() == [0, 1]
    del kept


def test_the_host_check_counts_the_copy_of_the_model_a_trial_keeps(monkeypatch):
    """A trial keeps a host copy of the model's state outside the simulated capacity: 600 MiB of
    capacity alone fits the 80% of 1 GiB, with a 256 MiB model's copy it does not."""
    monkeypatch.setattr("batchfit.devices.cpu.available_host_bytes", lambda: 2**30)
    small = torch.nn.Linear(8, 2)
    large = torch.nn.utils.skip_init(torch.nn.Linear, 8192, 8192, bias=False)  # 256 MiB, not initialised
    batch = torch.randn(4, 8)
    options = {"loss_fn": lambda out, batch: out.sum(), "device": "sim:600MiB"}
    assert bf.probe_batch_size(small, batch, 2, **options).fits
    with pytest.raises(bf.InputError, match=r"sim:600\.0MiB would need up to 856\.0 MiB .* 1\.0 GiB available"):
        bf.probe_batch_size(large, torch.randn(4, 8192), 2, **options)
