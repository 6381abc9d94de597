"""vLLM's scheduler outputs as zos decode steps (zos/integrations/vllm_steps.py), on vLLM 0.26's
own ``SchedulerOutput`` / ``NewRequestData`` / ``CachedRequestData``.

A seeded simulation of vLLM's scheduler (arrivals, prefill, chunked prefill, decode, blocks
allocated as positions cross them, finishing, preemption and resumption as runner v2 sees it:
the resumed request sent again as new) feeds :class:`VllmDecodeSteps`; every pure-decode step it
builds goes through zos's own prep (the device backend, Triton's interpreter on a CPU) and each
real row's position, seq_len, block-table row and slot must equal what vLLM's runner v2 builds
from the same scheduler output (the reference below, written from ``prepare_inputs`` /
``gather_block_tables`` / ``compute_slot_mappings``). Runs where vLLM imports (CI: its wheel
installed without dependencies into a directory on ``PYTHONPATH``, a pytest process of its own:
importing vLLM sets environment variables).
"""
import zos._interpret  # noqa: F401  (before anything imports triton)

import random

import numpy as np
import pytest

from zos.buffers import DecodeBuffers
from zos.device_backend import DeviceMetadataBackend
from zos.integrations.vllm_steps import VllmDecodeSteps

from helpers import DEVICE

vllm = pytest.importorskip("vllm", reason="vLLM 0.26.0 is not installed")
if vllm.__version__ != "0.26.0":
    pytest.skip(f"written against vLLM 0.26.0's objects, found {vllm.__version__}",
                allow_module_level=True)
from vllm.v1.core.sched import output as sched  # noqa: E402

BS, WIDTH = 4, 12  # block size, block-table columns


