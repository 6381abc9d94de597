"""A kernel's launch configuration comes from how the kernel was defined and the tensors' device,
never from ``TRITON_INTERPRET`` read at launch time (issue 30: a benchmark module that set the
variable after zos's kernels were compiled for the GPU made every launcher pick the CPU
interpreter's grids: one attention split, many-row programs, 3-7x slower decode steps).

On a CPU the launchers are run against a stand-in for a GPU-compiled kernel (a ``JITFunction``
that records its launch instead of running) on ``meta`` tensors, with the variable set, cleared
and unset after import: the recorded grids and compile-time arguments must be the same each time
and be the GPU's. On a GPU the engine's real kernel launches (names and grids, from the
profiler's trace) are compared the same way. No module of bench/ or tests/ may change the
environment when it is imported.
"""
import zos._interpret

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import zos.attention
import zos.serving.models.fused as fused
import zos.triton_kernels
from zos.triton_kernels.prep import rebuild_rows

ROOT = Path(__file__).resolve().parent.parent
ENV_STATES = ["1", "0", "", None]  # TRITON_INTERPRET set on, off, empty, unset after import


class RecordingKernel(JITFunction):
    """A GPU-compiled kernel as far as zos can tell (a JITFunction, not interpreted) whose
    launch ``kernel[grid](*args, **kwargs)`` records the grid and the keyword arguments."""

    def __init__(self, fn, calls: list):
        super().__init__(fn)
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.__name__, tuple(grid), kw))


def _python_fn(kernel):
    return kernel.fn  # both JITFunction and InterpretedFunction keep the Python function


def _set(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)


def _launches(monkeypatch, module, names, run, env):
    """The launches ``run()`` makes with ``module``'s kernels ``names`` replaced by recorders,
    with TRITON_INTERPRET in state ``env``."""
    calls = []
    for name in names:
        monkeypatch.setattr(module, name, RecordingKernel(_python_fn(getattr(module, name)),
                                                          calls))
    _set(monkeypatch, env)
    run()
    return calls


def _attention():
    r, hq, hkv, hd, bs, w = 1, 8, 2, 64, 16, 64  # N = 1, 1k-token context: split-KV on a GPU
    q = torch.empty(r, hq, hd, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, r * w + 1, bs, hkv, hd, dtype=torch.bfloat16, device="meta")
    zos.attention.paged_decode_attention(
        q, kv, torch.empty(r, w, dtype=torch.int32, device="meta"),
        torch.empty(r, dtype=torch.int32, device="meta"), hd ** -0.5)


def _fused():
    t, hidden, heads, kv_heads, hd = 64, 576, 9, 3, 64
    x = torch.empty(t, hidden, dtype=torch.bfloat16, device="meta")
    fused.rms_norm(x, torch.empty(hidden, dtype=torch.bfloat16, device="meta"), 1e-5)
    fused.silu_and_mul(torch.empty(t, 2 * 1536, dtype=torch.bfloat16, device="meta"))
    qkv = torch.empty(t, (heads + 2 * kv_heads) * hd, dtype=torch.bfloat16, device="meta")
    cos = torch.empty(t, hd, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 32, 16, kv_heads, hd, dtype=torch.bfloat16, device="meta")
    fused.rope_and_store_kv(qkv, cos, cos, kv, torch.empty(t, dtype=torch.int64, device="meta"),
                            heads, kv_heads, hd)


