"""Pure ``@triton.jit`` kernels of zos: no host logic, no shape checks.

Launchers that check shapes, dtypes and devices live in :mod:`zos.kernels`,
:mod:`zos.attention` and :mod:`zos.serving.models`. Installed as ``zos.triton_kernels`` (see
pyproject.toml).
"""