class Scheduler:
    """vLLM's scheduler as runner v2 sees it, small: a FIFO of waiting requests, a running list
    in admission order, a token budget, blocks allocated for every scheduled token, preemption
    of the newest running request when the pool runs dry (its blocks freed, its request back at
    the head of the queue to prefill again, prompt and output so far)."""

    def __init__(self, rng: random.Random, budget: int, max_running: int, num_blocks: int):
        self.rng, self.budget, self.max_running = rng, budget, max_running
        self.free = list(range(1, num_blocks))  # block 0: vLLM's null block
        self.preemptions = 0
        self.waiting, self.running = [], []
        self.reqs = {}  # id -> dict(tokens, computed, blocks, left, out)
        self.next = 0

    def arrive(self):
        rid = f"req-{self.next}"
        self.next += 1
        self.reqs[rid] = dict(prompt=self.rng.randint(1, 3 * BS), computed=0, blocks=[],
                              left=self.rng.randint(1, 6 * BS), out=0, prefill_len=0)
        self.waiting.append(rid)

    def _alloc(self, r, upto):
        need = -(-upto // BS) - len(r["blocks"])
        if need > len(self.free):
            return None
        new = [self.free.pop() for _ in range(need)]
        r["blocks"] += new
        return new

    def step(self):
        finished, preempted = set(), set()
        for rid in list(self.running):  # requests done last step leave
            if self.reqs[rid]["left"] == 0:
                self.running.remove(rid)
                self.free += self.reqs.pop(rid)["blocks"]
                finished.add(rid)
        tokens, cached, new, budget = {}, [], [], self.budget
        for rid in list(self.running):
            r = self.reqs[rid]
            n = min(r["prompt"] + r["out"] - r["computed"], budget)
            if n == 0 or rid not in self.running:
                continue
            added = self._alloc(r, r["computed"] + n)
            while added is None and len(self.running) > 1:  # preempt the newest other
                victim = next(v for v in reversed(self.running) if v != rid)
                self.running.remove(victim)
                v = self.reqs[victim]
                self.free += v["blocks"]
                v.update(blocks=[], computed=0, resumed=True)
                self.waiting.insert(0, victim)
                preempted.add(victim)
                self.preemptions += 1
                tokens.pop(victim, None)
                cached = [c for c in cached if c[0] != victim]
                added = self._alloc(r, r["computed"] + n)
            if added is None:
                continue
            cached.append((rid, added, r["computed"], r["out"]))
            tokens[rid] = n
            budget -= n
        # vLLM admits no waiting request in a step that preempted one
        while (not preempted and self.waiting and budget
               and len(self.running) < self.max_running):
            rid = self.waiting[0]
            r = self.reqs[rid]
            n = min(r["prompt"] + r["out"], budget)
            if self._alloc(r, n) is None:
                break
            self.waiting.pop(0)
            self.running.append(rid)
            r["prefill_len"] = r["prompt"] + r["out"]  # a resumed request prefills its output
            new.append(sched.NewRequestData(
                req_id=rid, prompt_token_ids=[1] * r["prompt"], mm_features=[],
                sampling_params=None, pooling_params=None, block_ids=(list(r["blocks"]),),
                num_computed_tokens=0, lora_request=None,
                prefill_token_ids=[1] * (r["prompt"] + r["out"])))
            tokens[rid] = n
            budget -= n
        out = sched.SchedulerOutput.make_empty()
        out.scheduled_new_reqs = new
        out.scheduled_cached_reqs = sched.CachedRequestData(
            req_ids=[c[0] for c in cached], resumed_req_ids=set(), new_token_ids=[],
            all_token_ids={}, new_block_ids=[(b,) if b else None for _, b, _, _ in cached],
            num_computed_tokens=[c[2] for c in cached], num_output_tokens=[c[3] for c in cached])
        out.num_scheduled_tokens = tokens
        out.total_num_scheduled_tokens = sum(tokens.values())
        out.finished_req_ids = finished
        out.preempted_req_ids = preempted
        for rid, n in tokens.items():  # the step runs: tokens computed, one sampled at the end
            r = self.reqs[rid]
            r["computed"] += n
            if r["computed"] == r["prompt"] + r["out"]:
                r["out"] += 1
                r["left"] -= 1
        return out


def vllm_decode_reference(out, blocks_of, computed_of):
    """What runner v2 builds for a uniform one-token step: batch order (``sort_batch_req_ids``),
    positions = num_computed_tokens, seq_lens = positions + 1, query_start_loc 0..N, each row
    the request's blocks, slot = block[pos // BS] * BS + pos % BS."""
    order = sorted(out.num_scheduled_tokens, key=lambda r: (out.num_scheduled_tokens[r] != 1,
                                                            out.num_scheduled_tokens[r]))
    pos = np.array([computed_of[r] for r in order], np.int64)
    slots = np.array([blocks_of[r][p // BS] * BS + p % BS for r, p in zip(order, pos)])
    return order, pos, pos + 1, [blocks_of[r] for r in order], slots


@pytest.mark.parametrize("seed,budget,max_running,num_blocks",
                         [(0, 7, 5, 19), (1, 16, 9, 31), (2, 33, 13, 47)])
def test_decode_steps_build_vllm_metadata(seed, budget, max_running, num_blocks):
    rng = random.Random(seed)
    sim = Scheduler(rng, budget, max_running, num_blocks)
    steps = VllmDecodeSteps(block_size=BS, max_num_reqs=16, max_num_blocks_per_req=WIDTH)
    resumed_tails = 0  # steps of one-token chunks only, some a resumed request's last prefill
    buffers = DecodeBuffers(16, WIDTH, BS, device=DEVICE)
    backend = DeviceMetadataBackend(buffers, num_kv_blocks=num_blocks, vocab_size=32)
    blocks_of, computed_of = {}, {}
    built = carried = appended = 0
    for _ in range(160):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            sim.arrive()
        out = sim.step()
        if not out.num_scheduled_tokens:
            continue
        for r in out.finished_req_ids | out.preempted_req_ids:
            blocks_of.pop(r, None)
        for new in out.scheduled_new_reqs:
            blocks_of[new.req_id] = list(new.block_ids[0])
            computed_of[new.req_id] = new.num_computed_tokens
        c = out.scheduled_cached_reqs
        for rid, b, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            blocks_of[rid] += b[0] if b else []
            computed_of[rid] = n
        step = steps.step(out)
        # runner v2's rule: a row decodes once its prefill (prompt, and for a resumed request
        # its output so far) is computed; its input token is then the last one sampled
        one_token = (all(n == 1 for n in out.num_scheduled_tokens.values())
                     and not out.scheduled_new_reqs)
        pure = one_token and all(computed_of[r] >= sim.reqs[r]["prefill_len"]
                                 for r in out.num_scheduled_tokens)
        resumed_tails += one_token and not pure
        assert (step is not None) == pure
        if step is None:
            continue
        built += 1
        order, pos, seq_lens, tables, slots = vllm_decode_reference(out, blocks_of, computed_of)
        assert step.req_ids == order
        n = len(order)
        carried += n - len(step.step.new_rows)
        appended += len(step.step.append_rows)
        meta = backend.prepare(step.step)
        assert meta.positions[:n].tolist() == pos.tolist()
        assert meta.seq_lens[:n].tolist() == seq_lens.tolist()
        assert meta.slot_mapping[:n].tolist() == slots.tolist()
        assert meta.query_start_loc[: n + 1].tolist() == list(range(n + 1))
        for row, table in enumerate(tables):  # zos's null block (0) past a row's blocks
            assert meta.block_table[row].tolist() == table + [0] * (WIDTH - len(table)), row
    # the simulation reached each case: rows carried, blocks appended, requests preempted
    assert built > 10 and carried > built and appended > 0 and sim.preemptions > 0
    assert resumed_tails > 0 or seed == 2  # seed 2's budget never leaves one-token chunks


def decode_of(rid, computed, blocks=None):
    """One cached request's one-token step past its prefill."""
    out = sched.SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = sched.CachedRequestData(
        req_ids=[rid], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
        new_block_ids=[blocks], num_computed_tokens=[computed], num_output_tokens=[1])
    out.num_scheduled_tokens, out.total_num_scheduled_tokens = {rid: 1}, 1
    return out


def admitted(rid, prompt):
    out = sched.SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [sched.NewRequestData(
        req_id=rid, prompt_token_ids=[1] * prompt, mm_features=[], sampling_params=None,
        pooling_params=None, block_ids=([1, 2],), num_computed_tokens=0, lora_request=None,
        prefill_token_ids=[1] * prompt)]
    out.num_scheduled_tokens, out.total_num_scheduled_tokens = {rid: prompt}, prompt
    return out


def test_no_step_is_zos_under_speculative_decoding():
    """The scheduler's num_computed_tokens counts unverified drafts under asynchronous
    scheduling: an engine with a drafter keeps vLLM's prep for every step."""
    plain = VllmDecodeSteps(block_size=BS, max_num_reqs=4, max_num_blocks_per_req=WIDTH)
    spec = VllmDecodeSteps(block_size=BS, max_num_reqs=4, max_num_blocks_per_req=WIDTH,
                           num_speculative_tokens=2)
    for steps in (plain, spec):
        assert steps.step(admitted("a", 5)) is None
    assert plain.step(decode_of("a", 5)).step.new_positions.tolist() == [5]
    assert spec.step(decode_of("a", 5)) is None


def test_a_step_the_mirror_missed_is_an_error():
    steps = VllmDecodeSteps(block_size=BS, max_num_reqs=4, max_num_blocks_per_req=WIDTH)
    with pytest.raises(ValueError, match="cached request 'b' was never scheduled as new"):
        steps.step(decode_of("b", 3))


def test_a_live_request_sent_again_as_new_keeps_one_slot():
    """vLLM sends a live request again as new without finishing it (a streaming-input
    update; runner v2's ``add_requests`` replaces it): the mirror replaces it in place, and
    the next decode step stages it as a new row with the blocks it was sent with."""
    steps = VllmDecodeSteps(block_size=BS, max_num_reqs=1, max_num_blocks_per_req=WIDTH)
    for out in (admitted("a", 5), admitted("a", 6), admitted("b", 3)):
        assert steps.step(out) is None
    step = steps.step(decode_of("a", 6)).step
    assert step.new_rows.tolist() == [0] and step.new_positions.tolist() == [6]
    assert step.new_block_ids.tolist() == [1, 2]
    assert steps.step(decode_of("b", 3)).step.new_positions.tolist() == [3]
