"""The engine's waiting queue: requests checked and queued, then admitted for prefill in order
while a row, KV blocks and the prefill budget allow (the first half of
:class:`~zos.serving.scheduler.Scheduler`, which adds the decode rows)."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from zos._checks import check_int
from zos.serving.kv_blocks import BlockAllocator
from zos.serving.types import EngineConfig, Request

_I64 = np.iinfo(np.int64)


class RequestQueue:
    """Queueing and admission for one engine of ``config`` (a model of ``vocab_size`` tokens).

    Attributes:
        allocator: the KV block allocator (block 0 is the null block).
        waiting: requests queued for prefill, in order (preempted ones go back to the front).
    """

    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        self.config, self.vocab_size = config, vocab_size
        self.allocator = BlockAllocator(config.num_kv_blocks)
        self.waiting: deque[Request] = deque()
        self._live: set[int] = set()  # req_ids waiting or running (not finished)
        self._admitted = 0  # admissions so far: each request's admit_seq

    def num_running(self) -> int:
        """Rows taken (the scheduler's running and joining requests)."""
        raise NotImplementedError

    def add(self, reqs: Iterable[Request]) -> None:
        """Queue ``reqs`` in order, all or none (see ``Engine.add_requests`` for the errors)."""
        reqs, ids = list(reqs), set()
        for req in reqs:
            self.check(req)
            if req.req_id in ids:
                raise ValueError(f"request {req.req_id}: req_id given twice")
            ids.add(req.req_id)
        self.waiting.extend(reqs)
        self._live |= ids

    def check(self, req: Request) -> None:
        """Raise unless ``req`` may be queued (see ``Engine.add_requests``)."""
        cfg, vocab, rid = self.config, self.vocab_size, req.req_id
        check_int(f"request {rid!r}: req_id", rid, int(_I64.min))
        if rid > _I64.max:  # DecodeStep.req_ids is int64; the packer keys rows by it
            raise ValueError(f"request {rid}: req_id does not fit int64")
        prompt = req.prompt
        if type(prompt) is not list:  # the prefill concatenates it with the output list
            raise TypeError(f"request {rid}: prompt must be a list of int token ids, got "
                            f"{type(prompt).__name__}")
        for i, t in enumerate(prompt):
            if type(t) is not int:  # a numpy int passes check_int, anything else raises
                check_int(f"request {rid}: prompt[{i}]", t, lo=None)
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"request {rid}: prompt must be non-empty ids in [0, {vocab})")
        check_int(f"request {rid}: max_new_tokens", req.max_new_tokens, lo=None)
        if req.max_new_tokens < 1 or len(prompt) + req.max_new_tokens > cfg.max_model_len:
            raise ValueError(f"request {rid}: need max_new_tokens >= 1 and prompt + "
                             f"max_new_tokens <= max_model_len {cfg.max_model_len}")
        if rid in self._live:
            raise ValueError(f"request {rid}: req_id is already waiting or running")

    def admit(self) -> list[Request]:
        """Waiting requests, in order, while a row, blocks for their prefill (prompt + output +
        1 positions: a resumed request recomputes its output) and the prefill budget allow."""
        cfg, out, used = self.config, [], 0
        running = self.num_running()
        while self.waiting and running + len(out) < cfg.max_num_seqs:
            req = self.waiting[0]
            n = len(req.prompt) + len(req.output)
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

    def admit_prefilled(self, req: Request, first_token: int) -> None:
        """Admit ``req`` with the KV of its prompt taken as in the cache: blocks for prompt + 1
        positions. Raises ValueError (nothing changed) for an invalid request, a first token
        outside the vocabulary, no free row or too few free blocks; the caller then starts it
        (``Scheduler.start``)."""
        self.check(req)
        if self.num_running() >= self.config.max_num_seqs:
            raise ValueError(f"request {req.req_id}: no free row (max_num_seqs "
                             f"{self.config.max_num_seqs})")
        check_int(f"request {req.req_id}: first_token", first_token, lo=None)
        if not 0 <= first_token < self.vocab_size:
            raise ValueError(f"request {req.req_id}: first_token {first_token} is outside the "
                             f"vocabulary")
        blocks = self.allocator.allocate(-(-(len(req.prompt) + 1) // self.config.block_size))
        if blocks is None:
            raise ValueError(f"request {req.req_id}: not enough free KV blocks")
        req.blocks, req.num_computed = blocks, len(req.prompt)
        self._live.add(req.req_id)
        req.admit_seq, self._admitted = self._admitted, self._admitted + 1
