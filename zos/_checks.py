"""Argument checks shared by the library's constructors and the harness's configuration: one
helper per rule, so each rule has one message wherever it is checked."""
from __future__ import annotations

import numbers

import numpy as np


class NotAnIntError(TypeError, ValueError):
    """A value that must be an int is not one (a float, bool, string, None, ...).

    A TypeError, and a ValueError too: several public calls that now share :func:`check_int`
    (``BucketTable.padded_size``, ``GraphCache.capture``, ``DecodeBuffers``'s sizes,
    ``StagingRing``, ``DeviceMetadataBackend``'s ``ring_slots``, ``launch_prep``'s
    ``padded_size``) documented a ValueError for it, and callers catching that still do."""


def check_int(field: str, value, lo: int | None = 1) -> int:
    """``value`` as a Python int. :class:`NotAnIntError` (a TypeError) naming ``field`` unless
    it is an integer (a Python or numpy int; bools refused), ValueError if it is below ``lo``
    (None: no bound)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise NotAnIntError(f"{field}: expected an int, got {value!r} "
                            f"({type(value).__name__})")
    if lo is not None and value < lo:
        raise ValueError(f"{field}: must be >= {lo}, got {value!r}")
    return int(value)
