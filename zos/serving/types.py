"""The engine's data: requests, configuration, per-step records and run results."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from zos.buckets import BucketTable, from_policy


@dataclass(eq=False)
class Request:
    """One generation request; ``output`` collects the generated token ids (eos kept).

    Engine state (not constructor arguments): ``blocks`` (KV block ids held), ``num_computed``
    (tokens in the KV cache), ``finish_reason`` (None, "length" or "eos"), ``num_preemptions``.
    """

    req_id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list, init=False, repr=False)
    num_computed: int = field(default=0, init=False, repr=False)
    finish_reason: str | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    admit_seq: int = field(default=-1, init=False, repr=False)  # admission order, for preemption


@dataclass
class EngineConfig:
    """Engine sizes and switches. ``num_kv_blocks`` counts the null block 0 and must hold one
    request of ``max_model_len`` (prompt + max_new_tokens limit). ``max_num_seqs``: request rows.
    ``max_prefill_tokens``: tokens per prefill (a longer first request still runs, alone).
    ``eos_token_id``: stop token, kept in the output. ``backend``: "zos" (DeviceMetadataBackend)
    or "host" (HostMetadataBackend). ``use_cuda_graph``: capture decode graphs (CUDA only).
    ``bucket_policy``: "vllm", "deepinfer", "sglang", "trtllm" (max size max_num_seqs) or None;
    ``buckets`` (sizes or a BucketTable, token rows) overrides it."""

    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_model_len: int = 2048
    max_prefill_tokens: int = 4096
    eos_token_id: int | None = None
    backend: str = "zos"
    use_cuda_graph: bool = True
    bucket_policy: str | None = "vllm"
    buckets: BucketTable | Sequence[int] | None = None


@dataclass(frozen=True)
class StepRecord:
    """One model run of engine step ``step``: ``kind`` "prefill"/"decode", ``path``
    "graph"/"eager", ``num_reqs``, ``padded_size`` (token rows run; prefill: packed tokens),
    ``metadata_us`` (host us of metadata work), ``upload_bytes`` (H2D metadata bytes),
    ``preemptions`` (engine total so far), ``seconds`` (host wall time of the run)."""

    step: int
    kind: str
    path: str
    num_reqs: int
    padded_size: int
    metadata_us: float
    upload_bytes: int
    preemptions: int
    seconds: float


@dataclass
class RunResult:
    """``outputs`` {req_id: tokens}, ``steps`` (StepRecords), ``totals`` (see Engine.run)."""

    outputs: dict[int, list[int]]
    steps: list[StepRecord]
    totals: dict[str, float]


_MAX_ARG = {"vllm": "max_capture_size", "deepinfer": "max_num_seqs", "sglang": "max_bs",
            "trtllm": "max_batch_size"}


def make_buckets(cfg: EngineConfig) -> BucketTable | None:
    """The bucket table of ``cfg`` (token rows, largest max_num_seqs), or None. ValueError for
    an unknown policy."""
    if cfg.buckets is not None or cfg.bucket_policy is None:
        b = cfg.buckets
        return b if b is None or isinstance(b, BucketTable) else BucketTable(b)
    if cfg.bucket_policy not in _MAX_ARG:
        raise ValueError(f"bucket_policy: unknown {cfg.bucket_policy!r}; expected one of "
                         f"{sorted(_MAX_ARG)} or None")
    return from_policy(cfg.bucket_policy, **{_MAX_ARG[cfg.bucket_policy]: cfg.max_num_seqs})
