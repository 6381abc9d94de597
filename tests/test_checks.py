"""One check per rule: each argument rule has one helper, and every public call that takes the
argument from its caller raises that helper's error (type, field name and value in the message)
before anything is written."""
import numpy as np
import pytest
import torch

from zos import BucketTable, DecodeBuffers, DeviceMetadataBackend, PaddingProfile, kernels
from zos._checks import NotAnIntError, check_int
from zos.graphs import GraphCache
from zos.serving.kv_blocks import BlockAllocator
from zos.serving.models.attention import allocate_kv_cache
from zos.serving.models.parallel import shard_state_dict, tp_config
from zos.serving.shm_ring import StepRing
from zos.spec import SpecDecoder
from zos.staging_ring import StagingRing
from zos.step import DecodeStep

from helpers import DEVICE, LLAMA_CFG

R, W, BS = 5, 4, 4  # buffers: max_num_reqs, max_num_blocks_per_req, block_size


def snapshot(buffers):
    return {k: v.clone() for k, v in vars(buffers).items() if isinstance(v, torch.Tensor)}


def unchanged(buffers, before):
    return all(torch.equal(before[k], getattr(buffers, k)) for k in before)


@pytest.mark.parametrize("value", [2.0, True, np.bool_(True), "4", None, [4]])
def test_check_int_type(value):
    """A non-int is a NotAnIntError: a TypeError (and a ValueError) naming the field."""
    with pytest.raises(TypeError, match=r"^the_field: expected an int, got "):
        check_int("the_field", value)
    assert issubclass(NotAnIntError, ValueError)


@pytest.mark.parametrize("value,lo,ok", [(0, 1, False), (1, 1, True), (-1, 0, False),
                                         (np.int64(7), 1, True), (-5, None, True)])
def test_check_int_bound(value, lo, ok):
    if ok:
        out = check_int("f", value, lo)
        assert out == int(value) and type(out) is int
    else:
        with pytest.raises(ValueError, match=rf"^f: must be >= {lo}, got {value}$"):
            check_int("f", value, lo)


# --- the padded size: one rule, one helper, one message at every entry point ------------------

def padded_size_calls(q):
    """(name, call, lowest valid size) of each public call that takes a padded size."""
    bufs = DecodeBuffers(R, W, BS, uniform_decode_query_len=q, device=DEVICE)
    backend = DeviceMetadataBackend(bufs, num_kv_blocks=40, vocab_size=50)
    calls = [("views", lambda s: bufs.views(0, s), 0),
             ("launch_prep", lambda s: kernels.launch_prep(bufs, s), 1),
             ("build", backend.build, 0),  # build(0) is the empty step, no launch
             ("stage", lambda s: backend.stage(DecodeStep.build([]), min_padded_size=s), 0)]
    if q > 1:
        spec = SpecDecoder(bufs, num_kv_blocks=40, num_draft_tokens=q - 1)
        target = torch.zeros(R * q, dtype=torch.int32, device=DEVICE)
        calls += [("propose", spec.propose, 1),
                  ("verify", lambda s: spec.verify(target, s), 1)]
    return bufs, calls


def field_of(name):
    return "min_padded_size" if name == "stage" else "padded_size"


@pytest.mark.parametrize("q", [1, 3])
def test_padded_size_one_message_everywhere(q):
    """Every call refuses a size out of [lo, R * q] or not a multiple of q with the same
    message, naming the field and the value; nothing is written."""
    bufs, calls = padded_size_calls(q)
    top = R * q
    for name, call, lo in calls:
        for size in [top + q, -q, lo - 1, q + 1]:
            if lo <= size <= top and size % q == 0:  # q + 1 with q = 1
                continue
            before = snapshot(bufs)
            with pytest.raises(ValueError) as err:
                call(size)
            assert str(err.value) == (f"{field_of(name)} must be a multiple of "
                                      f"uniform_decode_query_len={q} in [{lo}, {top}], "
                                      f"got {size}"), name
            assert unchanged(bufs, before), (name, size)


@pytest.mark.parametrize("bad", [2.0, True, "4", None])
def test_padded_size_not_an_int(bad):
    bufs, calls = padded_size_calls(2)
    for name, call, _ in calls:
        before = snapshot(bufs)
        with pytest.raises(TypeError, match=rf"^{field_of(name)}: expected an int, got "):
            call(bad)
        assert unchanged(bufs, before), name


def test_padded_size_accepts_numpy_ints():
    bufs = DecodeBuffers(R, W, BS, uniform_decode_query_len=2, device=DEVICE)
    assert bufs.check_padded_size(np.int64(4)) == 4
    md = bufs.views(0, np.int32(6))
    assert md.padded_size == 6 and type(md.padded_size) is int and md.seq_lens.shape == (3,)


