"""The shared-memory step ring, its message encoding and the DP slot agreement, in one process
(a reader attached to the writer's file; a thread plays the other DP rank): messages come out
exactly as they went in, in order, across slot reuse; a writer never overwrites an unread slot
and a reader that does not read makes it raise PeerRankFailed naming that rank at the timeout;
a dead process is seen as dead (a zombie too); the agreement is the element-wise max.
Several processes: tests/test_distributed.py."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from zos.buffers import DecodeBuffers
from zos.serving import step_codec as codec
from zos.serving.dist_transport import check_transport, step_slot_bytes
from zos.serving.shm_agreement import SlotAgreement
from zos.serving.shm_ring import FAILED, PeerRankFailed, StepRing, pid_alive
from zos.step import DecodeStep

from helpers import TraceGen

FIELDS = ("req_ids", "new_rows", "new_tokens", "new_positions", "new_block_indptr",
          "new_block_ids", "append_rows", "append_block_ids")


@pytest.fixture
def ring_pair():
    """A writer (rank 0) and one reader (rank 1) of a 3-slot ring, file already unlinked."""
    made = []

    def make(num_slots=3, slot_bytes=4096, timeout_s=0.5, world=2):
        w = StepRing.create(world, num_slots, slot_bytes, what="tensor parallelism",
                            timeout_s=timeout_s, spin_s=0.01)
        readers = [StepRing(w.path, r, world, what="tensor parallelism",
                            timeout_s=timeout_s, spin_s=0.01) for r in range(1, world)]
        w.unlink()
        made.extend([w, *readers])
        return w, readers

    yield make
    for seg in made:
        seg.close()


def _same_step(a: DecodeStep, b: DecodeStep) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), f


@pytest.mark.parametrize("seed", [3, 11])
def test_steps_of_a_trace_come_out_exactly(ring_pair, seed):
    """60 steps of a seeded trace (arrivals, preemption, appends, growth past a bucket) with
    random min_padded_size, through a 3-slot ring (every slot reused 20 times)."""
    w, (r,) = ring_pair()
    gen = TraceGen(seed, max_num_reqs=13, block_size=4, max_blocks=7, num_kv_blocks=90,
                   vocab=50)
    rng = np.random.default_rng(seed)
    for _ in range(60):
        step, _ = gen.next_step()
        mp = int(rng.integers(0, 17))
        w.publish(*codec.encode_decode(step, mp))
        kind, got, padded = codec.decode_message(*r.receive())
        assert (kind, padded) == ("decode", mp)
        _same_step(got, step)


@pytest.mark.parametrize("lens", [[1], [3, 5, 2], [7, 1, 1, 9, 4]])
def test_prefill_accepted_and_stop_messages(ring_pair, lens):
    w, (r,) = ring_pair()
    rng = np.random.default_rng(len(lens))
    seqs = [(rng.integers(0, 100, n).tolist(), rng.integers(1, 40, -(-n // 4)).tolist())
            for n in lens]
    acc = rng.integers(1, 4, len(lens)).astype(np.int32)
    w.publish(*codec.encode_prefill(seqs))
    w.publish(*codec.encode_accepted(acc, 1))
    w.publish(codec.STOP, (), [])
    assert codec.decode_message(*r.receive()) == ("prefill", seqs)
    kind, got, steps_ago = codec.decode_message(*r.receive())
    assert (kind, got.tolist(), steps_ago) == ("accepted", acc.tolist(), 1)
    assert codec.decode_message(*r.receive()) == ("stop",)


def test_every_reader_must_read_before_a_slot_is_reused(ring_pair):
    """Two readers, two slots: the third message waits for both; the reader that read nothing
    is named at the timeout, nothing of the unread slot was overwritten."""
    w, (r1, r2) = ring_pair(num_slots=2, timeout_s=0.3, world=3)
    steps = [DecodeStep.build([i, i + 1]) for i in range(3)]
    for s in steps[:2]:
        w.publish(*codec.encode_decode(s, 0))
    for _ in range(2):
        r1.receive()
    with pytest.raises(PeerRankFailed, match=r"tensor parallelism: rank 2 did not read message "
                                             r"1 within 0.3 s \(lagging or hung\)") as e:
        w.publish(*codec.encode_decode(steps[2], 0))
    assert e.value.rank == 2
    _same_step(codec.decode_message(*r2.receive())[1], steps[0])  # still intact
    w.publish(*codec.encode_decode(steps[2], 0))  # the slot is free now
    _same_step(codec.decode_message(*r2.receive())[1], steps[1])
    for r in (r1, r2):
        _same_step(codec.decode_message(*r.receive())[1], steps[2])


def test_reader_waiting_on_a_silent_or_failed_writer(ring_pair):
    w, (r,) = ring_pair(timeout_s=0.3)
    with pytest.raises(PeerRankFailed, match="rank 0 did not publish message 1 within 0.3 s"):
        r.receive()
    w.set_state(FAILED)
    with pytest.raises(PeerRankFailed, match="rank 0 failed; rank 1 stops too") as e:
        r.receive()
    assert e.value.rank == 0


def test_writer_stops_at_once_at_a_reader_that_failed(ring_pair):
    """A reader that marked itself FAILED (its runner raised) stops the writer's next publish,
    though a slot is free (timeout 30 s: not reached)."""
    w, (r,) = ring_pair(timeout_s=30.0)
    w.publish(codec.STOP, (), [])
    r.set_state(FAILED)
    with pytest.raises(PeerRankFailed, match="tensor parallelism: rank 1 failed; rank 0 stops "
                                             "too") as e:
        w.publish(codec.STOP, (), [])
    assert e.value.rank == 1 and w.next_seq == 2


def test_message_bigger_than_a_slot_is_refused_before_writing(ring_pair):
    w, (r,) = ring_pair(slot_bytes=64)
    big = DecodeStep.build(list(range(9)))  # 72 bytes of req_ids, 4 of new_block_indptr
    with pytest.raises(OverflowError, match="76 bytes do not fit a ring slot of 64"):
        w.publish(*codec.encode_decode(big, 0))
    assert w.next_seq == 1
    w.publish(*codec.encode_decode(DecodeStep.build([4]), 0))
    assert codec.decode_message(*r.receive())[1].req_ids.tolist() == [4]


def test_unknown_message_kind_refused():
    with pytest.raises(ValueError, match="unknown message kind 9"):
        codec.decode_message(9, np.zeros(5, np.int64), np.zeros(0, np.uint8))


@pytest.mark.parametrize("rows, width, bs", [(5, 3, 4), (1, 1, 1), (7, 9, 16)])
def test_slot_holds_the_largest_runner_calls(rows, width, bs):
    """step_slot_bytes of the buffers: a full decode step (every row new with every block, and
    every row appending every block) and a full prefill fit exactly or with room."""
    b = DecodeBuffers(rows, width, bs)
    full = DecodeStep.build(list(range(rows)), {i: (1, 0, [1] * width) for i in range(rows)},
                            [(i, 2) for i in range(rows) for _ in range(width)])
    pre = [([1] * (width * bs), [1] * width)] * rows
    sizes = [sum(a.nbytes for a in codec.encode_decode(full, 0)[2]),
             sum(a.nbytes for a in codec.encode_prefill(pre)[2])]
    assert step_slot_bytes(b) == max(sizes)


@pytest.mark.parametrize("world", [2, 3])
def test_slot_agreement_is_the_elementwise_max(world):
    """``world`` ranks (threads) agree 40 rounds on seeded values; every rank gets the max."""
    a0 = SlotAgreement.create(world, timeout_s=10.0, spin_s=0.001)
    ranks = [a0] + [SlotAgreement(a0.path, r, world, timeout_s=10.0, spin_s=0.001)
                    for r in range(1, world)]
    a0.unlink()
    rng = np.random.default_rng(world)
    vals = rng.integers(0, 100, (40, world, 3))
    got = [[] for _ in range(world)]

    def run(r):
        for i in range(40):
            got[r].append(ranks[r].all_max(vals[i, r].tolist()).tolist())

    threads = [threading.Thread(target=run, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    want = vals.max(axis=1).tolist()
    assert all(g == want for g in got)


def test_slot_agreement_names_a_rank_that_never_comes():
    a0 = SlotAgreement.create(2, what="data parallelism", timeout_s=0.3, spin_s=0.01)
    a1 = SlotAgreement(a0.path, 1, 2, what="data parallelism")
    a0.unlink()
    with pytest.raises(PeerRankFailed, match="data parallelism: rank 1 did not reach agreement "
                                             "1 within 0.3 s"):
        a0.all_max((4, 1, 0))
    del a1


def test_pid_alive_sees_exited_and_zombie_processes():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    while True:  # exited but not reaped: a zombie
        with open(f"/proc/{p.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
    assert not pid_alive(p.pid)
    p.wait()
    assert not pid_alive(p.pid)
    assert pid_alive(os.getpid())


@pytest.mark.parametrize("bad", ["nccl", None, 1])
def test_unknown_transport_refused(bad):
    with pytest.raises(ValueError, match="transport: expected one of"):
        check_transport(bad)


def test_transport_across_hosts():
    """Ranks on two hosts: "auto" takes the collective and "shm" is refused, both before any
    collective or file (the peers' hosts were gathered at setup)."""
    from zos.serving import dist_transport as T

    peers = T._Peers.__new__(T._Peers)
    peers.rank, peers.hosts, peers.pids = 0, ["a/1", "b/2"], [1, 2]
    peers.same_host = False

    def never():
        raise AssertionError("no file across hosts")

    assert T._open_segment(None, "auto", peers, never, never, "tensor parallelism") is None
    with pytest.raises(ValueError, match=r"tensor parallelism: transport 'shm' needs every "
                                         r"rank on one host, got hosts \['a/1', 'b/2'\]"):
        T._open_segment(None, "shm", peers, never, never, "tensor parallelism")
