"""Questions Hugging Face transformers asks its inputs, answered on the trace's fake tensors as on real ones.

transformers' ``find_packed_sequence_indices`` (``masking_utils``) looks at the position ids to tell packed
sequences from a plain batch, but gives up on any tensor its ``is_tracing`` cannot see through, fake tensors
included: the model then builds an explicit causal mask (and Llama repeats its keys and values) where on real
tensors it passes ``is_causal=True`` and no mask. A trace would then pick another attention kernel than the real
step does. While ``packed_sequence_check(mode)`` is active, the check runs on the real values the trace keeps for
the position ids (``TraceFakeMode.value``: from the sample, or an ``arange`` inside the model), as the real step
would; where the trace has no values, transformers' own answer stands. Nothing happens when transformers is not
imported.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from torch.utils._python_dispatch import _disable_current_modes


@contextlib.contextmanager
def packed_sequence_check(mode: Any) -> Iterator[None]:
    """Answer ``find_packed_sequence_indices`` for ``mode``'s fake position ids from their real values."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def answered(position_ids: Any) -> Any:
        real = mode.value(position_ids) if getattr(position_ids, "fake_mode", None) is mode else None
        if real is None:
            return original(position_ids)
        with _disable_current_modes():
            packed = original(real)
        return None if packed is None else mode.from_real(packed, position_ids.device)

    masking.find_packed_sequence_indices = answered
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
