"""Tensor and data parallelism over torch.distributed (gloo, 2 processes on the CPU): TP=2
generates the tokens of the single-process engine with both metadata backends and every rank's
metadata buffers are byte-identical after every decode step, through the shared-memory step
ring and through the collective; TP=2 with 2 draft tokens gives plain greedy tokens; DP=2 ranks
agree on one padded size per step (the largest of their own), an idle rank runs dummy steps,
and each rank's tokens are those of its requests run alone; a rank that fails or exits makes
the others raise PeerRankFailed naming it. The model shards, the padded-size override and the
ring itself (tests/test_shm_ring.py) are checked in one process."""
import json
import os
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from zos import DecodeBuffers, DecodeStep, DeviceMetadataBackend, HostMetadataBackend
from zos.buckets import BucketTable
from zos.serving.engine import Engine
from zos.serving.models import random_llama
from zos.serving.models.parallel import shard_state_dict, tp_config, tp_llama

import dist_workers as W
from helpers import DEVICE, LLAMA_CFG, TraceGen, expected

WORLD = 2
# Two processes: gloo on a CPU; on CUDA one GPU each (NCCL, decode graphs captured with the
# all-reduces inside), so a machine with one GPU skips the spawned tests.
needs_world = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < WORLD,
                                 reason=f"CUDA with fewer than {WORLD} GPUs")


def spawn(fn, args, tmp_path, deadline_s: float = 600.0) -> list[dict | None]:
    """Run ``fn(rank, WORLD, init, out, *args)`` in WORLD spawned processes; their JSONs (None
    for a rank that wrote none). A run past ``deadline_s`` is killed and fails the test: the
    bound that says "does not hang"."""
    init = f"file://{tmp_path}/store"
    out = str(tmp_path)
    ctx = mp.start_processes(fn, args=(WORLD, init, out, *args), nprocs=WORLD, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"spawned ranks still running after {deadline_s} s")
    ranks = []
    for r in range(WORLD):
        path = os.path.join(out, f"rank{r}.json")
        if not os.path.exists(path):
            ranks.append(None)
            continue
        with open(path, encoding="utf-8") as f:
            ranks.append(json.load(f))
    return ranks


def reference(model, reqs, backend):
    """The single-process engine's tokens for ``reqs`` ({req_id as str: tokens}, as in JSON)."""
    res = Engine(model, W.engine_config(backend), DEVICE).run(reqs)
    return {str(k): v for k, v in res.outputs.items()}


@pytest.fixture(scope="module", params=[(False, "shm"), (True, "shm")],
                ids=["sync-shm", "overlap-shm"])
def tp_runs(request, tmp_path_factory):
    overlap, transport = request.param
    return transport, spawn(W.tp_worker, (11, overlap, transport),
                            tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module", params=[(False, "shm"), (True, "collective")],
                ids=["sync-shm", "overlap-collective"])
def dp_runs(request, tmp_path_factory):
    overlap, transport = request.param
    return transport, spawn(W.dp_worker, (overlap, transport), tmp_path_factory.mktemp("dp"))


@needs_world
@pytest.mark.parametrize("backend", W.BACKENDS)
def test_tp2_tokens_and_metadata(tp_runs, llama, backend):
    transport, ranks = tp_runs
    lead, follow = ranks[0][backend], ranks[1][backend]
    assert lead["transport"] == transport
    assert lead["outputs"] == reference(llama, W.make_requests(11, 6, 12), backend)
    assert lead["decode_steps"] > 0 and len(lead["checksums"]) == lead["decode_steps"]
    assert lead["preemptions"] > 0  # rows dropped and resumed travel through the ring too
    assert follow["checksums"] == lead["checksums"]
    for step in lead["checksums"]:
        assert len(step) == WORLD and len(set(step)) == 1


@pytest.fixture(scope="module", params=[(False, "collective"), (True, "shm")],
                ids=["sync-collective", "overlap-shm"])
def tp_spec_runs(request, tmp_path_factory):
    overlap, transport = request.param
    return transport, spawn(W.tp_worker, (11, overlap, transport, 2),
                            tmp_path_factory.mktemp("tpspec"))