# --- the pad values: checked by PaddingProfile alone, DecodeBuffers' overrides included -------

@pytest.mark.parametrize("field,value,exc,match", [
    ("seq_len_fill", 0, ValueError, r"seq_len_fill must be >= 1 \(0 has produced NaN\), got 0"),
    ("pad_token_id", -1, ValueError, "pad_token_id must be a valid token id, got -1"),
    ("seq_len_fill", 1.5, TypeError, "seq_len_fill: expected an int, got 1.5"),
    ("pad_token_id", True, TypeError, "pad_token_id: expected an int, got True"),
])
def test_buffer_overrides_checked_by_the_profile(field, value, exc, match):
    """DecodeBuffers' pad_token_id / seq_len_fill overrides get PaddingProfile's message."""
    with pytest.raises(exc, match=match):
        DecodeBuffers(R, W, BS, device=DEVICE, **{field: value})
    with pytest.raises(exc, match=match):
        PaddingProfile("p", **{field: value})


def test_profile_takes_numpy_ints_as_ints():
    p = PaddingProfile("p", pad_slot_id=np.int64(-1), seq_len_fill=np.int32(2))
    assert (p.pad_slot_id, p.seq_len_fill) == (-1, 2)
    assert type(p.pad_slot_id) is int and type(p.seq_len_fill) is int
    bufs = DecodeBuffers(R, W, BS, device=DEVICE, pad_token_id=np.int64(7))
    assert bufs.padding.pad_token_id == 7 and bufs.input_ids.tolist() == [7] * R


# --- the constructors' int arguments: check_int's message -------------------------------------

def _spec(**kw):
    bufs = DecodeBuffers(R, W, BS, uniform_decode_query_len=2, device=DEVICE)
    return SpecDecoder(bufs, **{"num_kv_blocks": 40, "num_draft_tokens": 1, **kw})


INT_ARGS = [
    ("max_num_reqs", 1, lambda v: DecodeBuffers(v, W, BS, device=DEVICE)),
    ("max_num_blocks_per_req", 1, lambda v: DecodeBuffers(R, v, BS, device=DEVICE)),
    ("block_size", 1, lambda v: DecodeBuffers(R, W, v, device=DEVICE)),
    ("uniform_decode_query_len", 1,
     lambda v: DecodeBuffers(R, W, BS, uniform_decode_query_len=v, device=DEVICE)),
    ("num_slots", 1, lambda v: StagingRing(v, 8, torch.device("cpu"))),
    ("slot_words", 1, lambda v: StagingRing(2, v, torch.device("cpu"))),
    ("ring_slots", 1, lambda v: DeviceMetadataBackend(DecodeBuffers(R, W, BS, device=DEVICE),
                                                      num_kv_blocks=40, vocab_size=50,
                                                      staging="mapped", ring_slots=v)),
    ("n", 1, lambda v: BucketTable([1, 2, 4]).padded_size(v)),
    ("size", 1, lambda v: GraphCache(lambda s: None).capture(v)),
    ("num_kv_blocks", 2, lambda v: BlockAllocator(v)),
    ("num_kv_blocks", 2, lambda v: _spec(num_kv_blocks=v)),
    ("min_n", 1, lambda v: _spec(min_n=v)),
    ("max_n", 1, lambda v: _spec(max_n=v)),
    ("num_blocks", 1, lambda v: PaddingProfile.transformers(v, 8)),
    ("block_size", 1, lambda v: PaddingProfile.transformers(9, v)),
    ("allocate_kv_cache: num_kv_blocks", 1,
     lambda v: allocate_kv_cache(1, v, 4, 1, 8, torch.float32, "cpu")),
    ("world_size", 1, lambda v: tp_config(LLAMA_CFG, v)),
    ("rank", 0, lambda v: shard_state_dict({}, LLAMA_CFG, v, 2)),
    ("num_slots", 1, lambda v: StepRing.create(2, v, 64)),  # refused before a file is made
    ("slot_bytes", 0, lambda v: StepRing.create(2, 2, v)),
]


@pytest.mark.parametrize("field,lo,call", INT_ARGS, ids=[a[0] for a in INT_ARGS])
def test_int_arguments(field, lo, call):
    """Below the bound: ValueError naming the field and value; not an int: TypeError (a
    NotAnIntError, which is also a ValueError, as these calls raised before)."""
    with pytest.raises(ValueError, match=rf"{field}: must be >= {lo}, got {lo - 1}$"):
        call(lo - 1)
    for bad in (float(lo), True, str(lo)):
        with pytest.raises(NotAnIntError, match=rf"{field}: expected an int, got {bad!r}"):
            call(bad)
