"""The n-gram drafter and the greedy verifier (zos/spec.py) against plain Python references, on
paged histories (random block tables), odd row counts, dummy rows left untouched."""
import numpy as np
import pytest
import torch

from zos import DecodeBuffers
from zos.spec import SpecDecoder

from helpers import DEVICE


def ngram_reference(hist, k, min_n, max_n):
    """Latest earlier occurrence of the longest suffix n-gram (n = max_n .. min_n); the k tokens
    after it, padded with the last token; the last token k times without a match."""
    for n in range(max_n, min_n - 1, -1):
        if len(hist) <= n:
            continue
        for s in range(len(hist) - 1 - n, -1, -1):
            if hist[s:s + n] == hist[len(hist) - n:]:
                prop = hist[s + n:s + n + k]
                return prop + [hist[-1]] * (k - len(prop))
    return [hist[-1]] * k


def verify_reference(drafts, target):
    """Tokens kept: target[0..a-1], a = 1 + the longest prefix of drafts equal to target."""
    a = 1
    while a - 1 < len(drafts) and drafts[a - 1] == target[a - 1]:
        a += 1
    return target[:a]


def setup(seed, n, padded_reqs, k, *, bs=4, width=100, vocab=3, max_pos=300):
    """Buffers after prep for n real rows with random paged histories; returns them, the
    decoder and each row's history (last token = row 0's token)."""
    rng = np.random.default_rng(seed)
    q = 1 + k
    bufs = DecodeBuffers(padded_reqs + 2, width, bs, uniform_decode_query_len=q, device=DEVICE)
    num_blocks = (padded_reqs + 2) * width + 1
    spec = SpecDecoder(bufs, num_kv_blocks=num_blocks, num_draft_tokens=k)
    perm = rng.permutation(np.arange(1, num_blocks))
    tc = rng.integers(0, 50, num_blocks * bs).astype(np.int32)  # stale garbage everywhere
    ids = np.full(bufs.input_ids.numel(), -5, np.int32)
    pos = np.zeros_like(ids)
    slots = np.full(ids.shape, -1, np.int64)
    table = np.zeros((padded_reqs + 2, width), np.int32)
    hists = []
    for r in range(n):
        length = int(rng.integers(1, max_pos))
        if r % 3 == 0:  # a repeating pattern: long matches
            period = int(rng.integers(2, 7))
            base = rng.integers(0, vocab, period)
            h = [int(base[i % period]) for i in range(length)]
        else:
            h = rng.integers(0, vocab, length).tolist()
        blocks = perm[r * width:(r + 1) * width]
        table[r] = blocks
        p0 = length - 1
        for p in range(p0):  # the history the cache holds; position p0 is row 0's input
            tc[blocks[p // bs] * bs + p % bs] = h[p]
        ids[r * q] = h[-1]
        for t in range(q):
            pos[r * q + t] = p0 + t
            slots[r * q + t] = blocks[(p0 + t) // bs] * bs + (p0 + t) % bs
        hists.append(h)
    for name, v in (("input_ids", ids), ("positions", pos), ("slot_mapping", slots),
                    ("block_table", table)):
        getattr(bufs, name).copy_(torch.from_numpy(v))
    bufs.counts.copy_(torch.tensor([n, n * q], dtype=torch.int32))
    spec.token_cache.copy_(torch.from_numpy(tc))
    return bufs, spec, hists, tc


@pytest.mark.parametrize("k,n,padded,min_n,max_n,seed", [
    (1, 5, 7, 1, 3, 0), (2, 17, 17, 1, 3, 1), (4, 5, 8, 2, 3, 2), (3, 7, 9, 1, 1, 3),
    (4, 1, 1, 1, 4, 4)])
def test_propose_matches_reference(k, n, padded, min_n, max_n, seed):
    bufs, spec, hists, tc = setup(seed, n, padded, k)
    spec.min_n, spec.max_n = min_n, max_n
    q = 1 + k
    before = bufs.input_ids.cpu().numpy().copy()
    spec.propose(padded * q)
    got = bufs.input_ids.cpu().numpy()
    for r, h in enumerate(hists):
        assert got[r * q] == h[-1]
        assert got[r * q + 1:(r + 1) * q].tolist() == ngram_reference(h, k, min_n, max_n), r
    assert got[n * q:].tolist() == before[n * q:].tolist()  # dummy rows untouched
    # the token cache gained row 0's token at its slot, nothing else changed
    want = tc.copy()
    slots = bufs.slot_mapping.cpu().numpy()
    for r, h in enumerate(hists):
        want[slots[r * q]] = h[-1]
    assert spec.token_cache.cpu().numpy().tolist() == want.tolist()


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("k,n,padded,seed", [(1, 5, 6, 0), (2, 17, 19, 1), (4, 7, 8, 2)])
def test_verify_matches_reference(k, n, padded, seed, strided):
    bufs, spec, hists, tc = setup(seed, n, padded, k, max_pos=40)
    rng = np.random.default_rng(seed + 100)
    q = 1 + k
    ids = bufs.input_ids.cpu().numpy()
    target = rng.integers(0, 3, padded * q).astype(np.int32)
    for r in range(n):  # drafts: all accepted, all rejected, or a random prefix
        mode = r % 3
        drafts = target[r * q:r * q + k].copy()
        if mode == 1:
            drafts = (drafts + 1) % 3
        elif mode == 2:
            cut = int(rng.integers(0, k + 1))
            drafts[cut:] = (drafts[cut:] + 1) % 3
        ids[r * q + 1:(r + 1) * q] = drafts
    bufs.input_ids.copy_(torch.from_numpy(ids))
    bufs.sampled.fill_(-3)
    bufs.accepted.fill_(-4)
    spec.output.fill_(-6)
    target_t = torch.from_numpy(target).to(DEVICE)
    if strided:  # every other entry of a wider tensor (e.g. one column of [T, 2])
        wide = torch.full((2 * len(target),), 99, dtype=torch.int32, device=DEVICE)
        wide[1::2] = target_t
        target_t = wide[1::2]
    spec.verify(target_t, padded * q)
    acc, smp, out = bufs.accepted.cpu(), bufs.sampled.cpu(), spec.output.cpu()
    slots = bufs.slot_mapping.cpu().numpy()
    want_tc = tc.copy()
    for r in range(n):
        kept = verify_reference(ids[r * q + 1:(r + 1) * q].tolist(),
                                target[r * q:(r + 1) * q].tolist())
        a = len(kept)
        assert (acc[r].item(), smp[r].item(), out[r, 0].item()) == (a, kept[-1], a), r
        assert out[r, 1:1 + a].tolist() == kept and out[r, 1 + a:].tolist() == [-6] * (q - a)
        for t in range(a):
            want_tc[slots[r * q + t]] = ids[r * q + t]
    modes = {len(verify_reference(ids[r * q + 1:(r + 1) * q].tolist(),
                                  target[r * q:(r + 1) * q].tolist())) for r in range(n)}
    assert 1 in modes and q in modes  # all rejected and all accepted both occur
    assert acc[n:].tolist() == [-4] * (len(acc) - n) and smp[n:].tolist() == [-3] * (len(smp) - n)
    assert out[n:].flatten().tolist() == [-6] * ((len(acc) - n) * (q + 1))
    assert spec.token_cache.cpu().numpy().tolist() == want_tc.tolist()


def test_errors():
    bufs = DecodeBuffers(4, 8, 4, uniform_decode_query_len=3, device=DEVICE)
    with pytest.raises(ValueError, match="1 \\+ num_draft_tokens = 2"):
        SpecDecoder(bufs, num_kv_blocks=10, num_draft_tokens=1)
    with pytest.raises(ValueError, match="num_draft_tokens: must be >= 1, got 0"):
        SpecDecoder(bufs, num_kv_blocks=10, num_draft_tokens=0)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="num_draft_tokens: expected an int"):
            SpecDecoder(bufs, num_kv_blocks=10, num_draft_tokens=bad)
    with pytest.raises(ValueError, match="min_n"):
        SpecDecoder(bufs, num_kv_blocks=10, num_draft_tokens=2, min_n=3, max_n=2)
    spec = SpecDecoder(bufs, num_kv_blocks=10, num_draft_tokens=2)
    with pytest.raises(ValueError, match="padded_size"):
        spec.propose(4)
    with pytest.raises(ValueError, match="target must be int32"):
        spec.verify(torch.zeros(6, dtype=torch.int64, device=DEVICE), 6)
    with pytest.raises(ValueError, match=r"target must be int32 1-D \[>= 6\]"):
        spec.verify(torch.zeros(6, 1, dtype=torch.int32, device=DEVICE), 6)
    with pytest.raises(ValueError, match="past the token cache"):
        spec.write_history(torch.zeros(2, dtype=torch.int32, device=DEVICE),
                           torch.tensor([0, 40], device=DEVICE))
