"""Argument checks shared by the library's constructors and the harness's configuration."""
from __future__ import annotations

import numbers

import numpy as np


def check_int(field: str, value, lo: int = 1) -> int:
    """``value`` as a Python int. TypeError naming ``field`` unless it is an integer (a Python or
    numpy int; bools refused), ValueError if it is below ``lo``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{field}: expected an int, got {value!r} ({type(value).__name__})")
    if value < lo:
        raise ValueError(f"{field}: must be >= {lo}, got {value!r}")
    return int(value)
