"""Paged KV-cache write kernel (pure ``@triton.jit``; the launcher is
:func:`zos.serving.models.attention.store_kv`, which checks shapes, dtypes and devices).

Layout read/written here, all strides in elements:

* ``k`` / ``v``: token row ``t`` starts at ``t * stride_k`` / ``t * stride_v``; inside a row the
  ``num_kv_heads * head_dim`` values are contiguous.
* ``k_cache`` / ``v_cache``: one flat slot (``block_id * block_size + offset``) holds
  ``num_kv_heads * head_dim`` contiguous values, slot ``s`` starts at ``s * row_size``.
* ``slot_mapping``: int64 ``[T]``; a row whose slot is ``< 0`` (PAD_SLOT_ID = -1) or
  ``>= num_slots`` writes nothing.

Grid: ``(T, cdiv(row_size, BLOCK))``.
"""
import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k,
    stride_v,
    row_size,
    num_slots,
    BLOCK: tl.constexpr,
):
    """Copy token row ``program_id(0)`` of K and V into its cache slot (see the module doc)."""
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # Broadcast the slot to the block before comparing: the Triton 3.9 interpreter rejects a
    # scalar boolean combined with a block boolean as a load mask.
    slot = tl.load(slot_ptr + row).to(tl.int64) + tl.zeros([BLOCK], dtype=tl.int64)
    mask = (col < row_size) & (slot >= 0) & (slot < num_slots)
    src_row = row.to(tl.int64)
    k = tl.load(k_ptr + src_row * stride_k + col, mask=mask)
    v = tl.load(v_ptr + src_row * stride_v + col, mask=mask)
    dst = slot * row_size + col
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)
