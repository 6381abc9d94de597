"""Where zos's Triton kernels run: compiled for the GPU, or in Triton's CPU interpreter.

Triton decides that once per kernel, when the kernel is defined (``@triton.jit`` returns an
``InterpretedFunction`` when ``TRITON_INTERPRET`` is on at that moment, a ``JITFunction``
otherwise). zos's kernels (``zos.triton_kernels``) are all defined together, when the first of
them is imported, so they share one mode. On a machine without CUDA this module turns
``TRITON_INTERPRET`` on before that (every launcher module imports it before triton: its own
import section, see pyproject.toml); set the variable yourself to override, before ``import
zos``.

After that moment the variable means nothing to zos: a launcher picks its launch configuration
from :func:`interpreted`, which looks at how the kernel was defined and at the tensors' device,
never at the environment. A process that sets or clears ``TRITON_INTERPRET`` later gets the same
kernels and the same grids (Triton's own ``jit`` reads it only at definition time too).

On a machine with CUDA the compiled kernels cannot read CPU tensors (Triton's "Pointer argument
... cannot be accessed from Triton (cpu tensor?)", raised deep inside a launch).
:func:`check_triton_device` is the one check of that rule: the constructors that bind zos's
kernels to tensors call it before anything is allocated, and :func:`interpreted` calls it for a
launcher that is handed tensors directly.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402  (after the variable)


def _is_interpreted(kernel) -> bool:
    return isinstance(kernel, InterpretedFunction)


def kernels_interpreted() -> bool:
    """Whether zos's Triton kernels were defined for Triton's interpreter (so they run on CPU
    tensors, one program after another) rather than compiled for the GPU. Fixed for the life of
    the process once the kernels are imported; the prep kernel ``rebuild_rows`` stands for all
    of them (``zos.triton_kernels`` defines them together)."""
    from zos.triton_kernels.prep import rebuild_rows

    return _is_interpreted(rebuild_rows)


def interpreted(kernel, device: torch.device) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter on tensors of ``device``: launchers then
    pick grids that suit programs run one by one (few, large programs; no split-KV).

    The one source of truth of a launch configuration: how ``kernel`` was defined
    (``InterpretedFunction`` or compiled ``JITFunction``), checked against ``device``. The
    environment is not read.

    Raises:
        ValueError: ``device`` is cpu and ``kernel`` was compiled for the GPU
            (:func:`check_triton_device`'s rule and message).
    """
    if _is_interpreted(kernel):
        return True
    if torch.device(device).type == "cpu":
        _refuse_cpu(f"{getattr(kernel, '__name__', 'kernel')} launch")
    return False


def check_triton_device(device, where: str) -> None:
    """ValueError naming ``where`` and the remedy if zos's Triton kernels cannot run on tensors
    of ``device``: CPU tensors while the kernels were compiled for the GPU (a machine with CUDA,
    ``TRITON_INTERPRET`` unset when the kernels were defined). Other devices pass."""
    if torch.device(device).type == "cpu" and not kernels_interpreted():
        _refuse_cpu(where)


def _refuse_cpu(where: str) -> None:
    why = ("this machine has CUDA, so zos's Triton kernels were compiled for the GPU"
           if torch.cuda.is_available() else
           "zos's Triton kernels were not defined for Triton's interpreter")
    raise ValueError(f"{where}: device is cpu, but {why} and cannot read CPU tensors. Put it "
                     f"on a CUDA device, or run the kernels on the CPU in Triton's interpreter: "
                     f"set TRITON_INTERPRET=1 in the environment before triton is imported "
                     f"(before `import zos`, e.g. `TRITON_INTERPRET=1 python ...`)")
