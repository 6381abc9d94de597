"""zos's decode prep bound to a vLLM runner v2 (zos/integrations/vllm_prep.py), on a CPU: the
``InputBatch`` it builds and what it writes into runner v2's persistent tensors, step by step,
against what runner v2 builds for the same step (the reference below, from ``prepare_inputs`` /
``gather_block_tables`` / ``compute_slot_mappings``).

The runner is a stand-in holding vLLM's own ``InputBuffers`` and the attributes of
``GPUModelRunner`` the prep reads (its request state kept as runner v2 keeps it); the scheduler
is ``test_vllm_steps.Scheduler`` (arrivals, chunked prefill, preemption, finishing). On the GPU
the same path runs inside vLLM, compared field by field with vLLM's own preparation
(``bench/vllm_check.py --mode shadow``). Runs where vLLM imports, as tests/test_vllm_steps.py.
"""
import zos._interpret  # noqa: F401  (before anything imports triton)

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM 0.26.0 is not installed")
if vllm.__version__ != "0.26.0":
    pytest.skip(f"written against vLLM 0.26.0's objects, found {vllm.__version__}",
                allow_module_level=True)
from test_vllm_steps import BS, Scheduler  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBuffers  # noqa: E402

from zos.integrations.vllm_buffers import PAD_SLOT_ID  # noqa: E402
from zos.integrations.vllm_prep import ZosVllmPrep  # noqa: E402

MAX_REQS, MAX_TOKENS, WIDTH, CAPTURE = 16, 40, 16, [1, 2, 4, 8, 16]


def stand_in_runner(num_blocks: int):
    """What ZosVllmPrep reads of a GPUModelRunner, on the CPU."""
    return SimpleNamespace(
        device=torch.device("cpu"), max_num_reqs=MAX_REQS, vocab_size=1000,
        kv_cache_config=SimpleNamespace(
            num_blocks=num_blocks,
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BS))]),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=CAPTURE),
        input_buffers=InputBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu")),
        block_tables=SimpleNamespace(
            input_block_tables=[torch.full((MAX_REQS, WIDTH), 99, dtype=torch.int32)],
            slot_mappings=torch.full((1, MAX_TOKENS), 99, dtype=torch.int64),
            num_blocks=SimpleNamespace(gpu=torch.zeros(1, MAX_REQS, dtype=torch.int32))),
        req_states=SimpleNamespace(
            req_id_to_index={}, last_sampled_tokens=torch.zeros(MAX_REQS, 1, dtype=torch.int64),
            num_computed_tokens_np=np.zeros(MAX_REQS, np.int32),
            prefill_len=SimpleNamespace(np=np.zeros(MAX_REQS, np.int32)),
            num_computed_prefill_tokens=np.zeros(MAX_REQS, np.int32)))


def scheduled(sim, runner, rng, blocks_of, steps=160):
    """The simulated scheduler's outputs that schedule something, each after runner v2's
    request state (``finish_requests`` / ``add_requests`` / ``update_requests``) and the
    stand-in's block counts follow it; ``blocks_of`` gets each live request's blocks."""
    rs, free = runner.req_states, list(range(MAX_REQS))
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            sim.arrive()
        so = sim.step()
        for rid in so.finished_req_ids | so.preempted_req_ids:
            if rid in rs.req_id_to_index:
                free.append(rs.req_id_to_index.pop(rid))
                blocks_of.pop(rid)
        for new in so.scheduled_new_reqs:
            i = rs.req_id_to_index[new.req_id] = free.pop(0)
            rs.prefill_len.np[i] = len(new.prefill_token_ids)
            rs.num_computed_tokens_np[i] = new.num_computed_tokens
            blocks_of[new.req_id] = list(new.block_ids[0])
        c = so.scheduled_cached_reqs
        for rid, b, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            rs.num_computed_tokens_np[rs.req_id_to_index[rid]] = n
            blocks_of[rid] += b[0] if b else []
        for rid, i in rs.req_id_to_index.items():
            rs.num_computed_prefill_tokens[i] = min(rs.num_computed_tokens_np[i],
                                                    rs.prefill_len.np[i])
            runner.block_tables.num_blocks.gpu[0, i] = len(blocks_of[rid])
        rs.last_sampled_tokens[:, 0] = torch.randint(0, 1000, (MAX_REQS,))
        if so.num_scheduled_tokens:
            yield so


def not_called(*args):
    raise AssertionError("vLLM's own preparation runs only in shadow mode")


