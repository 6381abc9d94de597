"""The engine's data: requests, configuration, per-step records and run results."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zos._checks import check_int
from zos.buckets import POLICIES, BucketTable


@dataclass(eq=False, repr=False)
class Request:
    """One generation request; ``output`` collects the generated token ids (eos kept).

    Engine state (not constructor arguments): ``blocks`` (KV block ids held), ``num_computed``
    (tokens in the KV cache), ``finish_reason`` (None, "length" or "eos"), ``num_preemptions``,
    ``num_launches`` (decode launches that ran it, its prefill not counted). While the request
    holds a decode row, ``num_computed`` and ``num_launches`` live in the scheduler's per-row
    arrays (``row_state``, a :class:`~zos.serving.row_state.RowState`, at ``row_index``) and the
    properties read and write them there.
    """

    req_id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list, init=False)
    finish_reason: str | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    admit_seq: int = field(default=-1, init=False)  # admission order, for preemption
    _num_computed: int = field(default=0, init=False)
    _num_launches: int = field(default=0, init=False)
    _row_state: Any = field(default=None, init=False)
    _row_index: int = field(default=-1, init=False)

    @property
    def num_computed(self) -> int:
        """Tokens of this request whose KV is in the cache (as of the last launch read)."""
        s = self._row_state
        return self._num_computed if s is None else s.num_computed_at(self._row_index)

    @num_computed.setter
    def num_computed(self, value: int) -> None:
        if self._row_state is None:
            self._num_computed = value
        else:
            self._row_state.set_num_computed(self._row_index, value)

    @property
    def num_launches(self) -> int:
        """Decode launches that ran this request (its prefill not counted)."""
        s = self._row_state
        return self._num_launches if s is None else s.num_launches_at(self._row_index)

    @num_launches.setter
    def num_launches(self, value: int) -> None:
        if self._row_state is None:
            self._num_launches = value
        else:
            self._row_state.set_num_launches(self._row_index, value)

    @property
    def row_state(self):
        """The RowState holding this request's row values, None while it holds no row."""
        return self._row_state

    @property
    def row_index(self) -> int:
        """Its row in ``row_state`` (-1 when unbound)."""
        return self._row_index

    def bind_row(self, state, row: int) -> None:
        """Bind to ``row`` of ``state`` (None, -1: unbind); the caller moves the values."""
        self._row_state, self._row_index = state, row

    def __repr__(self) -> str:
        return (f"Request(req_id={self.req_id!r}, prompt={self.prompt!r}, "
                f"max_new_tokens={self.max_new_tokens!r}, arrival={self.arrival!r}, "
                f"output={self.output!r}, finish_reason={self.finish_reason!r}, "
                f"num_preemptions={self.num_preemptions!r}, num_launches={self.num_launches!r})")


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
    taken as given) overrides it. ``graph_capture``: "eager" (every bucket's graph captured at
    start-up) or "lazy" (each captured right after the first step of its size, which runs
    eagerly); ``graph_memory_budget``: lazy only, bytes the graph cache may hold (its pool plus
    each graph's own memory; least recently used graphs evicted), None for no bound
    (``zos.serving.runner.GraphRunner``, ``zos.graphs.GraphCache``). ``num_draft_tokens``: K > 0
    runs speculative decoding with the n-gram drafter (``zos.spec``), q = 1 + K token rows per
    request; the policy's table is then built for q (every size a multiple of q,
    ``make_buckets``)."""

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
    graph_capture: str = "eager"
    graph_memory_budget: int | None = None
    num_draft_tokens: int = 0


@dataclass(frozen=True)
class StepRecord:
    """One model run of engine step ``step``: ``kind`` "prefill"/"decode", ``path``
    "graph"/"eager", ``num_reqs``, ``padded_size`` (token rows run; prefill: packed tokens),
    ``metadata_us`` (host us of metadata work), ``upload_bytes`` (H2D metadata bytes),
    ``preemptions`` (engine total so far), ``seconds`` (host wall time of the run; a lazy
    capture after the step included), ``eager_reason`` (decode on the eager path: why it had no
    graph, ``DecodeResult.eager_reason``; None otherwise)."""

    step: int
    kind: str
    path: str
    num_reqs: int
    padded_size: int
    metadata_us: float
    upload_bytes: int
    preemptions: int
    seconds: float
    eager_reason: str | None = None


@dataclass
class RunResult:
    """``outputs`` {req_id: tokens}, ``steps`` (StepRecords), ``totals`` (see Engine.run)."""

    outputs: dict[int, list[int]]
    steps: list[StepRecord]
    totals: dict[str, float]


def make_buckets(cfg: EngineConfig,
                 num_draft_tokens: int | None = None) -> BucketTable | None:
    """The decode bucket table of ``cfg`` (token rows, q = 1 + k per request, k =
    ``num_draft_tokens``, by default ``cfg.num_draft_tokens``), or None for no graphs.

    ``cfg.buckets`` is taken as given (a BucketTable, or sizes made into one with
    ``uniform_decode_query_len`` q). Otherwise ``cfg.bucket_policy`` names a
    ``zos.buckets.POLICIES`` entry, built with k draft tokens and its largest size
    (``Policy.max_keyword``) for ``cfg.max_num_seqs`` requests: max_num_seqs where the keyword
    counts requests (max_num_seqs, max_bs, max_batch_size), ``max_num_seqs * q`` where it counts
    token rows (vLLM's max_capture_size); then ``BucketTable.with_max(max_num_seqs * q)``: a full
    batch has a graph under every policy, for every max_num_seqs and k (vLLM itself caps at its
    grid: 12 gives 1, 2, 4, 8 there, 1, 2, 4, 8, 12 here). Every policy's table is uniform
    decode (sizes multiples of q; ``zos.buckets``). ValueError for an unknown policy name;
    TypeError/ValueError for a num_draft_tokens that is not an int >= 0."""
    if num_draft_tokens is None:
        num_draft_tokens = cfg.num_draft_tokens
    num_draft_tokens = check_int("num_draft_tokens", num_draft_tokens, 0)
    q = 1 + num_draft_tokens
    if cfg.buckets is not None or cfg.bucket_policy is None:
        b = cfg.buckets
        return b if b is None or isinstance(b, BucketTable) else BucketTable(
            b, uniform_decode_query_len=q)
    policy = POLICIES.get(cfg.bucket_policy) if isinstance(cfg.bucket_policy, str) else None
    if policy is None:
        raise ValueError(f"bucket_policy: unknown {cfg.bucket_policy!r}; expected one of "
                         f"{list(POLICIES)} or None")
    top = cfg.max_num_seqs * q
    value = cfg.max_num_seqs if policy.max_unit == "requests" else top
    return policy.build(value, num_draft_tokens=num_draft_tokens).with_max(top)
