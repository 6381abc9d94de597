"""The DP ranks' agreement in shared memory: an element-wise max of a few int64 per round.

:class:`SlotAgreement` is a :class:`~zos.serving.shm_ring.ShmSegment` (control block, bounded
waits, liveness checks) holding per rank two slots (round parity) of int64 words [round, v0,
v1, v2]; a rank writes its values, fences, writes the round number, then waits until every
rank has posted that round and takes the element-wise max. Two parities suffice: a rank posts
round i + 2 only after every rank posted i + 1, which each did after reading round i.
"""
from __future__ import annotations

import numpy as np

from zos.serving.shm_ring import LINE, ShmSegment, fence


class SlotAgreement(ShmSegment):
    """The DP agreement: :meth:`all_max` of a few int64 values over every rank of the host."""

    WORDS = 4  # round, three values

    @classmethod
    def size(cls, world_size: int) -> int:
        """Bytes of an agreement file."""
        return cls.data_offset(world_size) + world_size * 2 * LINE

    @classmethod
    def create(cls, world_size: int, **kw) -> SlotAgreement:
        """Rank 0: a new agreement file (see :class:`ShmSegment` for ``kw``)."""
        return cls(cls.new_path(), 0, world_size, cls.size(world_size), **kw)

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        base = self.data_offset(self.world_size)
        self.slots = self.buf[base:base + self.world_size * 2 * LINE].view(np.int64).reshape(
            self.world_size, 2, LINE // 8)
        self.round = 0
        self.others = [r for r in range(self.world_size) if r != self.rank]

    def all_max(self, values) -> np.ndarray:
        """Post ``values`` (up to 3 ints) for the next round and return the element-wise max
        over every rank's values of that round (int64[3]).

        Raises:
            PeerRankFailed: a rank failed or exited before posting, or ``timeout_s`` passed.
        """
        i = self.round = self.round + 1
        s = self.slots[:, i % 2]
        mine = s[self.rank]
        mine[1:4] = 0
        mine[1:1 + len(values)] = values
        fence()
        mine[0] = i
        if not (s[:, 0] == i).all():
            self.wait(lambda: bool((s[:, 0] == i).all()),
                      lambda: [r for r in self.others if s[r, 0] != i], f"reach agreement {i}")
        fence()
        return s[:, 1:4].max(axis=0)