@pytest.mark.parametrize("padding", ["bucket", "none", "max"])
@pytest.mark.parametrize("seed,budget,max_running,num_blocks", [(0, 7, 5, 19), (3, 16, 12, 40)])
def test_decode_steps_as_runner_v2_builds_them(seed, budget, max_running, num_blocks, padding):
    """vLLM pads a step to its captured size (zos's bucket: the write inside zos's build), or
    not at all (no CUDA graph: ``batch_desc.num_reqs`` None), or to another size than zos's
    bucket (zos writes again with vLLM's)."""
    rng = random.Random(seed)
    sim = Scheduler(rng, budget, max_running, num_blocks)
    runner = stand_in_runner(num_blocks)
    rs, ib = runner.req_states, runner.input_buffers
    prep = ZosVllmPrep(runner)
    blocks_of = {}
    built = 0
    for so in scheduled(sim, runner, rng, blocks_of):
        n = len(so.num_scheduled_tokens)
        padded = {"bucket": next(s for s in CAPTURE if s >= n), "none": n,
                  "max": MAX_REQS}[padding]
        desc = SimpleNamespace(num_reqs=None if padding == "none" else padded, num_tokens=padded)
        prep.observe(so)
        batch = prep.prepare_inputs(so, desc, not_called, not_called)
        prep.finish_step()
        pure = (so.total_num_scheduled_tokens == n and not so.scheduled_new_reqs
                and all(rs.num_computed_tokens_np[rs.req_id_to_index[r]]
                        >= rs.prefill_len.np[rs.req_id_to_index[r]]
                        for r in so.num_scheduled_tokens))
        assert (batch is not None) == pure
        if batch is None:
            continue
        built += 1
        # runner v2's reference: scheduler order (a uniform step), positions = computed
        order = list(so.num_scheduled_tokens)
        idx = np.array([rs.req_id_to_index[r] for r in order], np.int32)
        pos = rs.num_computed_tokens_np[idx].astype(np.int64)
        assert batch.req_ids == order and batch.idx_mapping_np.tolist() == idx.tolist()
        assert batch.idx_mapping.tolist() == idx.tolist()
        assert (batch.num_reqs, batch.num_reqs_after_padding, batch.num_tokens,
                batch.num_tokens_after_padding) == (n, padded, n, padded)
        assert batch.query_start_loc_np.tolist() == [*range(n + 1), *[n] * (padded - n)]
        assert batch.seq_lens_cpu_upper_bound.tolist() == [*(pos + 1), *[0] * (padded - n)]
        assert batch.logits_indices.tolist() == list(range(n))
        assert batch.cu_num_logits.tolist() == batch.cu_num_logits_np.tolist() == list(
            range(n + 1))
        assert not batch.is_prefilling_np.any()
        assert ib.input_ids[:n].tolist() == rs.last_sampled_tokens[idx, 0].tolist()
        assert ib.positions[:n].tolist() == pos.tolist()
        assert ib.seq_lens.tolist() == [*(pos + 1), *[0] * (MAX_REQS - n)]
        assert ib.query_start_loc.tolist() == [*range(n + 1), *[n] * (MAX_REQS - n)]
        table = runner.block_tables.input_block_tables[0]
        slots = runner.block_tables.slot_mappings[0]
        for row, (rid, p) in enumerate(zip(order, pos)):
            blocks = blocks_of[rid]
            assert table[row, :len(blocks)].tolist() == blocks, row
            assert slots[row] == blocks[p // BS] * BS + p % BS, row
        assert not table[n:padded].any()
        assert (slots[n:] == PAD_SLOT_ID).all()
        blocks, slot_mapping = prep.prepare_attn(batch)
        assert blocks[0].data_ptr() == table.data_ptr() and blocks[0].shape[0] == padded
        assert slot_mapping.shape == (1, padded)
    assert built > 10 and sim.preemptions > 0
    assert prep.stats["zos_steps"] == built
    bucketed = prep.stats["zos_steps"] - prep.stats["rewrites"]
    assert bucketed == built if padding == "bucket" else bucketed < built


@pytest.mark.parametrize("fault", [None, "dtype", "value"])
def test_shadow_comparison_counts_what_differs(fault):
    """Shadow mode's comparison (``ZosVllmPrep.compare``): a reference that prepares every
    step as zos does (a second prep on the same runner) differs in nothing; one whose batch
    carries another dtype or value in a host array is counted and named."""
    rng = random.Random(4)
    sim = Scheduler(rng, 16, 12, 40)
    runner = stand_in_runner(40)
    prep, ref = ZosVllmPrep(runner, shadow=True), ZosVllmPrep(runner)

    def vllm_prepare_inputs(r, so, desc):
        batch = ref.prepare_inputs(so, desc, not_called, not_called)
        if fault == "dtype":
            batch.num_scheduled_tokens = batch.num_scheduled_tokens.astype(np.int64)
        elif fault == "value":
            batch.num_computed_tokens_np = batch.num_computed_tokens_np + 1
        return batch

    for so in scheduled(sim, runner, rng, {}):
        n = len(so.num_scheduled_tokens)
        desc = SimpleNamespace(num_reqs=next(s for s in CAPTURE if s >= n),
                               num_tokens=next(s for s in CAPTURE if s >= n))
        ref.observe(so)
        prep.observe(so)
        prep.prepare_inputs(so, desc, vllm_prepare_inputs, lambda r, b: None)
        prep.finish_step()
        ref.finish_step()
    stats = prep.stats
    assert stats["shadow_steps"] == stats["zos_steps"] > 10
    if fault is None:
        assert stats["mismatches"] == 0 and stats["first_mismatch"] is None
    else:
        assert stats["mismatches"] == stats["zos_steps"]
        name = "num_scheduled_tokens" if fault == "dtype" else "num_computed_tokens_np"
        assert name in stats["first_mismatch"]