CASES = {
    "paged_decode_attention": (zos.attention, ["paged_decode_split_kernel",
                                               "paged_decode_reduce_kernel"], _attention),
    "fused": (fused, ["rms_norm_kernel", "silu_and_mul_kernel", "rope_store_kv_kernel"], _fused),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_kernels_get_gpu_grids_whatever_the_environment(monkeypatch, case):
    module, names, run = CASES[case]
    seen = [_launches(monkeypatch, module, names, run, env) for env in ENV_STATES]
    assert all(s == seen[0] for s in seen), seen
    by_kernel = {name: (grid, kw) for name, grid, kw in seen[0]}
    if case == "paged_decode_attention":
        splits = by_kernel["paged_decode_split_kernel"][0][2]
        assert splits > 1 and by_kernel["paged_decode_split_kernel"][1]["DIRECT"] is False
        assert by_kernel["paged_decode_split_kernel"][1]["IEEE_DOT"] is False  # bf16: tensor cores
        assert "paged_decode_reduce_kernel" in by_kernel
    else:  # one row (RMSNorm, SiLU) or ~1024 values (RoPE) per program on a GPU
        assert by_kernel["rms_norm_kernel"][0] == (64,)
        assert by_kernel["rms_norm_kernel"][1]["ROWS"] == 1
        assert by_kernel["silu_and_mul_kernel"][1]["ROWS"] == 1
        assert by_kernel["rope_store_kv_kernel"][1]["PAIRS"] == 1024 // 32


def test_interpreted_follows_the_kernel_not_the_environment(monkeypatch):
    compiled = JITFunction(_python_fn(rebuild_rows))
    interp = InterpretedFunction(_python_fn(rebuild_rows))
    for env in ENV_STATES:
        _set(monkeypatch, env)
        assert zos._interpret.interpreted(compiled, torch.device("cuda")) is False
        assert zos._interpret.interpreted(interp, torch.device("cuda")) is True
        assert zos._interpret.interpreted(interp, torch.device("cpu")) is True
        with pytest.raises(ValueError, match=r"^rebuild_rows launch: device is cpu, but .*"
                                             r"TRITON_INTERPRET=1 in the environment"):
            zos._interpret.interpreted(compiled, torch.device("cpu"))


def test_all_kernels_share_one_mode():
    """zos.triton_kernels defines every kernel at once, so they are all compiled or all
    interpreted, as kernels_interpreted() says."""
    tk = zos.triton_kernels
    kinds = {name: type(obj)
             for mod in (tk.fused, tk.kv_cache, tk.paged_attention, tk.prep, tk.spec)
             for name, obj in vars(mod).items()
             if isinstance(obj, JITFunction | InterpretedFunction)}
    assert len(kinds) >= 10
    want = InterpretedFunction if zos._interpret.kernels_interpreted() else JITFunction
    assert set(kinds.values()) == {want}, kinds


IMPORT_PROBE = r"""
import ast, faulthandler, importlib, json, os, sys
faulthandler.dump_traceback_later(240, exit=True)  # a hung import: its stack, not a silent wait
import torch
import zos._interpret
sys.path[:0] = [sys.argv[1], sys.argv[2]]
paths = sys.argv[3:]
ours = {os.path.splitext(os.path.basename(p))[0] for p in paths} | {"zos"}
# Third-party modules first (torch's inductor, imported by transformers, sets its cache dir):
# what is measured below is what the modules themselves do.
for path in paths:
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            wanted = [(node.module, a.name) for a in node.names]
        else:
            continue
        for name, attr in wanted:
            if name.split(".")[0] not in ours:
                try:  # a lazy attribute (transformers' model classes) imports its module
                    getattr(importlib.import_module(name), attr or "__name__", None)
                except Exception:
                    pass
import zos.triton_kernels  # defined in their mode; then the variable is cleared, so that a
os.environ.pop("TRITON_INTERPRET", None)  # module's setdefault shows too
before = (dict(os.environ), torch.get_num_threads())
changed = {}
for path in paths:
    try:
        importlib.import_module(os.path.splitext(os.path.basename(path))[0])
    except BaseException as e:  # a module that skips itself (pytest.importorskip) is fine
        if type(e).__name__ != "Skipped":
            raise
    now = (dict(os.environ), torch.get_num_threads())
    if now != before:
        keys = sorted(k for k in set(now[0]) | set(before[0]) if now[0].get(k) != before[0].get(k))
        changed[path] = dict(env=keys, threads=[before[1], now[1]])
        before = now
print(json.dumps(changed))
"""


def test_no_bench_or_test_module_changes_the_environment_on_import():
    """Every bench/*.py and tests/*.py module imported one after another in a fresh process
    (after zos and its kernels, with TRITON_INTERPRET then cleared): os.environ and torch's
    thread count are unchanged by each."""
    mods = sorted(str(p) for d in ("bench", "tests") for p in (ROOT / d).glob("*.py"))
    assert len(mods) > 30
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE, str(ROOT / "bench"),
                          str(ROOT / "tests"), *mods], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-8000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine's compiled kernels need CUDA")
def test_engine_launches_are_the_same_after_setting_the_variable(monkeypatch, tmp_path):
    """On a GPU: an eager decode step of the engine (SmolLM2-like shape, bf16) launches the same
    kernels with the same grids before and after TRITON_INTERPRET=1 is set in the process."""
    from zos.serving.engine import Engine, EngineConfig, Request
    from zos.serving.models import LlamaConfig, random_llama

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=2048)
    model = random_llama(cfg, dtype=torch.bfloat16, device="cuda")

    def launches(env, name):
        _set(monkeypatch, env)
        ecfg = EngineConfig(block_size=16, num_kv_blocks=8 * 70 + 1, max_num_seqs=8,
                            max_model_len=1100, backend="zos", use_cuda_graph=False)
        engine = Engine(model, ecfg, "cuda")
        for i in range(8):
            engine.admit_prefilled(Request(i, [1] * (1000 + 7 * i), 8), first_token=3)
        engine.step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
        path = tmp_path / f"{name}.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
        return [(e["name"], e["args"].get("grid"), e["args"].get("block")) for e in events
                if e.get("cat") == "kernel"]

    before = launches(None, "before")
    after = launches("1", "after")
    assert any("paged_decode_split" in name for name, _, _ in before)
    assert before == after