@needs_world
@pytest.mark.parametrize("backend", W.BACKENDS)
def test_tp2_spec_k2_is_plain_greedy(tp_spec_runs, llama, backend):
    """TP = 2 with 2 draft tokens per row: every rank's packer gets the accepted counts (sent
    by rank 0 through the ring or the collective; the synchronous engine hands over each step's
    counts before the next step, the overlapped one a step late), metadata equal on both ranks
    after every step, and the tokens are those of plain greedy decoding in one process (no
    drafts). (The collective path of plain TP runs in test_tp_follower_exit_makes_leader_raise
    and ran on 2 x H200 before the ring.)"""
    transport, ranks = tp_spec_runs
    lead, follow = ranks[0][backend], ranks[1][backend]
    assert lead["transport"] == transport
    assert lead["outputs"] == reference(llama, W.make_requests(11, 6, 12), backend)
    assert lead["spec_tokens"] > lead["spec_rows"] > 0  # some drafts were accepted
    assert len(lead["checksums"]) == lead["decode_steps"] > 0
    assert follow["checksums"] == lead["checksums"]
    assert all(len(set(step)) == 1 for step in lead["checksums"])


@needs_world
@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_tp_follower_exit_makes_leader_raise(tmp_path, transport):
    """Rank 1 exits (no exception, no clean-up) in its 3rd decode: rank 0 stops with
    PeerRankFailed naming rank 1, instead of hanging (the spawn's deadline is the bound)."""
    ranks = spawn(W.tp_exit_worker, (transport, 3), tmp_path, deadline_s=300.0)
    assert ranks[1] is None  # it never got to write
    assert ranks[0]["error"].startswith("PeerRankFailed: tensor parallelism: rank 1 ")
    assert "rank 0 stops" in ranks[0]["error"]
    assert ranks[0]["decode_steps"] <= 3


@needs_world
def test_ring_reader_exit_makes_writer_raise(tmp_path):
    """The step ring alone: rank 1 reads 5 messages and exits; rank 0 fills the free slots,
    then raises PeerRankFailed naming rank 1 (its pid gone), long before the 60 s timeout."""
    ranks = spawn(W.ring_exit_worker, (5,), tmp_path, deadline_s=300.0)
    r0 = ranks[0]
    assert r0["error"].startswith("PeerRankFailed: tensor parallelism: rank 1 (pid ")
    assert r0["error"].endswith(") exited; rank 0 stops too")
    assert r0["sent"] == 5 + r0["num_slots"]


@needs_world
@pytest.mark.parametrize("backend", W.BACKENDS)
def test_dp2_agreement_dummy_steps_tokens(dp_runs, llama, backend):
    transport, ranks = dp_runs
    runs = [r[backend] for r in ranks]
    assert all(r["transport"] == transport for r in runs)
    agreed = runs[0]["agreed"]
    assert all(r["agreed"] == agreed for r in runs)  # one size per step, every rank
    for i, size in enumerate(agreed):
        assert size == max(r["local"][i] for r in runs)
    for rank, r in enumerate(runs):
        # a dummy step exactly when this rank had no decode and another rank did
        assert r["dummy"] == [lo == 0 and a > 0 for lo, a in zip(r["local"], agreed)]
        # every decode the engine ran used the agreed size
        assert r["padded"] == [a for lo, a in zip(r["local"], agreed) if lo > 0]
        assert r["outputs"] == reference(llama, W.dp_requests(rank), backend)
    assert sum(runs[1]["dummy"]) > 0  # rank 1 ran out of requests and padded along


@needs_world
@pytest.mark.parametrize("method, fail_at, transport", [("decode", 3, "shm"),
                                                        ("prefill", 2, "collective")])
def test_dp_rank_failure_stops_every_rank(tmp_path, method, fail_at, transport):
    """Rank 1's engine step raises (in its third decode, after that step's agreement, or in its
    second prefill, before it): it stops with that error, and rank 0 stops at the agreement
    that meets rank 1's flagged one, with an error naming rank 1 (without the flag rank 0
    waited for rank 1 until the collective timed out, 120 s here, and stopped with gloo's
    timeout error). Both recorded the same agreements, one per engine step."""
    ranks = spawn(W.dp_fail_worker, (method, fail_at, 120.0, transport), tmp_path)
    assert ranks[1]["error"] == f"ValueError: injected: {method} call {fail_at} refused"
    assert ranks[0]["error"] == ("PeerRankFailed: data parallelism: rank 1 failed its engine "
                                 "step; rank 0 stops too")
    assert ranks[0]["agreements"] == ranks[1]["agreements"] >= fail_at - 1
    for r in ranks:
        assert r["dummy"] == r["agreements"]


