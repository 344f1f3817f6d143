"""The Hugging Face Trainer integration: tiny GPT-2 and BERT from configs (random init, no download)
under simulated capacities. The sizes set are the library's answers for the Trainer's step, the
Trainer then really trains and evaluates at them inside the same capacity, the global batch is the
one asked for, and nothing else about the trainer changes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from accelerate.utils import convert_to_fp32
from transformers import BertConfig
from transformers import BertForSequenceClassification
from transformers import GPT2Config
from transformers import GPT2LMHeadModel
from transformers import Trainer
from transformers import TrainingArguments
from transformers import default_data_collator
from transformers.utils import logging as hf_logging

import batchfit as bf
from batchfit.integrations.result import FitResult
from batchfit.integrations.transformers import BatchFitCallback
from batchfit.integrations.transformers import TrainerFit
from batchfit.integrations.transformers import _outputs_in_fp32  # the one private helper tested directly
from batchfit.integrations.transformers import fit_trainer
from batchfit.integrations.transformers import fit_training_args
from batchfit.integrations.transformers import training_amp_dtype

hf_logging.set_verbosity_error()

SEQ_LEN = 16
ROWS = 256
GLOBAL = 16
QUICK = {"trace": False}  # on models this small the trace costs more time than the trials it saves


class RecordingCollator:
    """``default_data_collator`` that remembers how many rows each batch had."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, features):
        self.sizes.append(len(features))
        return default_data_collator(features)


def gpt2_rows() -> tuple[torch.nn.Module, list[dict]]:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (ROWS, SEQ_LEN)).tolist()]
    return GPT2LMHeadModel(config), rows  # lists, not tensors: the dataset itself is never counted


def bert_rows() -> tuple[torch.nn.Module, list[dict]]:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    ids = torch.randint(0, 256, (ROWS, SEQ_LEN)).tolist()
    rows = [{"input_ids": row, "attention_mask": [1] * SEQ_LEN, "labels": i % 3} for i, row in enumerate(ids)]
    return BertForSequenceClassification(config), rows


def make_trainer(tmp_path, build=gpt2_rows, *, per_device=4, accumulation=GLOBAL // 4, eval_rows=ROWS, **options):
    model, rows = build()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        max_steps=3,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        **options,
    )
    eval_dataset = rows[:eval_rows] if eval_rows else None
    return Trainer(
        model=model, args=args, train_dataset=rows, eval_dataset=eval_dataset, data_collator=RecordingCollator()
    )


def in_capacity(trainer: Trainer, capacity: str, run):
    """Run ``run()`` with every live tensor byte counted against ``capacity`` (OOM past it)."""
    device = bf.SimulatedDevice(capacity)
    device.register([*trainer.model.parameters(), *trainer.model.buffers()])
    with device.measuring():
        return run()


# -- the library's answers for the Trainer's step, written out here independently -----------------


