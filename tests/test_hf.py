"""zos inside transformers' continuous batching (zos/integrations/transformers.py): greedy tokens
equal transformers' own continuous batching and ``generate()`` (rows joining and leaving,
request ids reused, preemption by transformers' offloading), on a tiny random Llama and on
SmolLM2's real weights; the separate-K/V attention entry point; the errors.

Needs transformers 5.17.0 or 5.25.0 (the ``hf`` extra); skipped with another version."""
import zos._interpret  # noqa: F401  (before transformers imports triton)

import importlib
import sys
import warnings

import pytest
import torch

from zos.attention import paged_decode_attention, paged_decode_attention_kv

from helpers import DEVICE, require_smollm2, require_transformers

require_transformers()  # before the transformers imports below

from transformers import (  # noqa: E402
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.generation.continuous_batching import offloading_manager  # noqa: E402

from zos.integrations.hf_internals import internals  # noqa: E402
from zos.integrations.hf_rows import ZosDecodeRows  # noqa: E402
from zos.integrations.transformers import (  # noqa: E402
    ZosOptions,
    disable_zos,
    enable_zos,
)

EOS = -1


def tiny_llama(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to(device=DEVICE, dtype=dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def gen_config(max_new_tokens):
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS,
                            pad_token_id=0)


def cb_config(num_blocks=64, block_size=4, max_requests_per_batch=8, **kw):
    kw = dict(dict(use_cuda_graph=False, use_async_batching=False, max_batch_tokens=64), **kw)
    kw[internals().page_field] = block_size  # block_size in 5.17, page_size in 5.25
    return ContinuousBatchingConfig(num_blocks=num_blocks,
                                    max_requests_per_batch=max_requests_per_batch, **kw)


def reference(model, prompt, max_new_tokens):
    """``generate()`` of one prompt alone (no continuous batching, no zos)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                       device=model.device),
                             generation_config=gen_config(max_new_tokens))
    return out[0, len(prompt):].tolist()


def prompts(seed, lengths, vocab):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def run_generate_batch(model, inputs, max_new_tokens, zos, bucket_policy=None, **cb_kw):
    timings = []
    if zos:
        enable_zos(model, ZosOptions(timings=timings, bucket_policy=bucket_policy))
    try:
        out = model.generate_batch(inputs, generation_config=gen_config(max_new_tokens),
                                   continuous_batching_config=cb_config(**cb_kw),
                                   progress_bar=False)
    finally:
        disable_zos(model)
    order = sorted(out, key=lambda k: int(k.split("_")[-1]))
    return [out[k].generated_tokens for k in order], timings


@pytest.mark.parametrize("seed,lengths,max_new,buckets", [
    (0, (1, 5, 17, 3, 9), 7, None), (1, (2, 11), 5, None), (2, (4, 13, 6), 6, "vllm")])
def test_generate_batch_matches_transformers_and_generate(seed, lengths, max_new, buckets):
    """Rows join (prompts of different lengths finish prefill at different steps) and leave;
    with a bucket policy, zos steps run padded rows (3 requests -> 4 rows)."""
    model = tiny_llama(seed)
    inputs = prompts(seed, lengths, model.config.vocab_size)
    want = [reference(model, p, max_new) for p in inputs]
    theirs, _ = run_generate_batch(model, inputs, max_new, zos=False)
    ours, timings = run_generate_batch(model, inputs, max_new, zos=True, bucket_policy=buckets)
    assert theirs == want
    assert ours == want
    paths = [p for p, _ in timings]
    assert "zos" in paths and "transformers" in paths  # both paths ran
    assert model.config._attn_implementation == "sdpa"  # disable_zos restored it


def test_chunked_prefill_through_varlen_attention(monkeypatch):
    """Prompts longer than a batch's 64 tokens are prefilled in chunks, beside the decoding
    requests: zos's varlen attention runs those steps, reading keys through transformers'
    ``read_index`` (a chunk after the first, or a decode row in a mixed batch) and, when no
    request of the step has a past, through its ``write_index``; every request gets
    ``generate()``'s tokens."""
    from zos.integrations import transformers as zt

    model = tiny_llama(11)
    inputs = prompts(11, (150, 3, 70, 9), model.config.vocab_size)
    want = [reference(model, p, 6) for p in inputs]
    seen = []  # (query tokens, keys read) per call

    def spy(q, k_cache, v_cache, kv_slots, cu_q, cu_k, scale, **kw):
        seen.append((int(cu_q[-1]), int(cu_k[-1])))
        return varlen(q, k_cache, v_cache, kv_slots, cu_q, cu_k, scale, **kw)

    varlen = zt.varlen_attention
    monkeypatch.setattr(zt, "varlen_attention", spy)
    ours, timings = run_generate_batch(model, inputs, 6, zos=True)
    assert ours == want
    assert any(k > q for q, k in seen) and any(k == q for q, k in seen)  # past read; none
    assert [p for p, _ in timings].count("transformers") * model.config.num_hidden_layers \
        == len(seen)  # every step zos did not build ran its varlen attention, once per layer


def test_manager_join_leave_reused_ids_and_preemption(monkeypatch):
    """Requests of different lengths leave at different steps; a second wave joins while the
    first still decodes (transformers' prefill and mixed steps after zos steps); a third wave
    reuses the ids of finished requests; a KV pool too small for all of them makes transformers
    evict (soft reset: re-prefill) and resume requests. Every request's tokens equal
    generate()."""
    model = tiny_llama(3)
    evicted = []
    original = offloading_manager.OffloadingManager.offload_requests

    def counting(self):
        n = original(self)
        evicted.append(n)
        return n

    monkeypatch.setattr(offloading_manager.OffloadingManager, "offload_requests", counting)
    timings = []
    enable_zos(model, ZosOptions(timings=timings))
    waves = [(["a0", "a1", "a2", "a3", "a4"], prompts(10, (3, 6, 1, 9, 4), 97), [9, 2, 13, 6, 11]),
             (["b0", "b1", "b2"], prompts(11, (5, 17, 7), 97), [8, 12, 5]),
             (["a0", "a1", "a2"], prompts(12, (2, 8, 3), 97), [6, 7, 9])]  # ids reused
    got = {}
    cb = cb_config(num_blocks=8, safety_margin=0.0)  # 32 KV slots for ~130 tokens
    manager = model.init_continuous_batching(generation_config=gen_config(16),
                                             continuous_batching_config=cb)
    manager.start()

    def add(wave):
        for rid, p, n in zip(*waves[wave]):
            manager.add_request(p, request_id=rid, max_new_tokens=n)

    def collect(wave, count):
        for _ in range(count):
            res = manager.get_result(timeout=120)
            assert res is not None and res.is_finished()
            got[(wave if res.request_id.startswith("a") else 1, res.request_id)] = \
                res.generated_tokens

    try:
        add(0)
        collect(0, 1)  # the shortest request of wave 0 is done, the others still decode
        add(1)
        collect(0, 7)
        add(2)
        collect(2, 3)
    finally:
        manager.stop(block=True)
        disable_zos(model)
    assert sum(evicted) > 0, "the pool must be small enough for transformers to preempt"
    paths = [p for p, _ in timings]
    assert paths.count("zos") >= 10
    assert any(p == "transformers" and "zos" in paths[:i] for i, p in enumerate(paths)), \
        "a transformers step (prefill or mixed) must follow zos steps"
    for wave, (ids, inputs, lens) in enumerate(waves):
        for rid, p, n in zip(ids, inputs, lens):
            assert got[(wave, rid)] == reference(model, p, n), (wave, rid)


def test_smollm2_real_weights():
    """SmolLM2-135M-Instruct (real weights, float32): a short chat prompt and two others."""
    from zos.serving.models import weights

    require_smollm2()
    model, tok = weights.load_smollm2_hf()
    model = model.to(DEVICE)
    model.set_attn_implementation("sdpa")
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                   add_generation_prompt=True, tokenize=False)
    texts = [chat, "The capital of France is", "def add(a, b):"]
    inputs = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    want = [reference(model, p, 4) for p in inputs]
    ours, timings = run_generate_batch(model, inputs, 4, zos=True, block_size=16, num_blocks=32)
    theirs, _ = run_generate_batch(model, inputs, 4, zos=False, block_size=16, num_blocks=32)
    assert ours == want and theirs == want
    assert [p for p, _ in timings].count("zos") == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,bs,heads,kv_heads", [(5, 4, 4, 2), (17, 16, 9, 3)])
def test_separate_kv_equals_stacked_cache(dtype, rows, bs, heads, kv_heads):
    """paged_decode_attention_kv on K and V tensors gives exactly paged_decode_attention on the
    same data stacked as one [2, ...] cache (same kernels)."""
    g = torch.Generator().manual_seed(rows)
    nb, w, hd = 23, 5, 16
    k = torch.randn(nb, bs, kv_heads, hd, generator=g).to(DEVICE, dtype)
    v = torch.randn(nb, bs, kv_heads, hd, generator=g).to(DEVICE, dtype)
    q = torch.randn(rows, heads, hd, generator=g).to(DEVICE, dtype)
    table = torch.randint(0, nb, (rows, w), generator=g, dtype=torch.int32).to(DEVICE)
    seq = torch.randint(1, w * bs + 1, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    got = paged_decode_attention_kv(q, k, v, table, seq, hd ** -0.5)
    want = paged_decode_attention(q, torch.stack([k, v]), table, seq, hd ** -0.5)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="v_cache must match k_cache"):
        paged_decode_attention_kv(q, k, v[:-1], table, seq, 0.25)


def test_errors(monkeypatch):
    model = tiny_llama()
    model.set_attn_implementation("sdpa")
    with pytest.raises(TypeError, match="options must be a ZosOptions"):
        enable_zos(model, {"timings": []})
    # the module object transformers' lazy loader keeps in sys.modules, which enable_zos imports
    adapter = internals()  # the installed release's
    line, (module, attr) = adapter.line, adapter.REQUIRED[0]
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.26.0")
    with pytest.raises(RuntimeError, match=r"supports transformers 5.17 and 5.25 .*found "
                                           rf"5.26.0: untested \(it looks like the {line} line"):
        enable_zos(model)
    # a release that lacks an internal the adapter needs: named
    owner, name = attr.split(".")
    monkeypatch.delattr(getattr(importlib.import_module(module), owner), name)
    with pytest.raises(RuntimeError, match=rf"found 5.26.0: {module}.{attr} is missing"):
        enable_zos(model)
    monkeypatch.undo()
    # a patch release of a tested line that lacks an internal both lines have: named
    from transformers.generation.continuous_batching import scheduler

    monkeypatch.setattr(sys.modules["transformers"], "__version__", f"{line}.99")
    monkeypatch.delattr(scheduler.Scheduler, "finish_request")
    with pytest.raises(RuntimeError, match=rf"transformers {line}.99 lacks .*scheduler"
                                           rf".Scheduler.finish_request, an internal"):
        enable_zos(model)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="bucket_policy must be None or one of"):
        enable_zos(model, ZosOptions(bucket_policy="pow2"))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA only: SmolLM2-shape weights on the GPU")