# --- one process: shards and the padded-size override ----------------------------------------

def test_tp_config_refuses_indivisible_heads():
    with pytest.raises(ValueError, match="num_key_value_heads = 2 is not divisible by the world "
                                         "size 4"):
        tp_config(LLAMA_CFG, 4)
    with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible"):
        tp_config(LLAMA_CFG, 3)


def test_shards_put_back_together_are_the_full_weights():
    full = random_llama(LLAMA_CFG, seed=3).state_dict()
    c, hd = LLAMA_CFG, LLAMA_CFG.head_dim
    shards = [shard_state_dict(full, c, r, WORLD) for r in range(WORLD)]
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        lq, lkv = c.num_attention_heads // WORLD * hd, c.num_key_value_heads // WORLD * hd
        qkv = [s[p + "qkv_proj"] for s in shards]
        q = torch.cat([t[:lq] for t in qkv])
        k = torch.cat([t[lq:lq + lkv] for t in qkv])
        v = torch.cat([t[lq + lkv:] for t in qkv])
        assert torch.equal(torch.cat([q, k, v]), full[p + "qkv_proj"])
        li = c.intermediate_size // WORLD
        gu = [s[p + "gate_up_proj"] for s in shards]
        assert torch.equal(torch.cat([t[:li] for t in gu] + [t[li:] for t in gu]),
                           full[p + "gate_up_proj"])
        for name in ("o_proj", "down_proj"):
            assert torch.equal(torch.cat([s[p + name] for s in shards], 1), full[p + name])
    for s in shards:
        assert torch.equal(s["embed_tokens"], full["embed_tokens"])


def test_tp1_is_the_full_model():
    full = random_llama(LLAMA_CFG, seed=3)
    one = tp_llama(full.state_dict(), LLAMA_CFG, 0, 1)
    assert all(layer.tp_group is None for layer in one.layers)
    for (n, a), (m, b) in zip(full.state_dict().items(), one.state_dict().items()):
        assert n == m and torch.equal(a, b)


@pytest.mark.parametrize("cls", [DeviceMetadataBackend, HostMetadataBackend])
@pytest.mark.parametrize("seed", [5, 17])
def test_min_padded_size_pads_with_dummy_rows(cls, seed):
    """Steps of a seeded trace staged with a larger padded size (or N = 0, a dummy step) equal
    the expected metadata of their rows padded to that size."""
    mr, w, bs, nkv, vocab = 9, 5, 4, 40, 50
    b = DecodeBuffers(mr, w, bs, device=DEVICE)
    be = cls(b, num_kv_blocks=nkv, vocab_size=vocab, buckets=BucketTable([1, 2, 4, 8]))
    gen = TraceGen(seed, max_num_reqs=mr - 1, block_size=bs, max_blocks=w, num_kv_blocks=nkv,
                   vocab=vocab)
    rng = np.random.default_rng(seed)
    for t in range(12):
        step, rows = gen.next_step()
        if t % 4 == 3:  # a dummy step: every row dropped, the next step's rows all new
            step, rows = DecodeStep.build([]), []
            gen.rows, gen.returning = [], gen.returning + gen.rows
        own = be.plan(len(rows)).padded_size
        forced = int(rng.integers(max(own, 1), mr + 1))
        plan = be.stage(step, min_padded_size=forced)
        assert (plan.num_reqs, plan.padded_size) == (len(rows), max(own, forced))
        assert plan.bucketed == (plan.padded_size in (1, 2, 4, 8))
        be.build(plan.padded_size)
        want = expected(rows, plan.padded_size, block_size=bs, max_blocks=w)
        md = be.metadata(plan)
        for name, value in want.items():
            assert getattr(md, name).cpu().numpy().tolist() == value.tolist(), (t, name)
        if rows:
            b.sampled[:len(rows)].copy_(torch.from_numpy(gen.sampled(rows)))


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (10, ValueError), (2.0, TypeError),
                                      ("3", TypeError), (True, TypeError)])
def test_min_padded_size_refused_before_any_write(bad, exc):
    b = DecodeBuffers(9, 5, 4, device=DEVICE)
    be = DeviceMetadataBackend(b, num_kv_blocks=40, vocab_size=50)
    be.prepare(DecodeStep.build([1], {0: (3, 5, [2, 3])}))
    before = {n: getattr(b, n).clone() for n in ("staging", "input_ids", "slot_mapping")}
    with pytest.raises(exc, match="min_padded_size"):
        be.stage(DecodeStep.build([1, 2], {1: (4, 0, [4])}), min_padded_size=bad)
    for n, t in before.items():
        assert torch.equal(getattr(b, n), t), n
    assert be.packer.prev_num_reqs == 1


