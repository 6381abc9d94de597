"""Pure ``@triton.jit`` kernels of zos: no host logic, no shape checks.

Launchers that check shapes, dtypes and devices live in :mod:`zos.kernels`,
:mod:`zos.attention` and :mod:`zos.serving.models`. Installed as ``zos.triton_kernels`` (see
pyproject.toml).

Every kernel module is imported here, so the first import of any kernel defines all of them at
once: Triton fixes a kernel's mode (compiled or interpreted) when it is defined, and zos's
kernels must share one (:mod:`zos._interpret`).
"""
from zos.triton_kernels import (  # noqa: F401
    fused,
    kv_cache,
    paged_attention,
    prep,
    spec,
    varlen_attention,
    vllm_layout,
)
