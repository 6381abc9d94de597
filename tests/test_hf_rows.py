"""zos's rows inside transformers (zos/integrations/hf_rows.py) on fake request states: which
requests are carried, what a new row stages, and where a token still in flight is taken from
under asynchronous batching (transformers' output order, not its input positions)."""
import zos._interpret  # noqa: F401  (before anything imports triton)

from types import SimpleNamespace

import pytest
import torch

from zos.integrations import hf_rows
from zos.integrations.hf_internals import TF517
from zos.integrations.hf_rows import TMP_TOKEN_ID, ZosDecodeRows
from zos.integrations.transformers import ZosOptions

from helpers import DEVICE

BS = 4


@pytest.fixture(autouse=True)
def cache_of_517_shape(monkeypatch):
    """The fake caches below have transformers 5.17's shape: read through its adapter whatever
    transformers is installed."""
    monkeypatch.setattr(hf_rows, "internals", TF517)


def fake_cache(tables):
    return SimpleNamespace(num_groups=1, num_sliding_attention_groups=0, block_size=BS,
                           num_blocks=32, num_pages=32 * BS,
                           group_cache_managers=[SimpleNamespace(block_table=tables)])


def request(rid, pos, token):
    st = SimpleNamespace(request_id=rid, position_offset=pos, tokens_to_process=[token])
    return SimpleNamespace(state=st, query_length=1, has_new_token=True)


def rows_for(tables):
    cfg = SimpleNamespace(vocab_size=100, max_position_embeddings=64)
    return ZosDecodeRows(fake_cache(tables), cfg, 8, torch.device(DEVICE), None,
                         ZosOptions(bucket_policy=None), graphed=False, async_carry=True)


def test_tokens_in_flight_come_from_the_output_order():
    """After a prefill batch whose ``req_id_to_new_token_position`` maps b -> 2, a -> 9 (input
    positions of their last prompt tokens, in batch order), b's token is output 0 and a's
    output 1: the carry map says so, and only rows with a token in flight are in it. a's host
    token is stale (transformers' update of the batch before wrote it after the placeholder):
    it is not used."""
    tables = {"a": [3, 5], "b": [9], "c": [4]}
    rows = rows_for(tables)
    reqs = [request("b", 2, TMP_TOKEN_ID), request("c", 1, 42), request("a", 6, 77)]
    built = rows.build_step(reqs, {"b": 2, "a": 9})
    assert built.carry == [(0, 0), (2, 1)]
    assert built.step.new_rows.tolist() == [0, 1, 2]
    assert built.step.new_tokens.tolist() == [0, 42, 0]  # placeholders are valid ids
    assert built.step.new_positions.tolist() == [2, 1, 6]
    assert built.step.new_block_ids.tolist() == [9, 4, 3, 5]


def test_in_flight_token_without_source_or_sync_falls_back():
    """A token in flight that the previous batch did not sample, or any in-flight token in
    synchronous batching, is not guessed: the step goes to transformers' path (None)."""
    tables = {"a": [3]}
    rows = rows_for(tables)
    assert rows.build_step([request("a", 1, TMP_TOKEN_ID)], {"z": 0}) is None
    assert rows.build_step([request("a", 1, TMP_TOKEN_ID)], None) is None


@pytest.mark.parametrize("n", [1, 3, 7])
def test_carried_rows_stage_no_token_and_appends_only_crossed_blocks(n):
    """Step 2 carries every request of step 1 (same state, one position later): no new row;
    the requests that crossed into a new block append exactly that block."""
    tables = {f"r{i}": [10 + i] for i in range(n)}
    rows = rows_for(tables)
    reqs = [request(f"r{i}", 2 + i % 2, 5 + i) for i in range(n)]  # positions 2 or 3
    first = rows.build_step(reqs, None)
    rows.stage(first)
    for fs in reqs:
        fs.state.position_offset += 1
        fs.state.tokens_to_process = [TMP_TOKEN_ID]
        if fs.state.position_offset == BS:  # position 4 needs a second block
            tables[fs.state.request_id].append(20 + int(fs.state.request_id[1:]))
    second = rows.build_step(reqs, {f"r{i}": i for i in range(n)})
    assert second.carry is None and second.step.new_rows.tolist() == []
    crossed = [i for i in range(n) if i % 2 == 1]
    assert second.step.append_rows.tolist() == crossed
    assert second.step.append_block_ids.tolist() == [20 + i for i in crossed]