def trainer_like_optimizer(trainer: Trainer) -> torch.optim.Optimizer:
    """The optimizer ``Trainer.create_optimizer`` builds: its class and settings, decay groups."""
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    named = list(trainer.model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": trainer.args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    return optimizer_class(groups, **kwargs)


def micro_step(*, amp: bool, grads_held: bool):
    """``Trainer.training_step``'s forward: train mode, outputs made fp32 under AMP (accelerate);
    with ``grads_held``, a micro-batch after the first of an accumulation window."""

    def step(model, batch):
        model.train()
        if grads_held:
            for param in model.parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        output = model(**batch)
        return (convert_to_fp32(output) if amp else output).loss

    return step


def library_answers(trainer: Trainer, capacity: str, amp_dtype) -> dict[str, bf.SearchResult]:
    """The train search as one step and as an accumulation micro-step, and the eval search with the
    optimizer's state alive (as during and after training)."""
    model, amp = trainer.model, amp_dtype is not None
    batch = default_data_collator(trainer.train_dataset[:4])
    eval_batch = default_data_collator(trainer.eval_dataset[:8])
    optimizer = trainer_like_optimizer(trainer)
    # keep_output=False: the Trainer's own step drops the output inside compute_loss
    common = {"optimizer": optimizer, "amp_dtype": amp_dtype, "keep_output": False, **QUICK}
    model.train()
    step = micro_step(amp=amp, grads_held=False) if amp else None
    plain = bf.find_max_batch_size(
        model, batch, device=bf.SimulatedDevice(capacity), max_batch_size=GLOBAL, step_fn=step, **common
    )
    accumulating = bf.find_max_batch_size(
        model,
        batch,
        device=bf.SimulatedDevice(capacity),
        max_batch_size=plain.batch_size,
        step_fn=micro_step(amp=amp, grads_held=True),
        **common,
    )
    snapshot = bf.StateSnapshot.take(model, optimizer)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # the state Adam keeps from its first step on
    optimizer.zero_grad()
    eval_step = (lambda m, b: convert_to_fp32(m(**b))) if amp else None
    evaluated = bf.find_max_batch_size(
        model,
        eval_batch,
        device=bf.SimulatedDevice(capacity),
        mode="eval",
        max_batch_size=len(trainer.eval_dataset),
        step_fn=eval_step,
        **common,
    )
    snapshot.restore()
    return {"plain": plain, "accumulating": accumulating, "eval": evaluated}


# -- the fit, then real training and evaluation at it ----------------------------------------------

CASES = {
    "gpt2-bf16": (gpt2_rows, "1200KiB", {"bf16": True}, torch.bfloat16),  # AMP where it matters: the logits
    "bert": (bert_rows, "800KiB", {}, None),
}


@pytest.mark.parametrize("name", CASES)
def test_the_sizes_set_are_the_librarys_answers_and_the_trainer_trains_and_evaluates_at_them(name, tmp_path, caplog):
    build, capacity, options, amp_dtype = CASES[name]
    expected = library_answers(make_trainer(tmp_path, build, **options), capacity, amp_dtype)
    trainer = make_trainer(tmp_path, build, **options)
    trainer.model.eval()  # as from_pretrained leaves it: the probe must still train with dropout, as train() will
    with caplog.at_level(logging.INFO, logger="batchfit"):
        fit = fit_trainer(trainer, device=bf.SimulatedDevice(capacity), margin=0, **QUICK)  # as library_answers
    assert not trainer.model.training
    # The global batch does not fit at once, so the micro-batch is measured as an accumulation
    # micro-step: with the gradients alive during the forward pass, it is smaller (see the end).
    assert fit.one_step_search.batch_size == expected["plain"].batch_size < GLOBAL
    assert fit.search.batch_size == expected["accumulating"].batch_size < expected["plain"].batch_size
    assert fit.micro_batch_size <= fit.search.batch_size
    assert fit.eval_batch_size == expected["eval"].batch_size >= fit.search.batch_size
    args = trainer.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (
        fit.micro_batch_size,
        fit.gradient_accumulation_steps,
    )
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * fit.world_size == GLOBAL
    assert trainer.get_total_train_batch_size(args) == GLOBAL  # transformers' own arithmetic agrees
    assert args.per_device_eval_batch_size == fit.eval_batch_size

    collator = trainer.data_collator
    collator.sizes.clear()
    with caplog.at_level(logging.INFO, logger="batchfit"):
        output = in_capacity(trainer, capacity, trainer.train)
    assert output.global_step == 3
    assert set(collator.sizes) == {fit.micro_batch_size}
    assert len(collator.sizes) >= 3 * fit.gradient_accumulation_steps
    collator.sizes.clear()
    metrics = in_capacity(trainer, capacity, trainer.evaluate)  # the optimizer's state is alive here
    assert max(collator.sizes) == fit.eval_batch_size and torch.isfinite(torch.tensor(metrics["eval_loss"]))

    # The callback fit_trainer added logged the plan when training began.
    entry = next(e["batchfit"] for e in trainer.state.log_history if "batchfit" in e)
    assert entry["plan"]["batch_configuration"]["total_batch_size"] == GLOBAL
    assert entry["micro_batch_size"] == entry["settings"]["per_device_train_batch_size"] == fit.micro_batch_size
    assert any(f'"total_batch_size": {GLOBAL}' in record.getMessage() for record in caplog.records)

    # Why: the one-step answer trains alone, but runs out of memory on an accumulation window's
    # second micro-batch, when the first one's gradients are alive.
    assert trains(build, capacity, options, fit.one_step_search.batch_size, 1, tmp_path)
    assert not trains(build, capacity, options, fit.one_step_search.batch_size, 2, tmp_path)


def trains(build, capacity: str, options: dict, per_device: int, accumulation: int, tmp_path) -> bool:
    """Whether a fresh trainer at these settings runs its steps inside ``capacity``."""
    trainer = make_trainer(tmp_path, build, per_device=per_device, accumulation=accumulation, **options)
    try:
        in_capacity(trainer, capacity, trainer.train)
    except torch.OutOfMemoryError:
        return False
    return True


# -- what must not change ------------------------------------------------------------------------


def cheap_fit(trainer: Trainer, **options) -> TrainerFit:
    """A fit on a capacity nothing comes near, capped at 4: fast, for what is not about sizes."""
    return fit_trainer(
        trainer, device=bf.SimulatedDevice("1GiB"), min_batch_size=4, max_batch_size=4, steps=1, **QUICK, **options
    )


def test_nothing_but_the_three_settings_changes(tmp_path):
    trainer = make_trainer(tmp_path, per_device=2, accumulation=8)
    model = trainer.model
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    args_before, rng_before = trainer.args.to_dict(), torch.get_rng_state()
    training = [m.training for m in model.modules()]
    fit = cheap_fit(trainer)
    assert all(torch.equal(p, params[name]) for name, p in model.named_parameters())  # bitwise
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == training
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert trainer.optimizer is None and trainer.lr_scheduler is None
    changed = {k for k, v in trainer.args.to_dict().items() if args_before[k] != v}
    assert changed == {"per_device_train_batch_size", "gradient_accumulation_steps", "per_device_eval_batch_size"}
    assert fit.settings() == dict.fromkeys(changed, 4)
    assert fit.previous == {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 8,
        "per_device_eval_batch_size": 8,
    }
    assert trainer._train_batch_size == 4  # what get_train_dataloader reads


def test_a_users_optimizer_is_the_one_probed_and_is_left_as_it_was(tmp_path):
    trainer = make_trainer(tmp_path, eval_rows=0)
    optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1, momentum=0.9)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    trainer.optimizer = optimizer
    cheap_fit(trainer)
    assert steps and trainer.optimizer is optimizer and not optimizer.state  # no momentum buffers left behind
    latest = cheap_fit(trainer)
    callbacks = [c for c in trainer.callback_handler.callbacks if isinstance(c, BatchFitCallback)]
    assert len(callbacks) == 1 and callbacks[0].fit is latest
    assert trainer.args.per_device_eval_batch_size == 8  # no eval dataset: not searched, not set


