"""What differs between plain and speculative decode in the engine's one decode step.

``Engine.step`` is the same with and without draft tokens; its mode says how many token rows a
request runs per launch (``q``), which device tensor the read-back copies after each launch
(``output``, ``width`` int32 values per request row) and how the values read back become the
tokens each row keeps (``read``: numpy arrays, no loop over the rows). Everything else (blocks,
row layout, stop checks, certain finishes, dropped tokens) is the scheduler's and does not depend
on the mode (:mod:`zos.serving.scheduler`).
"""
from __future__ import annotations

import numpy as np
import torch

from zos.buffers import DecodeBuffers
from zos.serving.types import Request
from zos.spec import SpecDecoder


class PlainDecode:
    """One token row per request (q = 1): the launch samples one token per row into
    ``buffers.sampled`` (int32 [max_num_reqs], on the device) and every row keeps it.

    Attributes:
        rows_read, tokens_kept: request rows read back so far and tokens they kept (equal).
    """

    q, width = 1, 1

    def __init__(self, buffers: DecodeBuffers) -> None:
        self.output = buffers.sampled
        self.rows_read = self.tokens_kept = 0

    def read(self, values: np.ndarray, backend, steps_ago: int) -> tuple[np.ndarray, None]:
        """The tokens the rows kept, ``(kept, None)``: each row its sampled token (``values``:
        int32 [N], one per row; None: one token per row, ``Scheduler.accept_kept``)."""
        self.rows_read += len(values)
        self.tokens_kept += len(values)
        return values, None

    def write_prompt_history(self, req: Request) -> None:
        """Nothing: plain decode keeps no token history."""


class SpecDecode:
    """Greedy speculative decoding with ``k`` n-gram draft tokens (q = 1 + k token rows per
    request, drafted and verified inside the decode step, :mod:`zos.spec`): the launch writes
    ``spec.output`` (int32 [max_num_reqs, k + 2] on the device: per row the accepted count a in
    [1, q], then the a tokens kept: the accepted drafts and the verifier's own token).

    Attributes:
        rows_read: request rows read back so far.
        tokens_kept: tokens kept by the verifier over those rows (a row stopped in the middle
            of its tokens by eos or max_new_tokens counts all of them).
    """

    def __init__(self, spec: SpecDecoder, k: int) -> None:
        self.spec, self.q, self.width = spec, 1 + k, k + 2
        self.output = spec.output
        self.rows_read = self.tokens_kept = 0

    def read(self, values: np.ndarray, backend, steps_ago: int) -> tuple[np.ndarray, np.ndarray]:
        """The tokens the rows kept, ``(kept, counts)`` (``values``: int32 [N, k + 2], per row
        ``[a, token_0, ..]``): ``counts`` int32 [N] the accepted counts a, ``kept`` int32
        [sum(a)] row 0's a tokens, then row 1's, ... First hands the counts to ``backend``
        (``observe_accepted``; ``steps_ago``: launches staged after this one, 0 in the
        synchronous engine, 1 under overlap)."""
        accepted = np.ascontiguousarray(values[:, 0])
        backend.observe_accepted(accepted, steps_ago)
        self.rows_read += len(values)
        self.tokens_kept += int(accepted.sum())
        return values[:, 1:][np.arange(self.q) < accepted[:, None]], accepted

    def write_prompt_history(self, req: Request) -> None:
        """The drafter's history of a request admitted as prefilled: its prompt's tokens at
        their slots (the prefill writes them otherwise; ``req.blocks`` cover the prompt)."""
        bs, pos = self.spec.buffers.block_size, np.arange(len(req.prompt))
        slots = np.asarray(req.blocks, np.int64)[pos // bs] * bs + pos % bs
        device = self.output.device
        self.spec.write_history(torch.tensor(req.prompt, dtype=torch.int32, device=device),
                                torch.from_numpy(slots).to(device))
