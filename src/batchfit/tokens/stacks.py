"""Ready lines for the stacks that batch by tokens, each with the keys its own source reads.

Training budgets come from the ``train`` mode; forward budgets (reference and rollout log-probs, scoring)
from the ``eval`` mode where it was measured, else the training budget stands in (it is smaller, so it
holds). A padded token budget (``fairseq --max-tokens``, NeMo-RL's dynamic batching) counts padding: rows
times the longest sequence, the smallest such product over the buckets, so that every bucket fits.

Keys, as each project spells them (read from its source, 2026): verl ``verl/trainer/config/actor/actor.yaml``,
``ref/ref.yaml``, ``rollout/rollout.yaml``; OpenRLHF ``openrlhf/cli/train_ppo_ray.py`` (dotted names from
0.10.2; ``--packing_samples``, ``--use_dynamic_batch``, ``--train_max_tokens_per_gpu`` before);
slime ``slime/utils/arguments.py``; SkyRL ``skyrl/train/config/config.py``; NeMo-RL
``examples/configs/grpo_math_1B.yaml``; NeMo's lhotse dataloader ``nemo/collections/common/data/lhotse/
dataloader.py``; TRL ``trl/trainer/sft_config.py``; fairseq ``fairseq/dataclass/configs.py``.
"""

from __future__ import annotations

from batchfit.tokens.result import ModeBudget
from batchfit.tokens.result import TokenBudget


def _packed(mode: ModeBudget | None) -> int | None:
    return mode.packed.tokens if mode is not None and mode.packed is not None else None


def _padded(mode: ModeBudget | None) -> int | None:
    return min(bucket.tokens for bucket in mode.buckets) if mode is not None and mode.buckets else None


def stack_lines(budget: TokenBudget) -> dict[str, list[str]]:
    """Each stack's lines for ``budget`` (a stack that needs a packed budget is left out without one).

    >>> from batchfit.tokens.result import PackedBudget
    >>> from types import SimpleNamespace as S
    >>> mode = ModeBudget("train", [], PackedBudget({512: S(batch_size=8192)}), None)
    >>> stack_lines(TokenBudget("lm", "sim", 1, 1, mode))["slime"]
    ['--use-dynamic-batch-size --max-tokens-per-gpu 8192 --log-probs-max-tokens-per-gpu 8192']
    """
    train, forward = budget.training, budget.forward or budget.training
    lines: dict[str, list[str]] = {}
    packed, packed_forward = _packed(train), _packed(forward) or _packed(train)
    if packed is not None:
        lines.update(_packed_lines(packed, packed_forward))
    if train.buckets:
        lengths = [bucket.seq_len for bucket in train.buckets]
        sizes = [bucket.batch_size for bucket in train.buckets]
        forward_size = (forward.buckets or train.buckets)[-1].batch_size
        lines.update(padded_lines(lengths, sizes, _padded(train), _padded(forward) or _padded(train), forward_size))
    return lines


def padded_lines(
    lengths: list[int], sizes: list[int], tokens: int, forward_tokens: int, forward_size: int
) -> dict[str, list[str]]:
    """The lines of padded batching: each bucket's size (``lengths``, ``sizes``), the padded token budget
    (``tokens``, smallest rows x longest over the buckets) and the forward ones.

    >>> padded_lines([128, 256], [8, 4], 1024, 2048, 9)["fairseq"]
    ['--max-tokens 1024 --max-tokens-valid 2048']
    """
    return {
        "nemo-rl (dynamic batching, padded)": [
            f"policy.dynamic_batching.enabled=true policy.dynamic_batching.train_mb_tokens={tokens} "
            f"policy.dynamic_batching.logprob_mb_tokens={forward_tokens} policy.sequence_packing.enabled=false"
        ],
        "lhotse (NeMo train_ds, bins in tokens)": [
            "use_bucketing=true",
            f"bucket_duration_bins=[{','.join(map(str, lengths))}]",
            f"bucket_batch_size=[{','.join(map(str, sizes))}]",
        ],
        "fairseq": [f"--max-tokens {tokens} --max-tokens-valid {forward_tokens}"],
        "hf trainer (padded)": [
            f"TrainingArguments(per_device_train_batch_size={sizes[-1]}, per_device_eval_batch_size={forward_size})"
            f"  # sequences up to {lengths[-1]} tokens"
        ],
    }


def _packed_lines(tokens: int, forward_tokens: int) -> dict[str, list[str]]:
    return {
        "verl": [
            "actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.use_dynamic_bsz=True "
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens} "
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True "
            f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={forward_tokens} "
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True "
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={forward_tokens}"
        ],
        "openrlhf": [
            f"--ds.packing_samples --train.dynamic_batch_enable --train.max_tokens_per_gpu {tokens} "
            f"--rollout.max_tokens_per_gpu {forward_tokens}",
            f"# before 0.10.2: --packing_samples --use_dynamic_batch --train_max_tokens_per_gpu {tokens} "
            f"--rollout_max_tokens_per_gpu {forward_tokens}",
        ],
        "slime": [
            f"--use-dynamic-batch-size --max-tokens-per-gpu {tokens} --log-probs-max-tokens-per-gpu {forward_tokens}"
        ],
        "skyrl": [f"trainer.max_tokens_per_microbatch={tokens}  # one key for training and forward passes"],
        "nemo-rl (sequence packing)": [
            f"policy.sequence_packing.enabled=true policy.sequence_packing.train_mb_tokens={tokens} "
            f"policy.sequence_packing.logprob_mb_tokens={forward_tokens} policy.dynamic_batching.enabled=false"
        ],
        "trl (packed SFT)": [
            f'SFTConfig(packing=True, packing_strategy="bfd", max_length={tokens}, per_device_train_batch_size=1)'
        ],
    }