def test_the_train_search_stops_at_the_per_device_share_of_the_global_batch(tmp_path):
    trainer = make_trainer(tmp_path, per_device=2, accumulation=1, eval_rows=0)
    fit = fit_trainer(trainer, global_batch_size=6, device=bf.SimulatedDevice("1GiB"), steps=1, **QUICK)
    assert max(t.batch_size for t in fit.search.trials) == 6
    assert (fit.micro_batch_size, fit.gradient_accumulation_steps) == (6, 1)


def test_a_search_stopped_by_the_trainers_small_global_batch_says_how_to_search_further(tmp_path, caplog):
    """The default: the trainer's own global batch (2 x 1 x 1 here, 8 x 1 x 1 for TrainingArguments'
    defaults) caps the search, so the answer is the cap, not the device's edge: the fit says so and
    names the argument that searches further, in a warning a user sees without configuring logging."""
    trainer = make_trainer(tmp_path, per_device=2, accumulation=1, eval_rows=0)
    with caplog.at_level(logging.INFO, logger="batchfit"):
        fit = fit_trainer(trainer, device=bf.SimulatedDevice("1GiB"), steps=1, **QUICK)
    assert fit.micro_batch_size == 2
    assert fit.note == (
        "the search stopped at 2, each device's share of the trainer's global batch of 2 (per_device_train_batch_size"
        " 2 x gradient_accumulation_steps 1 x 1 device), so a larger micro-batch may fit: pass fit_trainer a larger"
        " global_batch_size (samples per optimizer step) to search further"
    )
    assert fit.summary().endswith(fit.note) and fit.to_dict()["note"] == fit.note
    [record] = [r for r in caplog.records if r.getMessage().startswith("batchfit: micro-batch")]
    assert record.levelno == logging.WARNING and fit.note in record.getMessage()
    fit = fit_trainer(trainer, global_batch_size=2, device=bf.SimulatedDevice("1GiB"), steps=1, **QUICK)
    assert "the search stopped at 2, each device's share of global_batch_size=2, so" in fit.note


