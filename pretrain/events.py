"""What a training rank tells the stage that launched it: one stdout line per event, ``@@hylight {json}``.

Rank 0 writes them (:func:`emit`: metrics, progress, the summary); the stage's relay (``pretrain/launch.py``) reads
them back (:func:`parse`) and forwards them to MLflow. No torch here: both sides import it.
"""

from __future__ import annotations

import json
from typing import Any

METRIC_PREFIX = "@@hylight "


def emit(kind: str, payload: dict[str, Any], rank: int) -> None:
    """One line to the parent (rank 0 only): ``@@hylight {"kind": ..., ...}``."""
    if rank == 0:
        print(METRIC_PREFIX + json.dumps({"kind": kind, **payload}), flush=True)


def parse(line: str) -> dict[str, Any] | None:
    """The event of an ``@@hylight`` line; None for any other line (a rank's own output)."""
    if not line.startswith(METRIC_PREFIX):
        return None
    return json.loads(line[len(METRIC_PREFIX):])
