"""The Lightning callback on a real CPU Trainer, with trials and training against a simulated capacity."""

import json
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the Lightning integration needs lightning: pip install 'batchfit[lightning]'")

import torch
from torch.nn import functional as F

import batchfit as bf
from batchfit.integrations.lightning import LOOP_HEADROOM
from batchfit.integrations.lightning import BatchFit
from batchfit.integrations.lightning import fit_batch_size
from batchfit.integrations.result import FitResult
from ddp_launch import ddp_output
from lightning_models import Classifier
from lightning_models import Data
from lightning_models import PlainClassifier
from lightning_models import Recorder
from lightning_models import sample
from lightning_models import trainer

CAPACITY = "6MiB"


def library_answer(module: Classifier, margin: str = LOOP_HEADROOM) -> int:
    """What batchfit finds for the same step, written without Lightning."""
    return bf.find_max_batch_size(
        module.net,
        sample(),
        loss_fn=F.cross_entropy,
        optimizer=torch.optim.Adam(module.net.parameters(), lr=1e-3),
        device=bf.SimulatedDevice(CAPACITY),
        margin=margin,
        keep_output=False,  # Lightning's training_step returns the loss: the output dies before backward
    ).batch_size


def train_within(device: bf.SimulatedDevice, run, module: Classifier) -> None:
    """Train with the model's bytes counted against the device, as they would be on a GPU."""
    device.register(list(module.parameters()))
    with device.measuring():
        run()


def test_the_callback_sets_the_librarys_answer_and_lightning_trains_at_it():
    module = Classifier()
    callback = BatchFit(device=bf.SimulatedDevice(CAPACITY))
    fitter = trainer(callbacks=[callback])
    fitter.fit(module)
    expected = library_answer(Classifier())
    assert 16 < expected < 8192  # the capacity, not the dataset, sets the edge
    assert module.hparams.batch_size == callback.result.micro_batch_size == expected
    assert callback.result.search.trials[-1].batch_size in (expected, expected + 1)
    trials = callback.result.search.trials
    assert module.rows_seen[: 2 * len(trials)] == [t.batch_size for t in trials for _ in range(2)]  # two steps each
    assert module.rows_seen[2 * len(trials) :] == [expected] * 3  # then three real steps at the size found
    assert fitter.accumulate_grad_batches == 1


def test_real_training_fits_at_the_size_found_and_the_headroom_is_needed():
    module = Classifier()
    found = fit_batch_size(trainer(), module, device=bf.SimulatedDevice(CAPACITY)).micro_batch_size
    module.rows_seen.clear()  # the probe's steps ran training_step too
    train_within(bf.SimulatedDevice(CAPACITY), lambda: trainer().fit(module), module)
    assert module.rows_seen == [found] * 3  # three Lightning steps with every byte counted, no OOM
    # Without the headroom the step's edge is found exactly, and Lightning's loop holds a little more.
    module.hparams.batch_size = library_answer(Classifier(), margin=0) + 1
    with pytest.raises(torch.OutOfMemoryError):
        train_within(bf.SimulatedDevice(CAPACITY), lambda: trainer().fit(module), module)


def test_a_global_batch_is_kept_by_accumulation_and_lightning_uses_it():
    module = Classifier()
    fitter = trainer(max_steps=2)
    result = fit_batch_size(fitter, module, global_batch_size=3000, device=bf.SimulatedDevice(CAPACITY))
    assert result.micro_batch_size * result.gradient_accumulation_steps == 3000 == result.global_batch_size
    assert result.micro_batch_size <= result.search.batch_size and result.gradient_accumulation_steps > 1
    assert fitter.accumulate_grad_batches == result.gradient_accumulation_steps
    probed = len(result.search.trials) + len(result.one_step_search.trials)  # a plain step's search, then a held one
    assert len(module.rows_seen) == 2 * probed  # only the probe's steps: fit stopped
    module.rows_seen.clear()
    fitter.fit(module)
    assert module.rows_seen == [result.micro_batch_size] * (2 * result.gradient_accumulation_steps)


def test_with_accumulation_the_micro_batch_is_measured_with_the_gradients_alive():
    margin = "8KiB"  # room for Lightning's own small tensors (2 KiB), not for the gradients (43 KiB)
    module = Classifier()
    result = fit_batch_size(
        trainer(), module, global_batch_size=4000, margin=margin, device=bf.SimulatedDevice(CAPACITY)
    )
    assert result.accumulating and result.search.batch_size < result.one_step_search.batch_size
    assert result.global_batch_size == 4000
    module.rows_seen.clear()
    fitter = trainer(max_steps=2, accumulate_grad_batches=result.gradient_accumulation_steps)  # 2: with Adam's state
    train_within(bf.SimulatedDevice(CAPACITY), lambda: fitter.fit(module), module)
    assert module.rows_seen == [result.micro_batch_size] * 2 * result.gradient_accumulation_steps  # two whole windows
    module.hparams.batch_size, module.rows_seen = result.one_step_search.batch_size, []
    with pytest.raises(torch.OutOfMemoryError):  # the plain step's answer does not, once gradients are held
        train_within(
            bf.SimulatedDevice(CAPACITY), lambda: trainer(max_steps=2, accumulate_grad_batches=2).fit(module), module
        )
    assert module.rows_seen == [result.one_step_search.batch_size] * 4  # it failed in the second window's backward


