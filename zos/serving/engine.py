"""A small continuous-batching engine: eager packed prefill, decode through GraphRunner.

It stands in for "an existing decode runner": the metadata backend ("zos" or "host") is the
only thing that differs between two runs with the same config. Scheduling is deterministic
(arrival times only order the queue), so both backends see the same steps; with
``overlap=True`` the host stages step t+1 while the GPU runs step t (decode only: a step that
admits requests runs their prefill eagerly and waits for it).

One engine step (:meth:`Engine.step`) reads top to bottom: retire the rows that left, admit and
prefill waiting requests, launch one decode of every running row, read back the launches that
are due. The scheduler (:mod:`zos.serving.scheduler`) decides rows, blocks, preemption and stops;
the decode mode (:mod:`zos.serving.decode_modes`) is what differs with draft tokens; the launches
in flight are the one queue of the read-back (:class:`SampledReadback`). The host work of a
steady step is a fixed number of numpy ops over the N rows plus Python for the rows that change
(the scheduler's per-row arrays, :mod:`zos.serving.row_state`), and one loop that appends each
row's token to its request's output.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from zos._checks import check_int
from zos.buffers import DecodeBuffers
from zos.device_backend import DeviceMetadataBackend
from zos.host_backend import HostMetadataBackend
from zos.serving.decode_modes import PlainDecode, SpecDecode
from zos.serving.models import allocate_kv_cache
from zos.serving.readback import SampledReadback
from zos.serving.runner import GraphRunner, check_graph_options
from zos.serving.scheduler import Scheduler
from zos.serving.types import EngineConfig, Request, RunResult, StepRecord, make_buckets
from zos.spec import SpecDecoder


class Engine:
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
        self.mode = SpecDecode(self.spec, k) if k else PlainDecode(self.buffers)
        self.scheduler = Scheduler(cfg, c.vocab_size)
        # The launches in flight, oldest first (at most one left after a step under overlap).
        self.readback = SampledReadback(cfg.max_num_seqs, self.device, width=self.mode.width)
        self.overlap = overlap
        self.records: list[StepRecord] = []
        self.num_steps = 0

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue ``req`` (behind earlier ones); see :meth:`add_requests`."""
        self.add_requests([req])

    def add_requests(self, reqs: Iterable[Request]) -> None:
        """Queue ``reqs`` in order, all or none: every request is checked before any is queued.

        Raises:
            TypeError: a req_id or max_new_tokens that is not an int (DecodeStep.req_ids is
                int64), a prompt that is not a list of int token ids.
            ValueError: an empty prompt, a token outside the vocabulary, max_new_tokens < 1,
                prompt + max_new_tokens > max_model_len, a req_id outside int64, or a req_id
                that is already waiting or running (or twice in ``reqs``): the packer keys rows
                by request id.
        """
        self.scheduler.add(reqs)

    def admit_prefilled(self, req: Request, first_token: int) -> None:
        """Admit ``req`` as if its prompt had been prefilled elsewhere (a disaggregated prefill,
        or a benchmark of steady-state decode): its blocks are allocated now, the KV of its
        prompt is taken to be in the cache already (whatever those blocks hold), and
        ``first_token`` is its first output; it joins the next decode step as a new row.
        Nothing is allocated or queued when it raises.

        Raises:
            TypeError: the request is invalid (see :meth:`add_requests`), or ``first_token``
                is not an int.
            ValueError: the request is invalid (see :meth:`add_requests`), the token is outside
                the vocabulary, no row is free, or too few blocks are free.
        """
        self.scheduler.admit_prefilled(req, first_token)
        self.mode.write_prompt_history(req)
        self.scheduler.start([req], [first_token])

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs, or a decode step's tokens are still on their way."""
        return self.scheduler.has_work() or bool(self.readback.pending)

    # ---- one engine step -------------------------------------------------------------------

    def step(self, progress: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
        """One engine step: retire the rows that left, admit and prefill waiting requests (one
        eager packed prefill), launch one decode of every running row, and read back every
        launch but the one just made (overlap) or all of them (synchronous). Returns the step's
        records (prefill first), also appended to :attr:`records` and passed to ``progress``."""
        self.num_steps += 1
        self.scheduler.retire()
        records = self._prefill(self.scheduler.admit())
        decode = self._decode()
        if decode is not None:
            records.append(decode)
        self._read_back(keep=1 if self.overlap and decode is not None else 0)
        for rec in records:
            self.records.append(rec)
            if progress is not None:
                progress(rec)
        return records

    def _prefill(self, reqs: list[Request]) -> list[StepRecord]:
        """Prefill prompt + output of ``reqs`` (output non-empty when resumed) and start them
        with the token each samples; [] when there is none."""
        if not reqs:
            return []
        t0, seqs = time.perf_counter(), [(r.prompt + r.output, r.blocks) for r in reqs]
        tokens, us, nbytes = self.runner.prefill(seqs)
        for r, (toks, _) in zip(reqs, seqs):
            r.num_computed = len(toks)
        self.scheduler.start(reqs, tokens)
        return [self._record("prefill", "eager", len(reqs), sum(len(s) for s, _ in seqs), us,
                             nbytes, t0)]

    def _decode(self) -> StepRecord | None:
        """Schedule and launch one decode of every running row; queue the copy of its output for
        :meth:`_read_back`. Nothing here waits for the GPU. None if no row runs."""
        t0 = time.perf_counter()
        launch = self.scheduler.schedule_decode(self.mode.q, bool(self.readback.pending))
        if launch is None:
            return None
        step, rows = launch
        res = self.runner.decode(step)
        self.readback.push(self.mode.output, rows)
        return self._record("decode", res.path, res.num_reqs, res.padded_size, res.prep_us,
                            res.upload_bytes, t0, res.eager_reason)

    def _read_back(self, keep: int) -> None:
        """Read launches, oldest first, until ``keep`` remain in flight: each row's kept tokens
        (the mode's ``read``, numpy arrays) go to the scheduler's stop checks."""
        while len(self.readback.pending) > keep:
            launch, values = self.readback.pop()
            later = len(self.readback.pending)  # launches staged after this one
            kept, counts = self.mode.read(values, self.backend, steps_ago=later)
            self.scheduler.accept_kept(launch, kept, counts, more_in_flight=later > 0)

    def _record(self, kind, path, n, padded, us, nbytes, t0, eager_reason=None) -> StepRecord:
        return StepRecord(self.num_steps, kind, path, n, padded, us, nbytes, self.num_preemptions,
                          time.perf_counter() - t0, eager_reason)

    # ---- a whole run -----------------------------------------------------------------------

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

    # ---- state, read-only views --------------------------------------------------------------

    @property
    def graphs_captured(self) -> int:
        """Decode graphs captured so far (eager capture: one per bucket at construction)."""
        return self.runner.num_captures

    @property
    def rows(self) -> list[Request | None]:
        """Request of each row of the last decode launch (None: a hole)."""
        return self.scheduler.rows

    @property
    def waiting(self):
        """Requests queued for prefill (a deque, front first)."""
        return self.scheduler.waiting

    @property
    def allocator(self):
        """The KV block allocator (:class:`~zos.serving.kv_blocks.BlockAllocator`)."""
        return self.scheduler.allocator

    @property
    def num_preemptions(self) -> int:
        """Recompute preemptions so far."""
        return self.scheduler.num_preemptions

    @property
    def spec_rows(self) -> int:
        """Request rows read back so far (with draft tokens: rows the verifier ran)."""
        return self.mode.rows_read

    @property
    def spec_tokens(self) -> int:
        """Tokens those rows kept (1 each without draft tokens)."""
        return self.mode.tokens_kept
