"""The overlapped engine (host one step ahead): tokens equal the synchronous engine's and a
per-request greedy reference, for both metadata backends, through eos finishes discovered one
step late, length finishes, preemption with steps in flight, and mid-run admissions."""
import random

import numpy as np
import pytest

from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.readback import SampledReadback

from helpers import DEVICE, LLAMA_BLOCK_SIZE, LLAMA_CFG, greedy_reference

VOCAB = LLAMA_CFG.vocab_size


def requests(seed: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
                    rng.randint(1, 14)) for i in range(n)]


def truncate(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("backend", ["zos", "host"])
def test_overlap_matches_sync_and_reference(llama, backend):
    reqs = requests(3, 9)
    # An eos that some requests emit mid-way, found from the reference itself.
    refs = {r.req_id: greedy_reference(llama, r.prompt, r.max_new_tokens) for r in reqs}
    eos = max(set(t for out in refs.values() for t in out[1:-1]),
              key=lambda t: sum(t in out[1:-1] for out in refs.values()))
    want = {i: truncate(out, eos) for i, out in refs.items()}
    assert any(len(want[i]) < len(refs[i]) for i in refs), "some request must stop on eos"
    got, preempted = {}, {}
    for overlap in (False, True):
        cfg = EngineConfig(block_size=LLAMA_BLOCK_SIZE, num_kv_blocks=14, max_num_seqs=4,
                           max_model_len=24, max_prefill_tokens=16, eos_token_id=eos,
                           backend=backend, buckets=[2, 4])
        engine = Engine(llama, cfg, DEVICE, overlap=overlap)
        fresh = [Request(r.req_id, list(r.prompt), r.max_new_tokens) for r in reqs]
        got[overlap] = engine.run(fresh).outputs
        preempted[overlap] = engine.num_preemptions
        assert engine.allocator.num_free == cfg.num_kv_blocks - 1, "blocks leaked"
        assert not engine.readback.pending and not engine.has_unfinished()
    assert got[False] == want and got[True] == want
    assert preempted[True] > 0, "the overlapped run must preempt with a step in flight"


def test_readback_ring_refuses_overrun():
    import torch

    rb = SampledReadback(4, torch.device(DEVICE), depth=2)
    sampled = torch.arange(4, dtype=torch.int32, device=DEVICE)
    rb.push(sampled, ["a", "b"])
    rb.push(sampled + 10, ["c"])
    with pytest.raises(ValueError, match="pending"):
        rb.push(sampled, ["d"])
    rows, values = rb.pop()
    assert rows == ["a", "b"] and values.dtype == np.int32 and values.tolist() == [0, 1]
    rows, values = rb.pop()
    assert rows == ["c"] and values.tolist() == [10]


@pytest.mark.parametrize("spans, want", [
    ([], (0.0, 0.0, 0.0)),
    ([(5.0, 7.0)], (2.0, 2.0, 0.0)),
    ([(0.0, 10.0), (2.0, 4.0), (11.0, 12.0)], (11.0, 12.0, 0.0)),  # nested, short gap
    ([(100.0, 110.0), (0.0, 10.0), (50.0, 60.0)], (30.0, 110.0, 80.0)),  # unsorted, long gaps
    ([(0.0, 5.0), (3.0, 9.0), (29.0, 30.0), (49.5, 50.0), (70.5, 71.0)],
     (11.0, 71.0, 20.5)),  # a gap of exactly 20 is not long, 20.5 is
])
def test_profiler_timeline(spans, want):
    """GPU busy time is the union of activity intervals; only gaps > 20 us count as long."""
    from zos.serving.profiling import timeline

    assert timeline(spans) == want