def test_a_micro_batch_below_the_one_that_fits_says_why_and_which_global_batch_gives_it(tmp_path, caplog):
    """13 fits, but 13 does not divide 64: the plan sets 8 x 8, and the fit names the global
    batches that 13 divides; asking for one of them gives micro-batches of 13."""
    trainer = make_trainer(tmp_path, eval_rows=0)
    fit_13 = {"device": bf.SimulatedDevice("1GiB"), "max_batch_size": 13, "steps": 1, **QUICK}  # 13 fits, 14 untried
    with caplog.at_level(logging.INFO, logger="batchfit"):
        fit = fit_trainer(trainer, global_batch_size=64, **fit_13)
    assert (fit.search.batch_size, fit.micro_batch_size, fit.gradient_accumulation_steps) == (13, 8, 8)
    assert fit.note == (
        "the micro-batch is 8, not the 13 that fits, because 13 does not divide the 64 samples per device exactly"
        " (8 x 8 accumulation steps does); for micro-batches of 13, pass fit_trainer global_batch_size=52"
        " (13 x 4 x 1) or 65 (13 x 5 x 1)"
    )
    assert any(r.levelno == logging.WARNING and fit.note in r.getMessage() for r in caplog.records)
    fit = fit_trainer(trainer, global_batch_size=65, **fit_13)
    assert (fit.micro_batch_size, fit.gradient_accumulation_steps, fit.note) == (13, 5, None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="batchfit"):
        fit = cheap_fit(make_trainer(tmp_path, eval_rows=0))  # the cap 4 is the user's, and 4 divides 16: no note
    assert fit.note is None and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_global_batch_that_cannot_be_split_exactly_is_an_error_or_a_stated_approximation(tmp_path):
    trainer = make_trainer(tmp_path, eval_rows=0)
    with pytest.raises(ValueError, match=r"global batch of 61 cannot be split exactly .* allow_inexact=True"):
        cheap_fit(trainer, global_batch_size=61)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, GLOBAL // 4)
    with pytest.warns(UserWarning, match="the closest is 60"):
        fit = cheap_fit(trainer, global_batch_size=61, allow_inexact=True)
    assert fit.global_batch_size == trainer.get_total_train_batch_size(trainer.args) == 60


def test_an_inexact_global_batch_is_treated_as_in_the_lightning_integration(tmp_path):
    """The same error, warning and result as test_lightning.py's twin: 61 samples in micro-batches
    of at most 4 on one device is no exact split; with allow_inexact=True it is plan_batch's closest."""
    trainer = make_trainer(tmp_path, eval_rows=0)
    with pytest.raises(ValueError, match=r"global batch of 61 cannot be split exactly .* allow_inexact=True"):
        cheap_fit(trainer, global_batch_size=61)
    with pytest.warns(UserWarning, match=r"the closest is 60 \(4 x 15 x 1\)"):
        fit = cheap_fit(trainer, global_batch_size=61, allow_inexact=True)
    assert fit.plan == bf.plan_batch(micro_batch_size=4, global_batch_size=61, devices=1)
    assert (fit.global_batch_size, fit.requested_global_batch_size, fit.exact_global_batch) == (60, 61, False)
    assert (fit.micro_batch_size, fit.gradient_accumulation_steps) == (4, 15)
    assert trainer.get_total_train_batch_size(trainer.args) == 60


def test_the_fit_speaks_the_shared_vocabulary_and_the_old_names_still_read(tmp_path):
    fit = cheap_fit(make_trainer(tmp_path, per_device=2, accumulation=4))
    assert isinstance(fit, FitResult) and fit.exact_global_batch and fit.accumulating
    record = json.loads(json.dumps(fit.to_dict()))
    assert (record["micro_batch_size"], record["gradient_accumulation_steps"], record["eval_batch_size"]) == (4, 2, 4)
    assert record["global_batch_size"] == record["requested_global_batch_size"] == 8
    assert record["settings"] == fit.settings()
    assert fit.summary().startswith("micro-batch 4 per device x 2 accumulation steps x 1 device = global batch 8")
    with pytest.deprecated_call(match="use micro_batch_size"):
        assert fit.per_device_train_batch_size == 4
    with pytest.deprecated_call(match="use eval_batch_size"):
        assert fit.per_device_eval_batch_size == 4
    with pytest.deprecated_call(match="use search"):
        assert fit.train_search is fit.search


@pytest.mark.parametrize("bad", [0, -8, 2.5, True, "64"])
def test_a_global_batch_that_is_not_a_positive_integer_is_a_clear_error(tmp_path, bad):
    trainer = make_trainer(tmp_path, eval_rows=0)
    with pytest.raises(ValueError, match=rf"global_batch_size must be a positive integer .*got {bad!r}"):
        fit_trainer(trainer, global_batch_size=bad)


