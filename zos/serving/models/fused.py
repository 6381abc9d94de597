"""Fused Llama-layer elementwise ops in Triton: RMSNorm (with the residual add fused), RoPE with
the paged KV write, SiLU-and-mul. Kernels in ``triton_kernels/fused.py``.

They replace ~27 tiny torch kernels per decoder layer with 4 launches (two norms, RoPE + KV
write, SiLU-and-mul; a layer launches 10 kernels in all with its GEMMs and attention; vLLM's
``fused_add_rms_norm``, ``rotary_embedding`` + ``reshape_and_cache`` and ``silu_and_mul`` are
the models) and give the same results as the plain torch formulas they replace (each op rounded
to the model dtype where torch rounds it). Every launcher checks shapes, dtypes and devices on
the host (ValueError / TypeError naming the argument), reads no device value, and launches on a
grid that depends only on shapes, so the calls can be captured in a CUDA graph. ``T = 0`` rows
launch nothing.
"""
from __future__ import annotations

from zos._interpret import interpreted  # sets TRITON_INTERPRET before triton is imported

import torch
import triton

from zos._checks import check_int
from zos.triton_kernels.fused import rms_norm_kernel, rope_store_kv_kernel, silu_and_mul_kernel

__all__ = ["check_rms_norm", "check_rope_and_store_kv", "check_silu_and_mul", "rms_norm",
           "rope_and_store_kv", "silu_and_mul"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SILU_BLOCK = 4096
# Elements per program: the GPU kernels move one row (RMSNorm / SiLU) or ~1024 values (RoPE) per
# program. Triton's CPU interpreter pays ~0.1 ms per op per program, so there a program takes
# up to _INTERP_TILE elements (several rows); same kernels, same results, fewer programs.
_GPU_ROPE_TILE = 1024
_INTERP_TILE = 16384



def _rows_per_program(kernel, device: torch.device, n_rows: int, block: int) -> int:
    """1 on the GPU; on the interpreter as many rows as fit in _INTERP_TILE (a power of 2)."""
    if not interpreted(kernel, device):
        return 1
    return max(1, min(triton.next_power_of_2(n_rows), _INTERP_TILE // block))


def _tensor(where: str, name: str, t, dim: int) -> None:
    """TypeError unless ``t`` is a tensor of a supported float dtype; ValueError unless ``dim``-D
    with a contiguous last dimension."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{where}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{where}: {name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{where}: {name} must have a contiguous last dimension, got strides "
                         f"{tuple(t.stride())}")


def _same(where: str, ref_name: str, ref: torch.Tensor, others: dict) -> None:
    """TypeError for a dtype other than ``ref``'s, ValueError for another device."""
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise TypeError(f"{where}: {name} dtype {t.dtype} != {ref_name} dtype {ref.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{where}: {name} is on {t.device}, {ref_name} on {ref.device}")


def check_rms_norm(x, weight, residual=None) -> None:
    """The argument checks of :func:`rms_norm` (also those of the torch version,
    ``torch_ops.rms_norm``): TypeError / ValueError naming the argument."""
    where = "rms_norm"
    _tensor(where, "x", x, 2)
    _tensor(where, "weight", weight, 1)
    hidden = x.shape[1]
    if weight.shape[0] != hidden:
        raise ValueError(f"{where}: weight must be [{hidden}], got {tuple(weight.shape)}")
    _same(where, "x", x, {"weight": weight})
    if residual is not None:
        _tensor(where, "residual", residual, 2)
        if residual.shape != x.shape:
            raise ValueError(f"{where}: residual must be {tuple(x.shape)}, got "
                             f"{tuple(residual.shape)}")
        _same(where, "x", x, {"residual": residual})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm of each row, optionally after adding the residual (one Triton launch, grid ``(T,)``
    on the GPU: one program per row, ``BLOCK = next_pow2(hidden)``).

    Without ``residual`` it returns ``weight * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype)`` with
    ``xf = x.float()``: statistics in float32, the normalised row rounded to x's dtype before
    the multiply by ``weight`` in x's dtype (transformers' ``LlamaRMSNorm`` order). With
    ``residual`` it is vLLM's ``fused_add_rms_norm``: ``s = x + residual`` (in x's dtype) is
    normalised instead and also returned, so a decoder layer carries its residual stream without
    a separate add kernel. Row sums are reduced in a different order than torch's, so float32
    results may differ from torch by an ulp or so.

    Args:
        x: ``[T, hidden]`` float32 / bfloat16 / float16, contiguous last dim (a row stride is
            allowed). Not written.
        weight: ``[hidden]``, x's dtype and device, contiguous.
        eps: added to the mean square.
        residual: optional ``[T, hidden]``, x's dtype and device, contiguous last dim. Not
            written (the sum goes to a new tensor).

    Returns:
        ``out`` ``[T, hidden]`` (new contiguous tensor, x's dtype) without ``residual``;
        ``(out, s)`` with it, ``s = x + residual`` a new contiguous ``[T, hidden]`` tensor.

    Raises:
        TypeError: a non-tensor, an unsupported dtype or a dtype other than x's (names it).
        ValueError: a shape, layout or device mismatch (names the argument).
    """
    check_rms_norm(x, weight, residual)
    t, hidden = x.shape
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty_like(out)
    if t > 0 and hidden > 0:
        has_res = residual is not None
        res, res_o = (residual, res_out) if has_res else (x, out)  # unused pointers
        block = triton.next_power_of_2(hidden)
        rows = _rows_per_program(rms_norm_kernel, x.device, t, block)
        rms_norm_kernel[(triton.cdiv(t, rows),)](
            x, res, weight, out, res_o, x.stride(0), res.stride(0), out.stride(0),
            res_o.stride(0), t, hidden, float(eps), HAS_RESIDUAL=has_res, ROWS=rows,
            BLOCK=block, num_warps=4 if block <= 4096 else 8, enable_fp_fusion=False)
    return out if residual is None else (out, res_out)


def check_rope_and_store_kv(qkv, cos, sin, kv_cache, slot_mapping, num_heads: int,
                            num_kv_heads: int, head_dim: int) -> None:
    """The argument checks of :func:`rope_and_store_kv` (also those of the torch version,
    ``torch_ops.rope_and_store_kv``): TypeError / ValueError naming the argument."""
    where = "rope_and_store_kv"
    for name, val in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
        check_int(f"{where}: {name}", val)
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim must be even, got {head_dim}")
    _tensor(where, "qkv", qkv, 2)
    t = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"{where}: qkv must be [T, (num_heads + 2 * num_kv_heads) * head_dim ="
                         f" {width}], got {tuple(qkv.shape)}")
    for name, c in (("cos", cos), ("sin", sin)):
        _tensor(where, name, c, 2)
        if tuple(c.shape) != (t, head_dim):
            raise ValueError(f"{where}: {name} must be [{t}, {head_dim}], got "
                             f"{tuple(c.shape)}")
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{where}: kv_cache must be a torch.Tensor, got "
                        f"{type(kv_cache).__name__}")
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2
            or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim)):
        raise ValueError(f"{where}: kv_cache must be [2, num_kv_blocks, block_size, "
                         f"{num_kv_heads}, {head_dim}], got {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"{where}: kv_cache must be contiguous")
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"{where}: slot_mapping must be a torch.Tensor, got "
                        f"{type(slot_mapping).__name__}")
    if tuple(slot_mapping.shape) != (t,):
        raise ValueError(f"{where}: slot_mapping must be [{t}], got "
                         f"{tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"{where}: slot_mapping must be int64, got {slot_mapping.dtype}")
    _same(where, "qkv", qkv, {"cos": cos, "sin": sin, "kv_cache": kv_cache})
    if slot_mapping.device != qkv.device:
        raise ValueError(f"{where}: slot_mapping is on {slot_mapping.device}, qkv on "
                         f"{qkv.device}")


def rope_and_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                      num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rotate-half RoPE on q and k of a fused qkv projection, K/V into the paged cache, one
    Triton launch (vLLM's ``rotary_embedding`` + ``reshape_and_cache`` in one kernel).

    Each head ``x`` becomes ``x * cos + cat(-x[D/2:], x[:D/2]) * sin`` with both products and
    the sum rounded to the model dtype (as the torch composition computes it, so the result is
    bit-identical to it). Rotated k and the unchanged v of row ``t`` are written to cache slot
    ``slot_mapping[t]`` exactly as :func:`zos.serving.models.attention.store_kv` does.
    Work is split over (token, rotated head) pairs, ``T * (num_heads + num_kv_heads)`` of them,
    ``PAIRS`` per program (on the GPU ~1024 values: 32 pairs at head_dim 64), so the grid
    ``(cdiv(T * (num_heads + num_kv_heads), PAIRS),)`` depends on shapes only.

    Args:
        qkv: ``[T, (num_heads + 2 * num_kv_heads) * head_dim]`` (q heads, k heads, v heads),
            float32 / bfloat16 / float16, contiguous last dim. Not written.
        cos, sin: ``[T, head_dim]`` in qkv's dtype (the table rows at each token's position),
            contiguous last dim.
        kv_cache: ``[2, num_kv_blocks, block_size, num_kv_heads, head_dim]``, qkv's dtype,
            contiguous; K at ``[0]``, V at ``[1]``, written in place at the slots of
            ``slot_mapping`` (nothing else is written).
        slot_mapping: int64 ``[T]``, any stride (copied first unless contiguous); rows with
            slot ``< 0`` (PAD_SLOT_ID) or ``>= num_kv_blocks * block_size`` write nothing to
            the cache (their q is still returned).
        num_heads, num_kv_heads, head_dim: positive; head_dim even.

    Returns:
        Rotated q, a new contiguous ``[T, num_heads, head_dim]`` tensor of qkv's dtype.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, a dtype other than qkv's, slot_mapping
            not int64 (names the argument).
        ValueError: shape, layout or device mismatches, bad head counts (names the argument).
    """
    check_rope_and_store_kv(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads,
                            head_dim)
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    n_pairs = t * (num_heads + num_kv_heads)
    half_block = triton.next_power_of_2(head_dim // 2)
    tile = _INTERP_TILE if interpreted(rope_store_kv_kernel, qkv.device) else _GPU_ROPE_TILE
    pairs = max(1, min(triton.next_power_of_2(n_pairs), tile // half_block))
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    if slot_mapping.stride(0) != 1:  # the kernel reads row t's slot at offset t
        slot_mapping = slot_mapping.contiguous()
    rope_store_kv_kernel[(triton.cdiv(n_pairs, pairs),)](
        qkv, cos, sin, q, kv_cache[0], kv_cache[1], slot_mapping, qkv.stride(0), cos.stride(0),
        sin.stride(0), t, num_heads, num_kv_heads, num_slots, HEAD_DIM=head_dim,
        HALF_BLOCK=half_block, PAIRS=pairs, num_warps=4 if pairs * half_block >= 512 else 2,
        enable_fp_fusion=False)
    return q


def check_silu_and_mul(gate_up) -> None:
    """The argument checks of :func:`silu_and_mul` (also those of the torch version,
    ``torch_ops.silu_and_mul``): TypeError / ValueError naming the argument."""
    where = "silu_and_mul"
    _tensor(where, "gate_up", gate_up, 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"{where}: gate_up must be [T, 2 * I], got {tuple(gate_up.shape)}")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``, one Triton launch (vLLM's
    ``silu_and_mul``), grid ``(T, cdiv(I, 4096))`` on the GPU.

    SiLU is computed in float32 and rounded to the input dtype, then the product with ``up`` is
    rounded to the input dtype (torch's two-op order; ``exp`` may differ from torch's by an ulp).

    Args:
        gate_up: ``[T, 2 * I]`` float32 / bfloat16 / float16, gate columns then up columns,
            contiguous last dim (a row stride is allowed). Not written.

    Returns:
        A new contiguous ``[T, I]`` tensor of gate_up's dtype.

    Raises:
        TypeError: a non-tensor or an unsupported dtype. ValueError: not 2-D, an odd last
            dimension or a non-contiguous last dimension.
    """
    check_silu_and_mul(gate_up)
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t > 0 and n > 0:
        block = min(triton.next_power_of_2(n), _SILU_BLOCK)
        rows = _rows_per_program(silu_and_mul_kernel, gate_up.device, t, block)
        silu_and_mul_kernel[(triton.cdiv(t, rows), triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), t, n, ROWS=rows, BLOCK=block,
            num_warps=8 if block >= 2048 else 4, enable_fp_fusion=False)
    return out