def test_in_graph_takes_tokens_in_flight_from_the_previous_output():
    """The device part of an asynchronous step: ``sampled`` is the previous output's first R
    entries; rows with a token in flight read it from the previous output at their index, the
    others keep their record token; the carry map is all -1 afterwards (the next replay of the
    same graph carries nothing unless the host says so)."""
    tables = {"a": [3, 5], "b": [9], "c": [4]}
    rows = rows_for(tables)
    reqs = [request("b", 2, TMP_TOKEN_ID), request("c", 1, 42), request("a", 6, 77)]
    md = rows.stage(rows.build_step(reqs, {"b": 2, "a": 9}))
    prev = torch.arange(100, 100 + 8 + 1, dtype=torch.int32, device=DEVICE).unsqueeze(0)
    rows.in_graph(md, prev)
    assert md.input_ids[:3].tolist() == [100, 42, 101]
    assert md.positions[:3].tolist() == [2, 1, 6]
    assert rows.buffers.sampled.tolist() == list(range(100, 108))
    assert rows.carry.tolist() == [-1] * 8


@pytest.mark.parametrize("release", ["5.17", "5.25"])
def test_model_kwargs_are_fresh_each_step_over_views_made_once(release):
    """A zos step's model kwargs: a new dict each call, nested lists and dicts included
    (transformers writes into them, e.g. its warm-up's ``max_length_k``), over views of zos's
    buffers made once per (metadata, sampled rows); a new processor-argument tensor or cache
    is taken as given."""
    from zos.integrations.hf_internals import TF525

    rows = rows_for({"a": [3, 5], "b": [9]})
    md = rows.stage(rows.build_step([request("a", 6, 7), request("b", 1, 8)], None))
    rows.tfi = TF517() if release == "5.17" else TF525()  # the step's kwargs in its names
    args = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    first = rows.model_kwargs(md, "cache", args, 2)
    for value in first.values():  # what transformers could write into
        if isinstance(value, dict):
            value["full_attention"] = 4096
        elif isinstance(value, list):
            value.append(0)
    first["logits_to_keep"] = 1
    again = rows.model_kwargs(md, "cache", args, 2)
    assert "logits_to_keep" not in again
    assert again["read_index"] == [] and again["write_index"] == []
    if release == "5.25":
        assert again["max_length_k"] == {"full_attention": 1}
        assert again["cu_seq_lens_k"]["full_attention"] is md.query_start_loc
    assert again["input_ids"] is first["input_ids"]  # the views are made once
    assert again["input_ids"].shape == again["position_ids"].shape == (1, md.padded_size)
    assert again["input_ids"].data_ptr() == md.input_ids.data_ptr()
    assert again["position_ids"].data_ptr() == md.positions.data_ptr()
    # the logits rows in_graph writes (zeros before it runs: compared as a view, not values)
    assert again["logits_indices"].data_ptr() == rows.logits_rows.data_ptr()
    assert again["logits_indices"].shape == (2,)
    assert again["logits_processor_args"].tolist() == args[:, :2].tolist()
    new_args = args + 100
    other = rows.model_kwargs(md, "other cache", new_args, 1)
    assert other["logits_processor_args"].tolist() == new_args[:, :1].tolist()
    assert other[rows.tfi.cache_kwarg] == "other cache"
    assert len(other["logits_indices"]) == 1