def test_other_bad_input_names_the_fix(tmp_path):
    trainer = make_trainer(tmp_path, eval_rows=0)
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        fit_trainer(trainer, max_batch_size=0)
    with pytest.raises(TypeError, match="needs a transformers.Trainer, got GPT2LMHeadModel: .* fit_training_args"):
        fit_trainer(trainer.model)
    trainer.train_dataset = None
    with pytest.raises(ValueError, match=r"no train_dataset .* Trainer\(train_dataset=...\)"):
        fit_trainer(trainer)
    with pytest.raises(TypeError, match="needs the TrainerFit that fit_trainer returns"):
        BatchFitCallback({"per_device_train_batch_size": 8})
    with pytest.raises(TypeError, match="args must be transformers.TrainingArguments, got dict"):
        fit_training_args(trainer.model, {}, [])


# -- the other entry points ------------------------------------------------------------------------


def test_model_arguments_and_dataset_without_a_trainer(tmp_path):
    model, rows = gpt2_rows()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=1,
        gradient_accumulation_steps=16,
        seed=7,
    )
    rng_before = torch.get_rng_state()
    fit = fit_training_args(
        model,
        args,
        rows,
        eval_dataset=rows[:16],
        data_collator=default_data_collator,
        device=bf.SimulatedDevice("1GiB"),
        min_batch_size=4,
        max_batch_size=4,
        steps=1,
        **QUICK,
    )
    assert torch.equal(torch.get_rng_state(), rng_before)  # the Trainer it built seeded the RNG: undone
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 4)
    assert args.per_device_eval_batch_size == fit.eval_batch_size == 4


def test_the_callback_warns_when_the_arguments_were_changed_after_the_fit(tmp_path, caplog):
    trainer = make_trainer(tmp_path, eval_rows=0)
    fit = cheap_fit(trainer, log_plan=False)
    assert not any(isinstance(c, BatchFitCallback) for c in trainer.callback_handler.callbacks)
    callback = BatchFitCallback(fit)
    trainer.args.gradient_accumulation_steps = 1
    with caplog.at_level(logging.INFO, logger="batchfit"):
        callback.on_train_begin(trainer.args, trainer.state, trainer.control)
    assert "gradient_accumulation_steps is 1, but the fit set 4" in caplog.text
    assert callback.logged["gradient_accumulation_steps"] == 4
    assert trainer.state.log_history[-1] == {"batchfit": fit.to_dict(), "step": 0}


def test_the_amp_dtype_follows_the_training_arguments(tmp_path):
    def args(**precision):
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **precision)

    assert training_amp_dtype(args(bf16=True)) == torch.bfloat16
    assert training_amp_dtype(args()) is None


def test_under_amp_the_probe_forward_returns_fp32_outputs_as_the_prepared_trainer_does(tmp_path):
    trainer = make_trainer(tmp_path, bf16=True, eval_rows=0)
    batch = default_data_collator(trainer.train_dataset[:2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert trainer.model(**batch).logits.dtype == torch.bfloat16
        with _outputs_in_fp32(trainer, trainer.model):
            assert trainer.model(**batch).logits.dtype == torch.float32  # what accelerate's prepare_model does
    assert "forward" not in trainer.model.__dict__  # the model's own forward again


def test_import_batchfit_does_not_import_transformers_and_a_missing_one_says_how_to_install(monkeypatch):
    code = "import sys, batchfit; assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    monkeypatch.delitem(sys.modules, "batchfit.integrations.transformers")
    with pytest.raises(ImportError, match=r"pip install 'batchfit\[transformers\]'"):
        import batchfit.integrations.transformers  # noqa: F401


# -- the headroom kept for the Trainer's loop ------------------------------------------------------


def test_by_default_two_mib_are_kept_for_the_trainers_loop_and_margin_0_keeps_none(tmp_path):
    capacity = bf.SimulatedDevice("1GiB").capacity_bytes()
    fit = cheap_fit(make_trainer(tmp_path))
    assert fit.search.limit_bytes == fit.one_step_search.limit_bytes == capacity - 2 * 2**20
    assert fit.eval_search.limit_bytes == capacity - 2 * 2**20
    fit = cheap_fit(make_trainer(tmp_path), margin=0)
    assert fit.search.limit_bytes == fit.eval_search.limit_bytes == capacity


def test_the_trainer_really_trains_at_the_size_found_with_the_default_headroom(tmp_path):
    capacity = "3200KiB"
    trainer = make_trainer(tmp_path, per_device=GLOBAL, accumulation=1, eval_rows=0)
    fit = fit_trainer(trainer, device=bf.SimulatedDevice(capacity), max_batch_size=GLOBAL, **QUICK)
    assert fit.one_step_search.batch_size < GLOBAL  # the device's edge, not the cap, set it
    trainer.data_collator.sizes.clear()
    assert in_capacity(trainer, capacity, trainer.train).global_step == 3
    assert set(trainer.data_collator.sizes) == {fit.micro_batch_size}
