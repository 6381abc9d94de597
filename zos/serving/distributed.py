"""Several processes, zos metadata on each: tensor parallelism (TP) and data parallelism (DP).

The pieces, each in its own module, gathered here:

* :mod:`zos.serving.dist_context`: ``init_distributed`` (NCCL on CUDA, one GPU per rank; gloo
  on a CPU; a gloo group on the host for small host-side collectives), ``shutdown_distributed``,
  ``metadata_checksum``.
* :mod:`zos.serving.dist_tp`: TP. Rank 0 schedules; its :class:`TPLeader` publishes every
  runner call (and, with draft tokens, every step's accepted counts) to the followers, which
  replay them (:func:`tp_follow`, :func:`tp_generate`).
* :mod:`zos.serving.dist_dp`: DP. Each rank its own engine; one padded-size agreement per
  engine step (:class:`DPRunner`, :func:`dp_generate`), dummy steps on idle ranks.
* :mod:`zos.serving.dist_transport`: how the calls and the agreement travel. On one host, a
  shared-memory ring of flat int arrays (TP) and per-rank slots (DP) in a file under /dev/shm
  (:mod:`zos.serving.shm_ring`, :mod:`zos.serving.step_codec`): no pickling and no collective
  per step. Across hosts, the gloo host group: ``broadcast_object_list`` (TP) and
  ``all_reduce(MAX)`` (DP). ``transport="auto"`` picks by host; "shm" / "collective" force one.
* :class:`PeerRankFailed`: raised on a rank that learns that another rank failed, exited or
  (shared memory) went silent past the timeout, naming that rank, instead of a hang.

``check_metadata`` (tests) compares a checksum of every rank's metadata buffers after each TP
decode step (one ``all_gather_object``; it syncs the device).
"""
from __future__ import annotations

from zos.serving.dist_context import (
    CHECKSUM_FIELDS,
    DistContext,
    init_distributed,
    metadata_checksum,
    shutdown_distributed,
)
from zos.serving.dist_dp import DPRunner, DPStats, dp_generate
from zos.serving.dist_tp import AcceptedForwarder, TPLeader, tp_follow, tp_generate
from zos.serving.dist_transport import TRANSPORTS, Agreement, StepChannel
from zos.serving.shm_ring import PeerRankFailed

__all__ = ["CHECKSUM_FIELDS", "TRANSPORTS", "AcceptedForwarder", "Agreement", "DPRunner",
           "DPStats", "DistContext", "PeerRankFailed", "StepChannel", "TPLeader",
           "dp_generate", "init_distributed", "metadata_checksum", "shutdown_distributed",
           "tp_follow", "tp_generate"]
