"""argparse types shared by the commands (megaloop/cli.py and the layers' commands): a bad value ends
as argparse's usage error naming the option."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An int >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"  # what argparse calls the type in its messages
    return parse
