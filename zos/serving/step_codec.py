"""The runner calls rank 0 sends its TP followers, as flat integer arrays (no pickling).

A message is ``(kind, args, arrays)``: a kind, up to five ints and contiguous numpy arrays
written back to back (what :meth:`~zos.serving.shm_ring.StepRing.publish` takes); decoding
reads the same arrays back out of the payload bytes. Kinds:

* :data:`DECODE`: args (min_padded_size, N, M, L, A); arrays: the eight fields of the
  :class:`~zos.step.DecodeStep` (``req_ids`` int64 [N] first, then int32 ``new_rows``,
  ``new_tokens``, ``new_positions`` [M], ``new_block_indptr`` [M + 1], ``new_block_ids`` [L],
  ``append_rows``, ``append_block_ids`` [A]).
* :data:`PREFILL`: args (S sequences, T tokens, B blocks); arrays int32: tokens per sequence
  [S], blocks per sequence [S], every token [T], every block id [B].
* :data:`ACCEPTED`: args (steps_ago, P); arrays: the accepted counts, int32 [P]
  (``MetadataBackend.observe_accepted``; speculative decoding).
* :data:`STOP`: no more calls. :data:`OVERFLOW`: too big for a slot; the call itself follows
  on the torch.distributed group (``broadcast_object_list``).
"""
from __future__ import annotations

import numpy as np

from zos.step import DecodeStep

DECODE, PREFILL, ACCEPTED, STOP, OVERFLOW = 1, 2, 3, 4, 5
_I32 = np.int32
_DECODE_I32 = ("new_rows", "new_tokens", "new_positions", "new_block_indptr", "new_block_ids",
               "append_rows", "append_block_ids")


def encode_decode(step: DecodeStep, min_padded_size: int) -> tuple[int, tuple, list]:
    """A :data:`DECODE` message of ``step`` (its arrays as they are: no copy)."""
    m = len(step.new_rows)
    args = (min_padded_size, step.num_reqs, m, len(step.new_block_ids), len(step.append_rows))
    return DECODE, args, [step.req_ids] + [getattr(step, f) for f in _DECODE_I32]


def encode_prefill(seqs) -> tuple[int, tuple, list]:
    """A :data:`PREFILL` message of ``seqs`` (``(tokens, block_ids)`` per sequence).

    Raises:
        TypeError, ValueError: a token or block id that is not an int32 (as DecodeStep does).
    """
    toks = [np.asarray(t, _I32) for t, _ in seqs]
    blks = [np.asarray(b, _I32) for _, b in seqs]
    tl = np.array([len(t) for t in toks], _I32)
    bl = np.array([len(b) for b in blks], _I32)
    flat_t = np.concatenate(toks) if toks else np.zeros(0, _I32)
    flat_b = np.concatenate(blks) if blks else np.zeros(0, _I32)
    return PREFILL, (len(seqs), len(flat_t), len(flat_b)), [tl, bl, flat_t, flat_b]


def encode_accepted(accepted, steps_ago: int) -> tuple[int, tuple, list]:
    """An :data:`ACCEPTED` message: the counts (int32 [P]) and ``steps_ago``."""
    acc = np.ascontiguousarray(accepted, _I32)
    return ACCEPTED, (steps_ago, len(acc)), [acc]


def _split(payload: np.ndarray, parts) -> list[np.ndarray]:
    """Views of ``payload`` (uint8) as consecutive arrays of ``(dtype, count)``."""
    out, off = [], 0
    for dtype, n in parts:
        nb = np.dtype(dtype).itemsize * n
        out.append(payload[off:off + nb].view(dtype))
        off += nb
    return out


def decode_message(kind: int, args, payload: np.ndarray) -> tuple:
    """The call a message encodes: ``("decode", DecodeStep, min_padded_size)``,
    ``("prefill", [(tokens, blocks), ...])`` (lists of ints), ``("accepted", counts int32
    [P], steps_ago)`` or ``("stop",)``. ``payload`` must be the message's own copy: the
    DecodeStep's arrays are views of it.

    Raises:
        ValueError: an unknown kind (a corrupt or foreign message).
    """
    if kind == DECODE:
        mp, n, m, nb, na = (int(x) for x in args[:5])
        i32 = payload[8 * n:].view(_I32)
        o = [0, m, 2 * m, 3 * m, 4 * m + 1]
        o += [o[-1] + nb, o[-1] + nb + na, o[-1] + nb + 2 * na]
        return "decode", DecodeStep(payload[:8 * n].view(np.int64),
                                    *(i32[o[j]:o[j + 1]] for j in range(7))), mp
    if kind == PREFILL:
        s, t, b = (int(x) for x in args[:3])
        tl, bl, flat_t, flat_b = _split(payload, [(_I32, s), (_I32, s), (_I32, t), (_I32, b)])
        te, be = np.cumsum(tl), np.cumsum(bl)
        return "prefill", [(flat_t[te[i] - tl[i]:te[i]].tolist(),
                            flat_b[be[i] - bl[i]:be[i]].tolist()) for i in range(s)]
    if kind == ACCEPTED:
        steps_ago, p = int(args[0]), int(args[1])
        return "accepted", _split(payload, [(_I32, p)])[0], steps_ago
    if kind == STOP:
        return ("stop",)
    raise ValueError(f"step ring: unknown message kind {kind}")