# --- the command: zos demo --dp 2 spawns its ranks ------------------------------------------

@needs_world
def test_demo_dp2_spawned(tmp_path, capfd):
    from zos.serving.cli import main

    out = tmp_path / "report"
    assert main(["demo", "--dp", "2", "--tiny", "--num-requests", "3", "--quiet",
                 "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "dp2" and report["identical"] is True
    for b in W.BACKENDS:
        t = report["backends"][b]
        assert len(t["decode_steps"]) == WORLD and t["tokens"] > 0
        # lockstep: every rank ran the same number of steps (own decodes plus dummy steps)
        assert len({d + u for d, u in zip(t["decode_steps"], t["dummy_steps"])}) == 1
    assert "identical tokens (host vs zos): YES" in capfd.readouterr().out


@needs_world
def test_demo_tp2_spec_spawned(tmp_path, capfd):
    """``zos demo --tp 2 --spec ngram`` (refused before the followers learned the accepted
    counts): both backends give the same tokens, over the shared-memory ring."""
    from zos.serving.cli import main

    out = tmp_path / "report"
    assert main(["demo", "--tp", "2", "--spec", "ngram", "--tiny", "--num-requests", "2",
                 "--quiet", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "tp2" and report["identical"] is True
    assert report["settings"]["num_draft_tokens"] == 2
    for b in W.BACKENDS:
        t = report["backends"][b]
        assert t["transport"] == "shm" and t["tokens"] > 0
    assert "identical tokens (host vs zos): YES" in capfd.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--tp", "2", "--dp", "2"], "--tp 2 --dp 2: one kind of parallelism at a time"),
    (["--tp", "0"], "--tp: expected an int >= 1, got '0'"),
    (["--tp", "2", "--transport", "nccl"], "argument --transport: invalid choice: 'nccl'"),
])
def test_demo_parallel_flags_refused(tmp_path, capsys, argv, msg):
    from zos.serving.cli import main

    try:
        rc = main(["demo", "--tiny", "--out", str(tmp_path), *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    cap = capsys.readouterr()
    assert msg in cap.err and cap.out == ""


@pytest.mark.parametrize("kind", ["zos", "host"])
@pytest.mark.parametrize("padded", [3, 4, 5])
def test_runner_dummy_step_writes_no_kv_and_samples_nothing(llama, kind, padded):
    """GraphRunner.decode with N = 0: refused without min_padded_size; with it every row is a
    dummy row, the KV caches and ``sampled`` are untouched, and the next step's rows are new."""
    from zos.serving.models import allocate_kv_cache
    from zos.serving.runner import GraphRunner

    bufs = DecodeBuffers(6, 4, 4, device=DEVICE)
    kw = dict(num_kv_blocks=12, vocab_size=LLAMA_CFG.vocab_size, buckets=BucketTable([2, 4]))
    backend = DeviceMetadataBackend(bufs, **kw) if kind == "zos" else HostMetadataBackend(
        bufs, **kw)
    c = LLAMA_CFG
    caches = allocate_kv_cache(c.num_hidden_layers, 12, 4, c.num_key_value_heads, c.head_dim,
                               torch.float32, DEVICE)
    runner = GraphRunner(llama, caches, backend, use_cuda_graph=False)
    runner.decode(DecodeStep.build([4, 9], {0: (5, 0, [1]), 1: (6, 3, [2])}))
    with pytest.raises(ValueError, match="empty step"):
        runner.decode(DecodeStep.build([]))
    kv, sampled = [t.clone() for t in caches], bufs.sampled.clone()
    res = runner.decode(DecodeStep.build([]), min_padded_size=padded)
    assert (res.num_reqs, res.padded_size, res.bucket) == (0, padded, 4 if padded == 4 else None)
    assert bufs.slot_mapping[:padded].tolist() == [-1] * padded
    assert bufs.counts.tolist() == [0, 0]
    assert torch.equal(bufs.sampled, sampled)
    assert all(torch.equal(a, b) for a, b in zip(caches, kv))
    with pytest.raises(ValueError):  # request 4 was dropped: it must come back with payload
        runner.decode(DecodeStep.build([4]))
