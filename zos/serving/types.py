"""The engine's data: requests, configuration, per-step records and run results."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from zos.buckets import POLICIES, BucketTable


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
    ``bucket_policy``: a name in ``zos.buckets.POLICIES`` ("vllm", "deepinfer", "sglang",
    "trtllm"), built for max_num_seqs requests with max_num_seqs itself a bucket (see
    ``make_buckets``), or None (no graphs); ``buckets`` (sizes or a BucketTable, token rows,
    taken as given) overrides it. ``num_draft_tokens``: K > 0 runs speculative decoding with
    the n-gram drafter (``zos.spec``), q = 1 + K token rows per request; the bucket table is then
    the policy's request counts times q (every size a multiple of q)."""

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
    num_draft_tokens: int = 0


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


def make_buckets(cfg: EngineConfig) -> BucketTable | None:
    """The decode bucket table of ``cfg`` (token rows, q = 1 + num_draft_tokens per request), or
    None for no graphs.

    ``cfg.buckets`` (sizes or a BucketTable) is taken as given. Otherwise ``cfg.bucket_policy``
    names a ``zos.buckets.POLICIES`` entry, built with its largest size (``Policy.max_keyword``:
    max_capture_size, max_num_seqs, max_bs or max_batch_size; at q = 1 all count max_num_seqs)
    set to ``cfg.max_num_seqs``, then ``BucketTable.with_max(max_num_seqs)``: a full batch has a
    graph under every policy and for every max_num_seqs (vLLM itself caps at its grid: 12 gives
    1, 2, 4, 8 there, 1, 2, 4, 8, 12 here). ValueError for an unknown policy name."""
    q = 1 + cfg.num_draft_tokens
    if cfg.buckets is not None or cfg.bucket_policy is None:
        b = cfg.buckets
        return (b if b is None or isinstance(b, BucketTable)
                else BucketTable(b, uniform_decode_query_len=q))
    policy = POLICIES.get(cfg.bucket_policy) if isinstance(cfg.bucket_policy, str) else None
    if policy is None:
        raise ValueError(f"bucket_policy: unknown {cfg.bucket_policy!r}; expected one of "
                         f"{list(POLICIES)} or None")
    table = policy.build(cfg.max_num_seqs).with_max(cfg.max_num_seqs)
    if q == 1:
        return table
    # Draft tokens: the same request counts, each a bucket of q token rows per request (every
    # size a multiple of q, TensorRT-LLM's (batch, draft_len) keys at one draft length).
    return BucketTable([q * s for s in table.sizes], uniform_decode_query_len=q,
                       name=f"{table.name} x q={q}")
