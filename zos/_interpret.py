"""Run Triton kernels in Triton's CPU interpreter when there is no GPU.

Triton reads ``TRITON_INTERPRET`` when it is imported and when a kernel is defined, so every
launcher module imports this one before triton (its own import section, see pyproject.toml).
Set ``TRITON_INTERPRET`` yourself to override.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreted(device: torch.device) -> bool:
    """True when Triton kernels on ``device`` run in the CPU interpreter (CPU tensors, or
    ``TRITON_INTERPRET`` set): launchers then pick grids that suit running programs one by one."""
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
