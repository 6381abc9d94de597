"""KV-cache block allocator: a free list of block ids, block 0 reserved as the null block."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from zos._checks import check_int
from zos.buffers import NULL_BLOCK


class BlockAllocator:
    """Hands out KV blocks ``1 .. num_kv_blocks - 1``; block 0 (NULL_BLOCK) is never handed out.

    Dummy rows of a padded step point at block 0 (docs/ZOS.md, padding ledger rule 4), so
    no request may own it. Freed blocks go to the back of the free list (FIFO), so a
    block just given back is reused last: a stale read of it shows up in tests
    instead of being masked by the same id coming right back.

    Args:
        num_kv_blocks: blocks in the KV cache, including the null block (>= 2).

    Raises:
        TypeError: num_kv_blocks not an int.
        ValueError: num_kv_blocks < 2.
    """

    def __init__(self, num_kv_blocks: int) -> None:
        num_kv_blocks = check_int("num_kv_blocks", num_kv_blocks, 2)  # block 0 is reserved
        self.num_kv_blocks = num_kv_blocks
        self._free: deque[int] = deque(range(1, num_kv_blocks))
        self._used = bytearray(num_kv_blocks)  # 1 where the block is handed out

    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can still hand out."""
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks (ids in [1, num_kv_blocks)); None, and nothing taken, if fewer
        are free.

        Raises:
            ValueError: n is negative.
        """
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._used[b] = 1
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Give blocks back. All are checked before any is freed.

        Raises:
            ValueError: a block is 0 (the null block), out of range, not handed out
                (double free), or listed twice.
        """
        blocks = list(blocks)
        seen: set[int] = set()
        for b in blocks:
            if b == NULL_BLOCK:
                raise ValueError("free: block 0 is the reserved null block, never handed out")
            if not 0 < b < self.num_kv_blocks:
                raise ValueError(f"free: block {b} is outside [1, {self.num_kv_blocks})")
            if not self._used[b] or b in seen:
                raise ValueError(f"free: block {b} is not allocated (double free)")
            seen.add(b)
        for b in blocks:
            self._used[b] = 0
            self._free.append(b)
