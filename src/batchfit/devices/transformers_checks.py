"""Questions Hugging Face transformers asks its inputs, answered on the trace's fake tensors as on real ones.

Before it builds an attention mask, transformers looks at values: whether the position ids say sequences are
packed (``find_packed_sequence_indices``), whether an attention mask is all ones (then it passes none). It skips
those questions for any tensor its ``is_tracing`` cannot see through, fake tensors included, and then builds an
explicit mask (Llama also repeats its keys and values) where the real step passes ``is_causal=True`` and no mask:
a trace would pick another attention kernel than the step does. While ``real_value_checks(mode)`` is active,
``masking_utils.is_tracing`` says no for a fake tensor of ``mode`` whose real values the trace keeps
(``TraceFakeMode.value``: the sample's, or what an ``arange`` inside the model made), so the questions are
asked, and the trace answers them from those values as the real step would. Nothing happens when transformers
is not imported.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def real_value_checks(mode: Any) -> Iterator[None]:
    """Let transformers' mask checks ask ``mode``'s fake tensors what it asks real ones, where values are known."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "is_tracing", None)
    if original is None:
        yield
        return

    def is_tracing(tensor: Any = None) -> bool:
        known = getattr(tensor, "fake_mode", None) is mode and mode.value(tensor) is not None
        return original(None) if known else original(tensor)

    masking.is_tracing = is_tracing
    try:
        yield
    finally:
        masking.is_tracing = original
