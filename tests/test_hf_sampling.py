"""zos inside transformers' continuous batching with sampling and per-request options: the same
seed gives the same tokens as transformers' own continuous batching, with zos's buckets padding
decode steps to other row counts than transformers' (5 requests run 8 rows under the "vllm"
policy); ``return_logprobs`` equal within float32 tolerance; per-request temperature / top-k /
top-p (``ContinuousBatchingConfig.per_request_processors``), per-request ``max_new_tokens``
and ``eos_token_id``; ``num_return_sequences`` > 1 (transformers forks the request: its children
are new rows to zos); transformers' other logits processors in continuous batching. On CUDA
each also in transformers' best mode (graphs and asynchronous batching; a manager started
without a warm-up captures zos's graphs first, leaving the generator as it was).

transformers' sampler draws one random number per element of its ``[rows, vocab]``
probabilities (``torch.multinomial``), so the rows sampled must be transformers' rows, whatever
zos's padded size. Needs transformers 5.17.0 (the ``hf`` extra)."""
import zos._interpret  # noqa: F401  (before transformers imports triton)

import pytest
import torch

from helpers import DEVICE, require_transformers

require_transformers()

from transformers import (  # noqa: E402
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from zos.integrations.hf_internals import internals  # noqa: E402
from zos.integrations.transformers import ZosOptions, disable_zos, enable_zos  # noqa: E402

EOS = -1


def tiny_llama(seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to(device=DEVICE).eval()
    model.set_attn_implementation("sdpa")
    return model


def prompts(seed, lengths, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


# (use_cuda_graph, use_async_batching): on CUDA also transformers' best mode, graphs and async
MODES = {"sync": (False, False)}
if DEVICE == "cuda":
    MODES["graphs_async"] = (True, True)


def cb_config(mode="sync", **kw):
    graphs, asynchronous = MODES[mode]
    return ContinuousBatchingConfig(**{internals().page_field: 4}, num_blocks=96,
                                    max_requests_per_batch=16, max_batch_tokens=64,
                                    use_cuda_graph=graphs, use_async_batching=asynchronous, **kw)


def run(model, inputs, gen, zos, seed, cb=None, **kw):
    """{request id: GenerationOutput} of ``generate_batch`` after ``torch.manual_seed(seed)``
    (``cb``: a ContinuousBatchingConfig, default ``cb_config()``)."""
    if zos:
        enable_zos(model, ZosOptions(bucket_policy="vllm"))
    cb = cb or cb_config()
    torch.manual_seed(seed)
    try:
        return model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb,
                                    progress_bar=False, **kw)
    finally:
        disable_zos(model)


def tokens(out):
    return {k: v.generated_tokens for k, v in out.items()}


SAMPLING = [dict(), dict(temperature=0.7), dict(temperature=1.3, top_k=20, top_p=0.9)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("opts", SAMPLING, ids=["plain", "temperature", "top_k_top_p"])
@pytest.mark.parametrize("seed,lengths", [(0, (1, 5, 17, 3, 9)), (1, (2, 11, 4, 6, 8, 3, 1, 7, 5))])
def test_seeded_sampling_equals_transformers(opts, seed, lengths, mode):
    """5 requests (padded to 8 rows by zos's buckets) and 9 (to 16): same seed, same tokens;
    a second seed gives other tokens (the test would see a sampler that ignores the seed).
    On CUDA also in transformers' best mode (graphs and async; zos's warm-up of its buckets
    leaves the generator as transformers' own warm-up does)."""
    model = tiny_llama(seed)
    inputs = prompts(seed, lengths)
    gen = GenerationConfig(max_new_tokens=8, do_sample=True, eos_token_id=EOS, pad_token_id=0,
                           **opts)
    cb = cb_config(mode)
    theirs = tokens(run(model, inputs, gen, False, 100 + seed, cb))
    assert theirs == tokens(run(model, inputs, gen, False, 100 + seed, cb))  # seeded
    assert tokens(run(model, inputs, gen, True, 100 + seed, cb)) == theirs
    assert tokens(run(model, inputs, gen, True, 200 + seed, cb)) != theirs


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_equal_transformers(mode):
    model = tiny_llama(4)
    inputs = prompts(4, (3, 8, 1, 12, 5))
    gen = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.8, eos_token_id=EOS,
                           pad_token_id=0)
    cb = cb_config(mode, return_logprobs=True)
    theirs = run(model, inputs, gen, False, 7, cb)
    ours = run(model, inputs, gen, True, 7, cb)
    assert tokens(ours) == tokens(theirs)
    for k, out in theirs.items():
        assert len(out.logprobs) == 6
        torch.testing.assert_close(torch.tensor(ours[k].logprobs), torch.tensor(out.logprobs),
                                   rtol=1e-5, atol=1e-5)


def manager_results(model, gen, cb, zos, seed, requests, expect, after_start=None):
    """{request id: tokens} of ``expect`` finished requests (forks included) of a manager fed
    ``requests`` ([(prompt, add_request kwargs)]) after ``torch.manual_seed(seed)``;
    ``after_start``: called once the manager has started, before the first request."""
    if zos:
        enable_zos(model, ZosOptions(bucket_policy="vllm"))
    torch.manual_seed(seed)
    got = {}
    try:
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=cb)
        manager.start()
        if after_start is not None:
            after_start()
        for i, (p, kw) in enumerate(requests):
            manager.add_request(p, request_id=f"r{i}", **kw)
        while len(got) < expect:
            res = manager.get_result(timeout=120)
            assert res is not None and res.error is None
            if res.is_finished():
                got[res.request_id] = res.generated_tokens
        manager.stop(block=True)
    finally:
        disable_zos(model)
    return got


@pytest.mark.parametrize("mode", MODES)
def test_per_request_options_equal_transformers(mode):
    """Per-request temperature / top-k / top-p, max_new_tokens and eos_token_id through the
    manager's add_request: same seed, same tokens, each request as long as its own limits say."""
    model = tiny_llama(5)
    inputs = prompts(5, (4, 9, 2, 7, 3, 6))
    # a processor exists only for an option whose default is set (transformers' rule)
    gen = GenerationConfig(max_new_tokens=12, do_sample=True, eos_token_id=EOS, pad_token_id=0,
                           temperature=0.9, top_k=50, top_p=0.95)
    per_req = [dict(temperature=0.5, max_new_tokens=9), dict(top_k=5, max_new_tokens=4),
               dict(top_p=0.8, temperature=1.5, max_new_tokens=12),
               dict(max_new_tokens=7, eos_token_id=11), dict(temperature=0.9, top_k=30),
               dict(max_new_tokens=3)]
    reqs = list(zip(inputs, per_req))
    cb = cb_config(mode, per_request_processors=True)
    theirs = manager_results(model, gen, cb, False, 11, reqs, len(reqs))
    ours = manager_results(model, gen, cb, True, 11, reqs, len(reqs))
    assert ours == theirs
    for i, kw in enumerate(per_req):
        toks = ours[f"r{i}"]
        if "eos_token_id" in kw and kw["eos_token_id"] in toks:
            assert toks.index(kw["eos_token_id"]) == len(toks) - 1
        else:
            assert len(toks) == kw.get("max_new_tokens", 12)


@pytest.mark.parametrize("mode", MODES)
def test_num_return_sequences_equal_transformers(mode):
    """3 prompts x 3 sequences: transformers forks each request after its prefill; the 9 rows
    (parents and children) are padded to 16 by zos. Every sequence equals transformers'."""
    model = tiny_llama(6)
    reqs = [(p, {}) for p in prompts(6, (5, 9, 3))]
    gen = GenerationConfig(max_new_tokens=6, do_sample=True, eos_token_id=EOS, pad_token_id=0,
                           num_return_sequences=3)
    theirs = manager_results(model, gen, cb_config(mode), False, 3, reqs, 9)
    assert len(theirs) == 9 and len({tuple(t) for t in theirs.values()}) > 3
    assert manager_results(model, gen, cb_config(mode), True, 3, reqs, 9) == theirs


# transformers' other logits processors in continuous batching: repetition penalty and the
# min-length processors are dropped by transformers (supports_continuous_batching False), the
# rest are kept and called with the step's input token of each sampled row. bad_words_ids and
# begin_suppress_tokens raise inside transformers' own continuous batching (not listed).
PROCESSORS = dict(repetition_penalty=dict(repetition_penalty=1.5),
                  min_new_tokens=dict(min_new_tokens=4, eos_token_id=3),
                  min_p=dict(min_p=0.2), typical_p=dict(typical_p=0.8),
                  epsilon_cutoff=dict(epsilon_cutoff=3e-3), eta_cutoff=dict(eta_cutoff=1e-3),
                  no_repeat_ngram_size=dict(no_repeat_ngram_size=2),
                  suppress_tokens=dict(suppress_tokens=[5, 6, 7]),
                  sequence_bias=dict(sequence_bias={(10,): 5.0}), top_h=dict(top_h=0.5),
                  renormalize_logits=dict(renormalize_logits=True, temperature=0.7),
                  forced_eos_token_id=dict(forced_eos_token_id=3, max_length=20))


# (processor, do_sample) whose capture fails in transformers 5.17 itself, on the H200
# (2026-12-03, each run alone): NoRepeatNGramLogitsProcessor raises on its input,
# SuppressTokensLogitsProcessor copies a host tensor, EtaLogitsWarper checks a
# torch.distributions.Categorical on the host, TopHLogitsWarper (sampled) fails its capture
UNCAPTURABLE = {("no_repeat_ngram_size", False), ("no_repeat_ngram_size", True),
                ("suppress_tokens", False), ("suppress_tokens", True), ("eta_cutoff", True),
                ("top_h", True)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("name", PROCESSORS)
def test_other_logits_processors_equal_transformers(name, do_sample, mode):
    """Each of transformers' other generation options in continuous batching, greedy and
    sampled: zos gives transformers' tokens, and transformers' errors where its own run fails
    (``no_repeat_ngram_size``: its processor indexes the step's 1-D input ids as 2-D, so every
    request fails, with zos as without)."""
    if mode != "sync" and (name, do_sample) in UNCAPTURABLE:
        # transformers' own capture fails, and a failed capture leaves CUDA's state unusable
        # for the rest of the process (on the H200, 2026-12-03, the process crashed later);
        # zos's fastest mode leaves graphs off for these (test_hf.py)
        pytest.skip(f"transformers cannot capture {name} in a CUDA graph")
    model = tiny_llama(8)
    inputs = prompts(8, (1, 5, 17, 3, 9))
    opts = dict(PROCESSORS[name])
    opts.setdefault("eos_token_id", EOS)
    gen = GenerationConfig(max_new_tokens=8, do_sample=do_sample, pad_token_id=0, **opts)
    cb = cb_config(mode)
    theirs = run(model, inputs, gen, False, 21, cb)
    ours = run(model, inputs, gen, True, 21, cb)
    assert tokens(ours) == tokens(theirs)
    assert {k: o.error for k, o in ours.items()} == {k: o.error for k, o in theirs.items()}
