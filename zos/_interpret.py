"""Run Triton kernels in Triton's CPU interpreter when there is no GPU.

Triton reads ``TRITON_INTERPRET`` when it is imported and when a kernel is defined, so every
launcher module imports this one before triton (its own import section, see pyproject.toml).
Set ``TRITON_INTERPRET`` yourself to override.

On a machine with CUDA the kernels are compiled for the GPU and cannot read CPU tensors
(Triton's "Pointer argument ... cannot be accessed from Triton (cpu tensor?)", raised deep
inside a launch). :func:`check_triton_device` is the one check of that rule: the constructors
that bind zos's kernels to tensors call it before anything is allocated.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreted(device: torch.device) -> bool:
    """True when Triton kernels on ``device`` run in the CPU interpreter (CPU tensors, or
    ``TRITON_INTERPRET`` set): launchers then pick grids that suit running programs one by one."""
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_interpreted() -> bool:
    """Whether zos's Triton kernels were defined for Triton's interpreter (so they run on CPU
    tensors): Triton decides that once, when a kernel is defined, from ``TRITON_INTERPRET``;
    the prep kernel ``rebuild_rows`` stands for all of them (they are defined after this module
    set the variable)."""
    from triton.runtime.interpreter import InterpretedFunction

    from zos.triton_kernels.prep import rebuild_rows

    return isinstance(rebuild_rows, InterpretedFunction)


def check_triton_device(device, where: str) -> None:
    """ValueError naming ``where`` and the remedy if zos's Triton kernels cannot run on tensors
    of ``device``: CPU tensors while the kernels were compiled for the GPU (a machine with CUDA,
    ``TRITON_INTERPRET`` unset when triton was imported). Other devices pass."""
    device = torch.device(device)
    if device.type != "cpu" or kernels_interpreted():
        return
    why = ("this machine has CUDA, so zos's Triton kernels were compiled for the GPU"
           if torch.cuda.is_available() else
           "zos's Triton kernels were not defined for Triton's interpreter")
    raise ValueError(f"{where}: device is cpu, but {why} and cannot read CPU tensors. Put it "
                     f"on a CUDA device, or run the kernels on the CPU in Triton's interpreter: "
                     f"set TRITON_INTERPRET=1 in the environment before triton is imported "
                     f"(before `import zos`, e.g. `TRITON_INTERPRET=1 python ...`)")