def test_the_datamodule_gets_the_size_and_the_state_is_restored():
    module, data = PlainClassifier(), Data()
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    rng = torch.get_rng_state()
    result = fit_batch_size(trainer(), module, datamodule=data, device=bf.SimulatedDevice(CAPACITY))
    assert data.batch_size == result.micro_batch_size == library_answer(Classifier())
    assert "batch_size" not in module.hparams  # set where it is: on the datamodule
    assert all(torch.equal(before[name], tensor) for name, tensor in module.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and module.training


def test_the_result_is_logged_to_every_logger():
    recorder = Recorder()
    callback = BatchFit(device=bf.SimulatedDevice(CAPACITY), early_exit=True)
    trainer(callbacks=[callback], logger=recorder).fit(Classifier())
    logged = [m for m in recorder.metrics if "batchfit/batch_size" in m]
    assert len(logged) == 1
    assert logged[0]["batchfit/batch_size"] == callback.result.micro_batch_size
    assert logged[0]["batchfit/trials"] == len(callback.result.search.trials) >= 2
    assert logged[0]["batchfit/peak_bytes"] <= bf.SimulatedDevice(CAPACITY).capacity_bytes()
    # The names of the shared result (and of the Transformers integration's log entry) are logged too.
    assert logged[0]["batchfit/micro_batch_size"] == callback.result.micro_batch_size
    assert logged[0]["batchfit/gradient_accumulation_steps"] == logged[0]["batchfit/accumulate_grad_batches"] == 1


def test_the_dataset_length_caps_the_search():
    result = fit_batch_size(trainer(), Classifier(), device=bf.SimulatedDevice("64MiB"), strategy="binary")
    assert result.micro_batch_size == result.search.max_batch_size == 8192  # no untested size past the data


def test_clear_errors_for_what_batchfit_cannot_set():
    with pytest.raises(ValueError, match="batch_arg_name"):
        fit_batch_size(trainer(), Classifier(), batch_arg_name="bs", device=bf.SimulatedDevice(CAPACITY))
    loader = Classifier().train_dataloader()
    with pytest.raises(ValueError, match="LightningDataModule"):
        trainer(callbacks=[BatchFit(device=bf.SimulatedDevice(CAPACITY))]).fit(Classifier(), loader)
    with pytest.raises(ValueError, match="positive integer"):
        BatchFit(global_batch_size=0)


def cheap() -> dict:
    """Search options for a fit capped at 4, on a fresh device: fast, for what is not about sizes."""
    return {"device": bf.SimulatedDevice(CAPACITY), "min_batch_size": 4, "max_batch_size": 4, "steps": 1}


def test_an_inexact_global_batch_is_treated_as_in_the_transformers_integration():
    """The same error, warning and result as test_transformers.py's twin: 61 samples in micro-batches
    of at most 4 on one device is no exact split; with allow_inexact=True it is plan_batch's closest."""
    fitter = trainer()
    with pytest.raises(ValueError, match=r"global batch of 61 cannot be split exactly .* allow_inexact=True"):
        fit_batch_size(fitter, Classifier(), global_batch_size=61, **cheap())
    assert fitter.accumulate_grad_batches == 1  # nothing was set
    fitter = trainer()
    with pytest.warns(UserWarning, match=r"the closest is 60 \(4 x 15 x 1\)"):
        result = fit_batch_size(fitter, Classifier(), global_batch_size=61, allow_inexact=True, **cheap())
    assert result.plan == bf.plan_batch(micro_batch_size=4, global_batch_size=61, devices=1)
    assert (result.global_batch_size, result.requested_global_batch_size, result.exact_global_batch) == (60, 61, False)
    assert (result.micro_batch_size, result.gradient_accumulation_steps) == (4, 15)
    assert fitter.accumulate_grad_batches == 15


def test_the_result_speaks_the_shared_vocabulary_and_the_old_names_still_read():
    module = Classifier()
    result = fit_batch_size(trainer(), module, global_batch_size=8, **cheap())
    assert isinstance(result, FitResult) and result.eval_batch_size is None and result.exact_global_batch
    record = json.loads(json.dumps(result.to_dict()))
    assert record["micro_batch_size"] == 4 and record["gradient_accumulation_steps"] == 2
    assert record["settings"] == {"batch_size": 4, "accumulate_grad_batches": 2}
    assert record["previous"] == {"batch_size": 4, "accumulate_grad_batches": 1}
    assert result.summary().startswith("micro-batch 4 per device x 2 accumulation steps x 1 device = global batch 8")
    with pytest.deprecated_call(match="use micro_batch_size"):
        assert result.batch_size == 4
    with pytest.deprecated_call(match="use gradient_accumulation_steps"):
        assert result.accumulate_grad_batches == 2
    with pytest.deprecated_call(match="use one_step_search"):
        assert result.one_step is result.one_step_search


@pytest.mark.slow  # the shared torchrun launch: make reliability runs it
def test_ranks_agree_under_ddp(tmp_path_factory):
    out = ddp_output("ddp_lightning", tmp_path_factory) / "out"  # the launch ddp_suite.py shares
    first, second = (json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1))
    assert first["largest"] == second["largest"] == first["rank1_alone"] < first["rank0_alone"]
    assert first["batch_size"] == second["batch_size"] <= first["largest"]
    assert first["accumulate"] == second["accumulate"]
    assert first["batch_size"] * first["accumulate"] * 2 == 3000
    assert first["rows_seen"] == second["rows_seen"]  # the same trials on both ranks, then the same steps
    steps = 2 * first["accumulate"]  # two optimizer steps of accumulated micro-batches
    assert first["rows_seen"][-steps:] == [first["batch_size"]] * steps
