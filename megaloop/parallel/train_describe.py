"""``TrainingSplit.describe``."""

from __future__ import annotations

from typing import Any


def describe(split: Any) -> str:
    return summary(split)


def summary(split: Any) -> str:
    return f"{split.options.strategy}: {split.predicted.step_us:.1f} us"
