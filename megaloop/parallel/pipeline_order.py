"""One forward, one backward (1F1B) for a pipeline's micro-batches inside the loop kernel."""

from __future__ import annotations

from typing import Any


def one_forward_one_backward(forward: Any, stages: int) -> None:
    return None
