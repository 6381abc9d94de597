"""Pure ``@triton.jit`` kernels of zos: no host logic, no shape checks.

Launchers that check shapes, dtypes and devices live in :mod:`zos.kernels` and
:mod:`zos.models.attention`. Installed as ``zos.triton_kernels`` (see pyproject.toml).
"""
