"""What one rank's real trials found when they checked a traced plan (``batchfit plan CONFIG --gpus N --verify``):
the result ``verify_plan`` returns and a ``Progress`` shows."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any


@dataclass
class PlanVerification:
    """What one rank's real trials found on ``device``: ``rows`` (JSON-ready, one per size tried, with the
    fake and the real peak), ``notes`` (a sentence per traced answer replaced) and ``accumulating`` (the rows
    of later micro-batches, the window's gradients held)."""

    device: str
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    accumulating: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON's ``verification``: the device, the mode and every row."""
        return {"device": self.device, "mode": "one rank, real trials", "rows": self.rows + self.accumulating}