def test_cuda_smollm2_shape_matches_transformers():
    """On the GPU: random SmolLM2-135M-shape weights, 24 requests of 1..300 prompt tokens, 24
    greedy tokens each, in float32: zos's tokens equal transformers' own continuous batching.
    (In bfloat16 the two decode attentions round differently, so near-tied random logits may
    flip; bench/bench_hf.py reports the bf16 agreement.)"""
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.float32).eval()
    model.set_attn_implementation("sdpa")
    lens = torch.randint(1, 300, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    inputs = prompts(5, lens, cfg.vocab_size)
    kw = dict(block_size=32, num_blocks=2048, max_requests_per_batch=32, max_batch_tokens=1024)
    theirs, _ = run_generate_batch(model, inputs, 24, zos=False, **kw)
    ours, timings = run_generate_batch(model, inputs, 24, zos=True, bucket_policy="vllm", **kw)
    assert ours == theirs
    assert [p for p, _ in timings].count("zos") > 10


def test_readme_example_runs_as_printed():
    """The README block fenced ```python transformers runs as a script of its own (a fresh
    interpreter, without TRITON_INTERPRET: what a user's first run has, so its import order is
    what chooses Triton's interpreter on a CPU) and prints the ```text block that follows it."""
    import os
    import pathlib
    import re
    import subprocess

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    (code,) = re.findall(r"^```python transformers\n(.*?)^```$", readme, flags=re.M | re.S)
    expected = re.findall(r"^```text\n(.*?)^```$", readme[readme.index(code) + len(code):],
                          flags=re.M | re.S)[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == expected


def full_attention_manager(cache):
    """transformers' own objects for a cache's full-attention layers: ``(manager, trash,
    tokens per block)``: the manager holds ``block_table`` and ``get_read_indices`` /
    ``get_write_indices`` (token rows of a layer's K/V tensor), ``trash`` the read- and
    write-trash rows (5.17: the cache's group manager and the cache; 5.25: its allocator)."""
    if hasattr(cache, "cache_allocators"):  # 5.25
        alloc = cache.cache_allocators["full_attention"]
        return alloc, alloc, alloc.tokens_per_page
    return cache.group_cache_managers[0], cache, cache.block_size


def test_zos_metadata_equals_transformers_state(monkeypatch):
    """Every zos step's metadata, exactly, against transformers' own state of each request at
    that step (position = tokens in its cache; the slot its write index for that token; each
    block-table column the row its read index gives the column's first token, in blocks) and
    its trash for the padded rows (null block: the read trash, pad slot: the write trash;
    bucket policy vllm: 5 requests -> 8). Checked on the device after the step's device work
    (``in_graph``), before the model reads it."""
    original = ZosDecodeRows.in_graph
    checked = []

    def checking(rows, md, prev_output_ids):
        original(rows, md, prev_output_ids)
        manager, trash, bs = full_attention_manager(rows.cache)
        n, w = len(rows.requests), rows.buffers.max_num_blocks_per_req
        pad = md.padded_size - n
        null, pad_slot = trash.read_trash_index // bs, trash.write_trash_index
        # transformers advanced each request's position when the step was prepared
        positions = [fs.state.position_offset - 1 for fs in rows.requests]
        ids = [fs.state.request_id for fs in rows.requests]
        reads = [manager.get_read_indices(r, 0, p + 1) for r, p in zip(ids, positions)]
        assert md.positions.tolist() == positions + [0] * pad
        assert md.seq_lens.tolist() == [p + 1 for p in positions] + [1] * pad
        assert md.slot_mapping.tolist() == (
            [manager.get_write_indices(r, p, 1)[0] for r, p in zip(ids, positions)]
            + [pad_slot] * pad)
        table = [[read[c * bs] // bs for c in range(p // bs + 1)] + [null] * (w - p // bs - 1)
                 for p, read in zip(positions, reads)]
        assert md.block_table.tolist() == table + [[null] * w] * pad
        checked.append(n)

    original_build = ZosDecodeRows.build_step

    def remembering(rows, requests, prev_positions):
        rows.requests = list(requests)
        return original_build(rows, requests, prev_positions)

    monkeypatch.setattr(ZosDecodeRows, "in_graph", checking)
    monkeypatch.setattr(ZosDecodeRows, "build_step", remembering)
    model = tiny_llama(4)
    inputs = prompts(4, (2, 7, 4, 1, 5), model.config.vocab_size)
    ours, _ = run_generate_batch(model, inputs, 6, zos=True, bucket_policy="vllm")
    assert ours == [reference(model, p, 6) for p in inputs]
    assert len(checked) >= 5 and 5 in checked


def test_cpu_model_with_triton_imported_first_is_refused():
    """In a fresh process that imports transformers' model classes (and with them triton)
    before zos, without TRITON_INTERPRET, enable_zos on a CPU model raises the RuntimeError that
    says what to do, instead of failing later inside a kernel launch."""
    import os
    import subprocess

    code = ("from transformers import LlamaConfig, LlamaForCausalLM\n"
            "from zos.integrations.transformers import enable_zos\n"
            "m = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, "
            "intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, "
            "num_key_value_heads=2))\n"
            "m.set_attn_implementation('sdpa')\n"
            "try:\n    enable_zos(m)\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: a model on the CPU needs Triton's interpreter" in out.stdout
    assert "import zos.integrations.transformers before transformers" in out.stdout


@pytest.mark.parametrize("graphs", [False, True])
def test_graphs_requested_match_transformers(graphs):
    """transformers' CUDA graphs requested or not: zos's greedy tokens equal transformers' own
    with the same settings and generate(). On a CPU transformers turns graphs off, so both
    cases run the eager path (what this checks there: requesting graphs breaks nothing); on
    CUDA, with graphs, each zos bucket's whole step is one replay."""
    model = tiny_llama(7)
    inputs = prompts(7, (3, 9, 1, 6, 12, 4), model.config.vocab_size)
    want = [reference(model, p, 7) for p in inputs]
    kw = dict(use_cuda_graph=graphs)
    theirs, _ = run_generate_batch(model, inputs, 7, zos=False, **kw)
    ours, timings = run_generate_batch(model, inputs, 7, zos=True, bucket_policy="vllm", **kw)
    assert theirs == want and ours == want
    assert [p for p, _ in timings].count("zos") >= 5


def test_fastest_mode_fills_only_what_the_user_left_open():
    """On CUDA, enable_zos's manager turns transformers' graphs and async on where the config
    says None; an explicit choice, a CPU model or compile configs keep the config as given, and
    the caller's config object is never changed."""
    from transformers import CompileConfig

    from zos.integrations.hf_manager import fastest_mode as _fastest_mode

    class Model:
        def __init__(self, kind):
            self.device = torch.device(kind)

    open_cfg = ContinuousBatchingConfig()
    got = _fastest_mode(open_cfg, Model("cuda"))
    assert got.use_cuda_graph is True and got.use_async_batching is True
    assert open_cfg.use_cuda_graph is None and open_cfg.use_async_batching is None
    mixed = ContinuousBatchingConfig(use_async_batching=False)
    got = _fastest_mode(mixed, Model("cuda"))
    assert got.use_cuda_graph is True and got.use_async_batching is False
    assert _fastest_mode(open_cfg, Model("cpu")) is open_cfg
    compiled = ContinuousBatchingConfig(decode_compile_config=CompileConfig())
    assert _fastest_mode(compiled, Model("cuda")) is compiled


def test_fastest_mode_leaves_graphs_off_for_processors_not_marked_ready():
    """A logits processor transformers has not marked ready for continuous batching and that
    was not captured on a GPU (SuppressTokensLogitsProcessor fails a capture on the H200) keeps
    zos's mode off graphs, with one warning; temperature / top-k / top-p (marked ready), min-p
    (captured on the H200) and processors transformers drops (repetition penalty, marked
    unsupported) do not, unless the config keeps the dropped ones."""
    from types import SimpleNamespace

    from zos.integrations.hf_manager import fastest_mode as _fastest_mode

    real = tiny_llama(0)
    model = SimpleNamespace(device=torch.device("cuda"),
                            _get_logits_processor=real._get_logits_processor)
    ready = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                             repetition_penalty=1.2)
    assert "MinPLogitsWarper" in [type(p).__name__ for p in real._get_logits_processor(ready)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = _fastest_mode(ContinuousBatchingConfig(), model, ready)
    assert got.use_cuda_graph is True and got.use_async_batching is True
    with pytest.warns(RuntimeWarning, match="SuppressTokensLogitsProcessor"):
        got = _fastest_mode(ContinuousBatchingConfig(), model, GenerationConfig(
            suppress_tokens=[3], max_new_tokens=4))
    assert got.use_cuda_graph is False and got.use_async_batching is True
    keep = ContinuousBatchingConfig(drop_unsupported_processors=False)
    with pytest.warns(RuntimeWarning, match="RepetitionPenaltyLogitsProcessor"):
        assert _fastest_mode(keep, model, ready).use_cuda_graph is False


def test_query_padding_interval_is_set_only_where_left_open_and_graphed():
    """ZosOptions.q_padding_interval_size reaches a manager's config where the config leaves the
    interval to transformers (0) and runs graphs on some path: without graphs transformers
    would take the interval as a request for them; an explicit interval is the user's. The
    caller's config is never changed."""
    from zos.integrations.hf_manager import with_query_padding

    opts = ZosOptions(q_padding_interval_size=128)
    for graphs in (True, (False, True), (True, False)):
        cfg = ContinuousBatchingConfig(use_cuda_graph=graphs)
        got = with_query_padding(cfg, opts)
        assert got.q_padding_interval_size == 128 and got.use_cuda_graph == graphs
        assert cfg.q_padding_interval_size == 0
    for cfg in (ContinuousBatchingConfig(), ContinuousBatchingConfig(use_cuda_graph=False),
                ContinuousBatchingConfig(use_cuda_graph=(False, False)),
                ContinuousBatchingConfig(use_cuda_graph=True, q_padding_interval_size=64)):
        assert with_query_padding(cfg, opts) is cfg
    graphed = ContinuousBatchingConfig(use_cuda_graph=True)
    assert with_query_padding(graphed, ZosOptions()) is graphed
    # through the manager transformers creates (on a CPU it then turns graphs off itself)
    model = tiny_llama(0)
    enable_zos(model, opts)
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=2, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(
            use_cuda_graph=True, num_blocks=16, block_size=16, max_batch_tokens=256))
    assert manager.continuous_batching_config.q_padding_interval_size == 128


@pytest.mark.parametrize("value, error", [(0, ValueError), (-64, ValueError),
                                          (128.0, TypeError), ("128", TypeError)])
def test_bad_query_padding_interval_is_refused(value, error):
    model = tiny_llama(0)
    with pytest.raises(error, match="q_padding_interval_size"):
        enable_zos(model, ZosOptions(q_padding_interval_size=value))
    assert getattr(model, "_zos_options", None) is None


def test_unsupported_attention_keeps_transformers_path():
    """paged|eager (and any attention zos does not serve) is not refused: enable_zos warns in
    one line, leaves the model as it is, and generate_batch gives transformers' tokens."""
    model = tiny_llama(8)
    model.set_attn_implementation("eager")
    inputs = prompts(8, (4, 7), model.config.vocab_size)
    want = [reference(model, p, 5) for p in inputs]
    with pytest.warns(RuntimeWarning, match=r"zos: attn_implementation 'eager' .*own"):
        assert enable_zos(model) is False
    assert model.config._attn_implementation == "eager" and not hasattr(model, "_zos_options")
    out = model.generate_batch(inputs, generation_config=gen_config(5),
                               continuous_batching_config=cb_config(), progress_bar=False)
    assert [out[k].generated_tokens for k in sorted(out)] == want


def test_sliding_window_model_keeps_transformers_path():
    """A model with sliding-window layers (Mistral's window here; Gemma 3's mixed layout is the
    same kind) keeps transformers' own continuous batching, with a one-line warning."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(9)
    cfg = MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=128, sliding_window=6)
    model = MistralForCausalLM(cfg).to(DEVICE).eval()
    model.set_attn_implementation("sdpa")
    inputs = prompts(9, (3, 10), cfg.vocab_size)
    theirs, _ = run_generate_batch(model, inputs, 6, zos=False)
    with pytest.warns(RuntimeWarning, match="sliding-window layers"):
        ours, timings = run_generate_batch(model, inputs, 6, zos=True)
    assert ours == theirs and timings == []


def test_compressed_latent_cache_keeps_transformers_path():
    """A model whose config has ``kv_lora_rank`` gets transformers' MLA cache (5.25: an
    ``MLACacheAllocator``, a subclass of the full-attention one, holding latents, not K and V
    per head): enable_zos refuses it with a one-line warning and leaves the model as it is,
    instead of a manager failing when it builds zos's rows."""
    model = tiny_llama(12)
    model.config.kv_lora_rank = 8
    with pytest.warns(RuntimeWarning, match=r"zos: .*compressed latents \(MLA\).*own"):
        assert enable_zos(model) is False
    assert not hasattr(model, "_zos_options")


@pytest.mark.parametrize("attn", ["sdpa", "zos"])
def test_compile_configs_keep_transformers_path(attn):
    """With torch.compile configs zos serves no step of the run (one-line warning): the model
    runs on transformers' own continuous-batching sdpa (``paged|sdpa`` in 5.17, ``sdpa`` in
    5.25), whose mask the batch processor's IOs (zos's) allocate as transformers' do, and gets
    the attention it had back when the manager stops (also one already on zos's)."""
    from transformers import CompileConfig

    model = tiny_llama(10)
    enable_zos(model)
    attn = internals().attn if attn == "zos" else attn
    model.set_attn_implementation(attn)
    try:
        manager = model.init_continuous_batching(
            generation_config=gen_config(2),
            continuous_batching_config=cb_config(varlen_compile_config=CompileConfig()))
        with pytest.warns(RuntimeWarning, match="torch.compile configs are not supported"):
            bp = manager._create_batch_processor()
        assert bp.inputs_and_outputs.zos is None
        assert bp.inputs_and_outputs.attention_mask is not None
        assert model.config._attn_implementation == internals().cb_sdpa
        assert manager._original_attn_impl == attn  # what transformers' stop restores
    finally:
        disable_zos(model)


@pytest.mark.skipif(DEVICE != "cuda", reason="transformers' async batching needs CUDA")
@pytest.mark.parametrize("graphs,asynchronous", [(True, True), (False, True), (True, False),
                                                 ((False, True), True), (None, None)])
def test_cuda_async_and_graphs_match_transformers(graphs, asynchronous):
    """On the GPU, float32: zos with transformers' graphs and/or async batching (None: zos's
    default, graphs on both paths and async on) gives exactly transformers' tokens (graphs and
    async on), through rows joining (prefill steps between zos steps: tokens in flight reach
    rows new to zos on the device), rows leaving and padded buckets; every graph is in zos's
    key space."""
    model = tiny_llama(11)
    inputs = prompts(11, (3, 17, 1, 9, 30, 5, 2, 12, 7, 21), model.config.vocab_size)
    kw = dict(use_cuda_graph=graphs, use_async_batching=asynchronous, max_requests_per_batch=4,
              max_batch_tokens=32, num_blocks=96)
    if graphs is None:
        kw = dict(max_requests_per_batch=4, max_batch_tokens=32, num_blocks=96)
        kw.update(use_cuda_graph=True, use_async_batching=True)  # transformers' side
    want = [reference(model, p, 9) for p in inputs]
    theirs, _ = run_generate_batch(model, inputs, 9, zos=False, **kw)
    if graphs is None:
        kw.update(use_cuda_graph=None, use_async_batching=None)
    from transformers.generation.continuous_batching.utils import CudaGraphBuffer
    keys, original = [], CudaGraphBuffer.set_graph

    def recording(store, key, graph):
        keys.append(key)
        return original(store, key, graph)

    CudaGraphBuffer.set_graph = recording
    try:
        ours, timings = run_generate_batch(model, inputs, 9, zos=True, bucket_policy="vllm",
                                           **kw)
    finally:
        CudaGraphBuffer.set_graph = original
    assert theirs == want
    assert ours == want
    assert [p for p, _ in timings].count("zos") >= 5
    zos_graphs = [k for k in keys if k[0] == "zos"]
    assert bool(zos_graphs) == (graphs is not False), keys  # zos steps replay their graphs
    assert all(k[0] in ("zos", "zos_varlen") for k in keys), keys
    assert any(k[0] == "zos_varlen" for k in keys) == (graphs in (True, None)), keys
