"""A small continuous-batching engine: eager packed prefill, decode through GraphRunner.

It stands in for "an existing decode runner": the metadata backend ("zos" or "host") is the
only thing that differs between two runs with the same config. Scheduling is deterministic
(arrival times only order the queue), so both backends see the same steps; with
``overlap=True`` the host stages step t+1 while the GPU runs step t (decode only: a step that
admits requests runs their prefill eagerly and waits for it).
"""
from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable

import numpy as np
import torch

from zos._checks import check_int
from zos.buffers import DecodeBuffers
from zos.device_backend import DeviceMetadataBackend
from zos.host_backend import HostMetadataBackend
from zos.serving.kv_blocks import BlockAllocator
from zos.serving.models import allocate_kv_cache
from zos.serving.readback import SampledReadback
from zos.serving.row_layout import place_rows
from zos.serving.runner import GraphRunner, check_graph_options
from zos.serving.spec_engine import SpecDecodeMixin
from zos.serving.types import (
    EngineConfig,
    Request,
    RunResult,
    StepRecord,
    make_buckets,
)
from zos.spec import SpecDecoder
from zos.step import DecodeStep


class Engine(SpecDecodeMixin):
    """Continuous batching over ``model`` (a zos LlamaForCausalLM) on ``device``: builds the
    KV caches, DecodeBuffers (max_num_seqs rows), the metadata backend and a GraphRunner, and
    captures decode graphs on CUDA with ``use_cuda_graph``. Rows stay where they are between
    decode steps (``row_layout.place_rows``); a carried row that cannot get a block preempts,
    by recompute, the most recently admitted running request.

    ``overlap``: the host schedules and stages step t+1 while the GPU runs step t (SGLang's
    overlap scheduler, vLLM's async scheduling): sampled tokens come back through a
    non-blocking copy (:class:`SampledReadback`) read one step late, so a request that emits
    eos at step t is seen at t+1 and the token its row produced in t+1 is dropped. KV safety
    under preemption comes from stream order: a freed block's next owner is written by work
    enqueued after the step that last wrote it. Tokens are identical with and without overlap.

    Speculative decoding (``config.num_draft_tokens`` K > 0): every decode step runs q = 1 + K
    token rows per request (n-gram drafts, greedy verification, all in the decode graph, see
    :mod:`zos.spec`); blocks are allocated for the worst case (every draft accepted: positions
    up to num_computed + K); after the step the engine reads each row's accepted tokens, appends
    them one by one with the stop checks (a row that reaches eos or max_new_tokens in the middle
    of its tokens stops there, the rest are dropped) and hands the counts to the backend
    (``observe_accepted``). The block-table width covers max_model_len + K positions. With
    ``overlap`` the host stages step t+1 before step t's counts arrive (zos's prep reads them on
    the device): blocks then cover the bound num_computed + 2q of a row still in flight, the
    width max_model_len + 2K, and the counts go to the backend one step late (steps_ago = 1).

    Raises ValueError: unknown backend/policy, num_kv_blocks too small for one request of
    max_model_len, max_model_len (+ K, + 2K with overlap) above the model's
    max_position_embeddings (RoPE table), or num_draft_tokens < 0 (TypeError if it is not an
    int).
    """

    def __init__(self, model, config: EngineConfig, device: torch.device | str = "cpu", *,
                 overlap: bool = False) -> None:
        c, cfg, bs = model.config, config, config.block_size
        self.model, self.config, self.device = model, config, torch.device(device)
        k = check_int("num_draft_tokens", cfg.num_draft_tokens, 0)
        # Draft rows write up to K positions past the last token a request can hold (2K when
        # a step is staged before the previous step's accepted counts are known).
        reach = k * (2 if overlap else 1)
        width = -(-(cfg.max_model_len + reach) // bs)
        if cfg.num_kv_blocks - 1 < width:
            raise ValueError(f"num_kv_blocks {cfg.num_kv_blocks} cannot hold one request of "
                             f"max_model_len {cfg.max_model_len} ({width} blocks + null block)")
        if cfg.max_model_len + reach > c.max_position_embeddings:
            raise ValueError(f"max_model_len {cfg.max_model_len} (+ {reach} draft positions) "
                             f"exceeds the model's max_position_embeddings "
                             f"{c.max_position_embeddings}")
        if cfg.backend not in ("zos", "host"):
            raise ValueError(f"backend: expected 'zos' or 'host', got {cfg.backend!r}")
        check_graph_options(cfg.graph_capture, cfg.graph_memory_budget)
        buckets = make_buckets(cfg)  # before any allocation: it refuses unknown policies
        self.kv_caches = allocate_kv_cache(c.num_hidden_layers, cfg.num_kv_blocks, bs,
                                           c.num_key_value_heads, c.head_dim,
                                           model.embed_tokens.dtype, self.device)
        self.buffers = DecodeBuffers(cfg.max_num_seqs, width, bs, device=self.device,
                                     pad_token_id=0, seq_len_fill=1,
                                     uniform_decode_query_len=1 + k)
        kw = dict(num_kv_blocks=cfg.num_kv_blocks, vocab_size=c.vocab_size, buckets=buckets)
        # Under overlap the host-built baseline gathers input ids on the device (vLLM V1's
        # async scheduling) instead of reading the last tokens back, which would wait.
        self.backend = (DeviceMetadataBackend(self.buffers, capture_prep=False, **kw)
                        if cfg.backend == "zos" else
                        HostMetadataBackend(self.buffers, input_ids_from_device=overlap, **kw))
        self.spec = (SpecDecoder(self.buffers, num_kv_blocks=cfg.num_kv_blocks,
                                 num_draft_tokens=k) if k else None)
        self.runner = GraphRunner(model, self.kv_caches, self.backend,
                                  use_cuda_graph=cfg.use_cuda_graph,
                                  graph_capture=cfg.graph_capture,
                                  graph_memory_budget=cfg.graph_memory_budget,
                                  spec=self.spec)
        self.runner.capture()
        self.allocator = BlockAllocator(cfg.num_kv_blocks)
        self.waiting: deque[Request] = deque()
        self.rows: list[Request | None] = []  # row layout of the last decode step; None = hole
        self.records: list[StepRecord] = []
        self.num_preemptions, self.num_steps, self._admitted = 0, 0, 0
        self.overlap = overlap
        self.readback = SampledReadback(cfg.max_num_seqs, self.device,
                                        width=k + 2 if k else 1)
        # Speculative decoding: decode rows run, tokens kept (1 + accepted drafts per row).
        self.spec_rows, self.spec_tokens = 0, 0
        self._prefilled: list[Request] = []  # admitted with their KV in place: next decode
        self._live: set[int] = set()  # req_ids waiting or running (not finished)
        # Per-row state kept incrementally, so that a step with no change costs little Python
        # per row (see _decode): the row of each running request, its req_id in an int64
        # cache, wake-ups by launch number (decode steps launched so far), the requests the
        # next _retire removes, and per pending readback the requests whose token it drops.
        self._row_of: dict[Request, int] = {}
        self._ids = np.zeros(cfg.max_num_seqs, np.int64)
        self._launches = 0
        self._wake: defaultdict[int, list[Request]] = defaultdict(list)
        self._ending: set[Request] = set()
        # Per launch in flight (= readback.pending): the requests whose token is dropped, and
        # the plain engine's due rows or the spec engine's launch number.
        self._pending: deque[tuple[set[Request], list[int] | int]] = deque()

    def add_request(self, req: Request) -> None:
        """Queue ``req`` (behind earlier ones); see :meth:`add_requests`."""
        self.add_requests([req])

    def add_requests(self, reqs: Iterable[Request]) -> None:
        """Queue ``reqs`` in order, all or none: every request is checked before any is queued.

        Raises:
            ValueError: an empty prompt, a token outside the vocabulary, max_new_tokens < 1,
                prompt + max_new_tokens > max_model_len, or a req_id that is already waiting or
                running (or twice in ``reqs``): the packer keys rows by request id.
        """
        reqs, ids = list(reqs), set()
        for req in reqs:
            self._check(req)
            if req.req_id in ids:
                raise ValueError(f"request {req.req_id}: req_id given twice")
            ids.add(req.req_id)
        self.waiting.extend(reqs)
        self._live |= ids

    def _check(self, req: Request) -> None:
        cfg, vocab = self.config, self.model.config.vocab_size
        if not req.prompt or any(not 0 <= t < vocab for t in req.prompt):
            raise ValueError(f"request {req.req_id}: prompt must be non-empty ids in [0, {vocab})")
        if req.max_new_tokens < 1 or len(req.prompt) + req.max_new_tokens > cfg.max_model_len:
            raise ValueError(f"request {req.req_id}: need max_new_tokens >= 1 and prompt + "
                             f"max_new_tokens <= max_model_len {cfg.max_model_len}")
        if req.req_id in self._live:
            raise ValueError(f"request {req.req_id}: req_id is already waiting or running")

    def admit_prefilled(self, req: Request, first_token: int) -> None:
        """Admit ``req`` as if its prompt had been prefilled elsewhere (a disaggregated prefill,
        or a benchmark of steady-state decode): its blocks are allocated now, the KV of its
        prompt is taken to be in the cache already (whatever those blocks hold), and
        ``first_token`` is its first output; it joins the next decode step as a new row.

        Raises:
            ValueError: the request is invalid (see :meth:`add_request`), the token is outside
                the vocabulary, no row is free, or too few blocks are free.
        """
        self._check(req)
        if len(self._row_of) + len(self._prefilled) >= self.config.max_num_seqs:
            raise ValueError(f"request {req.req_id}: no free row (max_num_seqs "
                             f"{self.config.max_num_seqs})")
        if not 0 <= first_token < self.model.config.vocab_size:
            raise ValueError(f"request {req.req_id}: first_token {first_token} is outside the "
                             f"vocabulary")
        blocks = self.allocator.allocate(-(-(len(req.prompt) + 1) // self.config.block_size))
        if blocks is None:
            raise ValueError(f"request {req.req_id}: not enough free KV blocks")
        req.blocks, req.num_computed = blocks, len(req.prompt)
        if self.spec is not None:  # the drafter's history: the prompt at its slots
            bs, pos = self.config.block_size, np.arange(len(req.prompt))
            slots = np.asarray(blocks, np.int64)[pos // bs] * bs + pos % bs
            self.spec.write_history(torch.tensor(req.prompt, dtype=torch.int32,
                                                 device=self.device),
                                    torch.from_numpy(slots).to(self.device))
        req.admit_seq, self._admitted = self._admitted, self._admitted + 1
        self._live.add(req.req_id)
        self._append(req, first_token)
        if req.finish_reason is None:
            self._prefilled.append(req)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs, or a decode step's tokens are still on their way."""
        return (bool(self.waiting) or bool(self._row_of) or bool(self.readback.pending)
                or bool(self._prefilled))

    def step(self, progress: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
        """One engine step: admit + one eager prefill, then one decode of every running row."""
        out, self.num_steps = [], self.num_steps + 1
        self._retire()
        fresh = self._admit()
        if fresh:
            out.append(self._prefill(fresh))
            fresh = [r for r in fresh if r.finish_reason is None]
        fresh, self._prefilled = fresh + self._prefilled, []
        decode = self._decode_spec if self.spec is not None else self._decode
        rec = decode(fresh) if fresh or self._row_of else None
        out += [rec] if rec is not None else []
        # Tokens of earlier steps: all of them in sync mode; all but the step just launched
        # under overlap (read while the GPU runs it), or all when nothing was launched.
        keep = 1 if self.overlap and rec is not None else 0
        while len(self.readback.pending) > keep:
            self._drain_spec() if self.spec is not None else self._drain()
        for rec in out:
            self.records.append(rec)
            if progress is not None:
                progress(rec)
        return out

    def run(self, requests: Iterable[Request],
            progress: Callable[[StepRecord], None] | None = None) -> RunResult:
        """Queue ``requests`` (by arrival, ties in given order) and step until all finish.

        Totals: requests, steps, prefill_steps, decode_steps, graph_decode_steps,
        eager_decode_steps, tokens (generated), wall_s, tokens_per_s, graphs_captured (lazy:
        re-captures included), graph_evictions, preemptions, capture_s (so far), metadata_us
        (sum over decode steps), upload_bytes (decode); with draft tokens also num_draft_tokens,
        spec_rows (request rows decoded), spec_tokens (tokens kept by the verifier, including
        those dropped at a stop), mean_tokens_per_row and acceptance_rate
        ((spec_tokens - spec_rows) / (k * spec_rows)).
        """
        reqs = sorted(requests, key=lambda r: r.arrival)
        self.add_requests(reqs)
        first, pre0, t0 = len(self.records), self.num_preemptions, time.perf_counter()
        rows0, kept0 = self.spec_rows, self.spec_tokens
        while self.has_unfinished():
            self.step(progress)
        wall, steps = time.perf_counter() - t0, self.records[first:]
        dec, tokens = [s for s in steps if s.kind == "decode"], sum(len(r.output) for r in reqs)
        totals = dict(requests=len(reqs), steps=len(steps), prefill_steps=len(steps) - len(dec),
                      decode_steps=len(dec), graph_decode_steps=sum(s.path == "graph" for s in dec),
                      eager_decode_steps=sum(s.path == "eager" for s in dec), tokens=tokens,
                      wall_s=wall, tokens_per_s=tokens / wall if wall > 0 else 0.0,
                      graphs_captured=self.graphs_captured,
                      graph_evictions=(self.runner.cache.evictions if self.runner.cache is not None
                                       else 0),
                      preemptions=self.num_preemptions - pre0,
                      capture_s=self.runner.capture_seconds,
                      metadata_us=sum(s.metadata_us for s in dec),
                      upload_bytes=sum(s.upload_bytes for s in dec))
        if self.spec is not None:
            k, rows, kept = (self.config.num_draft_tokens, self.spec_rows - rows0,
                             self.spec_tokens - kept0)
            totals.update(num_draft_tokens=k, spec_rows=rows, spec_tokens=kept,
                          mean_tokens_per_row=kept / max(rows, 1),
                          acceptance_rate=(kept - rows) / max(k * rows, 1))
        return RunResult({r.req_id: list(r.output) for r in reqs}, steps, totals)

    # ---- internals -------------------------------------------------------------------------

    @property
    def graphs_captured(self) -> int:
        """Decode graphs captured so far (eager capture: one per bucket at construction)."""
        return self.runner.num_captures

    def _record(self, kind, path, n, padded, us, nbytes, t0, eager_reason=None) -> StepRecord:
        return StepRecord(self.num_steps, kind, path, n, padded, us, nbytes, self.num_preemptions,
                          time.perf_counter() - t0, eager_reason)

    def _admit(self) -> list[Request]:
        """Waiting requests in order while a row, blocks for prompt + 1 and budget allow."""
        cfg, out, used = self.config, [], 0
        running = len(self._row_of) + len(self._prefilled)
        while self.waiting and running + len(out) < cfg.max_num_seqs:
            req = self.waiting[0]
            n = len(req.prompt) + len(req.output)  # a resumed request recomputes its output
            if out and used + n > cfg.max_prefill_tokens:
                break
            blocks = self.allocator.allocate(-(-(n + 1) // cfg.block_size))
            if blocks is None:
                break
            self.waiting.popleft()
            req.blocks, req.admit_seq, self._admitted = blocks, self._admitted, self._admitted + 1
            out.append(req)
            used += n
        return out

    def _prefill(self, reqs: list[Request]) -> StepRecord:
        """Prefill prompt + output (output non-empty when resumed); sample each next token."""
        t0, seqs = time.perf_counter(), [(r.prompt + r.output, r.blocks) for r in reqs]
        tokens, us, nbytes = self.runner.prefill(seqs)
        for r, (toks, _), t in zip(reqs, seqs, tokens):
            r.num_computed = len(toks)
            self._append(r, t)
        return self._record("prefill", "eager", len(reqs), sum(len(s) for s, _ in seqs), us,
                            nbytes, t0)

    def _append(self, req: Request, token: int) -> bool:
        """Append a sampled token; finish (free blocks) on eos or length. True if finished."""
        req.output.append(token)
        return self._finish_if_done(req, token)

    def _finish_if_done(self, req: Request, token: int) -> bool:
        """Finish ``req`` if ``token`` (its last output) is eos or its output is complete: free
        its blocks; its row goes at the next _retire and its tokens still on their way are
        dropped. True if finished."""
        eos = self.config.eos_token_id
        if token == eos or len(req.output) >= req.max_new_tokens:
            req.finish_reason = "eos" if token == eos else "length"
            self.allocator.free(req.blocks)
            req.blocks = []
            self._live.discard(req.req_id)
            self._ending.add(req)
            for drop, _ in self._pending:
                drop.add(req)
        return req.finish_reason is not None

    def _preempt_newest(self, rows: list, row_of: dict, fresh: list, appended: dict) -> None:
        """Preempt the most recently admitted request among the running ``rows`` and ``fresh``
        (vLLM's recompute preemption), taking it out of the step being built: its row becomes a
        hole (or it leaves ``fresh``) and its pending appended blocks are forgotten."""
        alive = [r for r in rows if r is not None] + fresh
        victim = max(alive, key=lambda r: r.admit_seq)
        appended.pop(victim, None)
        self._preempt(victim)
        if victim in fresh:
            fresh.remove(victim)
        else:
            rows[row_of.pop(victim)] = None

    def _preempt(self, req: Request) -> None:
        """Recompute preemption (vLLM's default): give back every block, requeue at the front;
        resumed later by a prefill of prompt + output. Its tokens on their way are dropped."""
        self.allocator.free(req.blocks)
        req.blocks, req.num_computed, req.num_preemptions = [], 0, req.num_preemptions + 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        for drop, _ in self._pending:
            drop.add(req)

    def _decode(self, fresh: list[Request]) -> StepRecord | None:
        """Blocks for carried rows (preempting if none is free), row layout, one decode launch,
        and the copy of its sampled tokens queued for :meth:`_drain` (a finished row becomes a
        hole at the next :meth:`_retire`). Under overlap nothing here waits for the GPU: the
        carried rows' input tokens are read by the prep from ``buffers.sampled`` on the device,
        positions advance by the count of launched steps, and blocks are allocated for the
        position the step writes, known before any token comes back.

        Every row advances one position per launch, so the launch at which a row next needs a
        block (its position reaches len(blocks) * block_size) or has its last token in flight
        is known in advance: rows are looked at only then (``_wake``), or when they join."""
        t0, bs, rows, row_of = time.perf_counter(), self.config.block_size, self.rows, self._row_of
        launch = self._launches
        woken = sorted({r for r in self._wake.pop(launch, ()) if r in row_of}, key=row_of.get)
        # carried rows whose next position opens a block, in row order: one block each
        need = [r for r in woken if r.num_computed // bs >= len(r.blocks)]
        got = self.allocator.allocate(len(need))  # what they would get one by one, or None
        appended = dict(zip(need, got or ()))  # request -> block appended this step
        for req, block in appended.items():
            req.blocks.append(block)
        for req in need if got is None else ():  # too few free: one by one, preempting
            while req in row_of and req.num_computed // bs >= len(req.blocks):
                got = self.allocator.allocate(1)
                if got is not None:
                    req.blocks.append(got[0])
                    appended[req] = got[0]
                    break
                self._preempt_newest(rows, row_of, fresh, appended)
        exact = True  # every req_id of a new row fits the int64 cache as is
        for i in place_rows(rows, fresh):
            row_of[rows[i]] = i
            exact = _fits_int64(rows[i].req_id) and exact
            if exact:
                self._ids[i] = rows[i].req_id
        if not rows:  # everything was preempted (cannot happen while one request fits alone)
            return None
        appends = sorted((row_of[r], b) for r, b in appended.items())
        if fresh or not exact:  # new rows: (token, position = tokens in KV, whole block row)
            step = DecodeStep.build(
                self._ids[:len(rows)].copy() if exact else [r.req_id for r in rows],
                {row_of[r]: (r.output[-1], r.num_computed, r.blocks) for r in fresh}, appends)
        else:  # carried rows only: the arrays as DecodeStep holds them
            step = DecodeStep(self._ids[:len(rows)].copy(),
                              append_rows=np.array([i for i, _ in appends], np.int32),
                              append_block_ids=np.array([b for _, b in appends], np.int32))
        res = self.runner.decode(step)
        for req in rows:  # the token this step writes into the KV cache
            req.num_computed += 1
            req.num_launches += 1
        self._launches, due = launch + 1, []
        for req in dict.fromkeys([r for r in woken if r in row_of] + fresh):
            c, end = req.num_computed, len(req.prompt) + req.max_new_tokens - 1
            if c >= end:  # all its tokens generated or in flight: retired next step
                due.append(row_of[req])
                self._ending.add(req)
            else:  # wake at the launch that opens a block or sends its last token
                self._wake[launch + 1 + max(0, min(len(req.blocks) * bs, end - 1) - c)].append(req)
        self.readback.push(self.buffers.sampled, list(rows))
        self._pending.append((set(), due))
        return self._record("decode", res.path, res.num_reqs, res.padded_size, res.prep_us,
                            res.upload_bytes, t0, res.eager_reason)

    def _drain(self) -> None:
        """Append the tokens of the oldest pending decode step. A request that finished or was
        preempted after that step was launched drops its token (its next one is recomputed).
        Only rows whose token is eos or was due to be their last are checked for a finish."""
        reqs, tokens = self.readback.pop()
        drop, due = self._pending.popleft()
        if drop:
            for req, tok in zip(reqs, tokens):
                if req not in drop:
                    self._append(req, tok)
            return
        for req, tok in zip(reqs, tokens):
            req.output.append(tok)
        eos, ends = self.config.eos_token_id, set(due)
        if eos is not None and eos in tokens:
            ends.update(i for i, t in enumerate(tokens) if t == eos)
        for i in sorted(ends):
            self._finish_if_done(reqs[i], tokens[i])

    def _retire(self) -> None:
        """Turn rows into holes whose request finished (eos seen by the last drain) or has all
        its tokens generated or in flight (a length finish known before the tokens arrive)."""
        for req in self._ending:
            i = self._row_of.pop(req, None)
            if i is not None:
                self.rows[i] = None
        self._ending.clear()
        if not self._row_of:  # no running row: every wake-up left is stale
            self._wake.clear()


_I64 = np.iinfo(np.int64)


def _fits_int64(req_id) -> bool:
    """Whether DecodeStep takes ``req_id`` as an int64 (a Python or numpy int, not a bool, in
    range); for anything else DecodeStep.build raises the error that names it."""
    return (isinstance(req_id, (int, np.integer)) and not isinstance(req_id, (bool, np.bool_))
            and _I64.min <= req_id <= _I64.max)
