"""``zos demo`` end to end on a tiny random Llama (its report, its timing split into TPOT and
prefill over alternating repeats, and on a CPU what the report may claim), a bad ``--out`` and a
missing matplotlib, the trace slicing / prompt synthesis, and the timing helpers."""
import contextlib
import io
import json
import os
import re
import sys

import pytest

from zos.serving import demo, run_timing
from zos.serving import trace as ztrace
from zos.serving.cli import main
from zos.serving.demo import auto_num_blocks
from zos.serving.report import first_mismatch, format_samples, sample_texts, write_report
from zos.serving.types import StepRecord

CONV_HEAD = [(374, 44), (396, 109), (879, 55), (91, 16), (91, 16), (381, 84)]  # file rows 1-6


def test_trace_slice_exact_lengths_and_order():
    s = ztrace.trace_slice("conv", 0, 6, 8, max_prompt=64, max_output=32)
    assert [r.index for r in s] == list(range(6))
    assert [(r.orig_prompt_len, r.orig_output_len) for r in s] == CONV_HEAD
    assert [(r.prompt_len, r.output_len) for r in s] == [(46, 5), (49, 13), (64, 6), (11, 2),
                                                         (11, 2), (47, 10)]
    assert s[0].arrival == 0.0 and s[1].arrival == pytest.approx(4.314579, abs=1e-5)
    assert all(a.arrival <= b.arrival for a, b in zip(s, s[1:]))


def test_trace_slice_offset_clamps_and_errors():
    rows = ztrace.load_trace("code")
    s = ztrace.trace_slice("code", 100, 50, 3, max_prompt=40, max_output=5, min_prompt=8,
                           min_output=2)
    assert [r.index for r in s] == list(range(100, 150)) and s[0].arrival == 0.0
    for r in s:
        _, p, o = rows[r.index]
        assert (r.orig_prompt_len, r.orig_output_len) == (p, o)
        assert r.prompt_len == min(max(p // 3, 8), 40) and r.output_len == min(max(o // 3, 2), 5)
    assert {r.prompt_len for r in s} >= {40} and min(r.output_len for r in s) >= 2
    big = ztrace.trace_slice("conv", 0, 20, 10**6, max_prompt=9, max_output=9)
    assert {(r.prompt_len, r.output_len) for r in big} == {(1, 1)}
    n = len(ztrace.load_trace("conv"))
    assert n == 19366 and len(rows) == 8819
    for bad in (dict(start=n - 1, count=2), dict(start=-1, count=1), dict(start=0, count=0),
                dict(start=0, count=1, scale=0), dict(start=0, count=1, max_prompt=0)):
        kw = dict(dict(scale=1, max_prompt=8, max_output=8), **bad)
        with pytest.raises(ValueError):
            ztrace.trace_slice("conv", kw.pop("start"), kw.pop("count"), kw.pop("scale"), **kw)
    with pytest.raises(ValueError):
        ztrace.load_trace("chat")


def test_prompts_are_corpus_windows_deterministic_by_seed():
    text = ztrace.corpus_text()
    assert len(text) > 20000 and "argument" in text
    ids = list(range(1000, 1500))
    a = ztrace.synthesize_prompts([5, 1, 700], ids, seed=3)
    assert [len(p) for p in a] == [5, 1, 700]
    assert a == ztrace.synthesize_prompts([5, 1, 700], ids, seed=3)
    assert a != ztrace.synthesize_prompts([5, 1, 700], ids, seed=4)
    for p in a:  # consecutive corpus tokens, wrapping around
        assert all((y - 1000) == (x - 999) % 500 for x, y in zip(p, p[1:]))
    r = ztrace.random_prompts([4, 9], 50, seed=1)
    assert [len(p) for p in r] == [4, 9] and all(3 <= t < 50 for p in r for t in p)
    with pytest.raises(ValueError):
        ztrace.synthesize_prompts([3], [], seed=0)


def test_helpers():
    assert first_mismatch({1: [1, 2], 2: [3]}, {1: [1, 2], 2: [3]}) is None
    assert "request 2" in first_mismatch({1: [1], 2: [3, 4, 5]}, {1: [1], 2: [3, 9, 5]})
    assert "token 1" in first_mismatch({0: [3, 4]}, {0: [3]})
    smp = sample_texts({0: [1, 2], 1: [3]}, {0: [5], 1: [6, 7]}, None, n=1)
    assert smp == [dict(request=1, prompt_tail="[3]", completion="[6, 7]")]
    text = format_samples([dict(request=4, prompt_tail="a\n b", completion="x" * 50)], width=20)
    assert "[request 4] ...a b" in text and "x" * 17 + "..." in text
    s = ztrace.trace_slice("conv", 0, 4, 8, max_prompt=64, max_output=32)
    assert auto_num_blocks(s, 16, 8, 96) == 1 + max(6, round(0.5 * 8 * (4 + 4 + 5 + 1) / 4)) == 15


TINY = ["demo", "--tiny", "--weights", "random", "--block-size", "8", "--quiet", "--repeats", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One run of the tiny demo: (exit status, stdout, stderr, report directory)."""
    out = tmp_path_factory.mktemp("demo") / "report"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(TINY + ["--out", str(out)])
    return rc, stdout.getvalue(), stderr.getvalue(), out


def test_demo_end_to_end_tiny(tiny):
    rc, printed, _, out = tiny
    assert rc == 0, printed
    assert "identical tokens: YES" in printed and "| requests" in printed
    for name in ("report.md", "report.png", "report.json"):
        assert os.path.getsize(out / name) > 0
    assert not [p for p in os.listdir(out) if p.startswith(".zos-demo-probe")]
    rep = json.loads((out / "report.json").read_text())
    assert rep["identical"] is True and rep["mismatch"] is None and "png_skipped" not in rep
    h, z = rep["backends"]["host"], rep["backends"]["zos"]
    for key in ("requests", "steps", "prefill_steps", "decode_steps", "tokens", "preemptions"):
        assert h["totals"][key] == z["totals"][key], key
    assert h["totals"]["tokens"] == rep["setup"]["output_tokens"] > 0
    assert h["totals"]["requests"] == rep["setup"]["num_requests"] == 10
    assert h["totals"]["preemptions"] >= 1  # num_kv_blocks is tight by default
    assert h["series"]["step"] == z["series"]["step"]
    assert len(h["series"]["upload_bytes"]) == h["totals"]["decode_steps"]
    assert 0 < z["upload_bytes_median"] < h["upload_bytes_median"]
    assert len(rep["samples"]) == 3
    if rep["device"] == "cuda":
        assert h["h2d_samples"] and z["h2d_samples"]
        # zos's record is read in place from the mapped staging ring: no H2D copy per step
        assert z["h2d_bytes_median"] == 0 < h["h2d_bytes_median"]
        assert "zos makes no H2D copy" in printed
    md = (out / "report.md").read_text()
    assert "Identical tokens" in md and "YES" in md and rep["setup"]["torch"] in md
    assert "![per-step figures](report.png)" in md
    assert rep["setup"]["repeats"] == 1 and rep["setup"]["run_order"] == "host, zos"
    for b in (h, z):  # one TPOT per decode step; a run's decode time is their sum
        t = b["timing"]
        assert t["runs"] == 1 and t["tpot_s"]["n"] == b["totals"]["decode_steps"]
        assert len(b["series"]["tpot_s"]) == b["totals"]["decode_steps"]
        assert t["decode_s_per_run"]["median"] == pytest.approx(sum(b["series"]["tpot_s"]))
        assert 0 < t["prefill_s_per_run"]["median"]
        assert (t["decode_s_per_run"]["median"] + t["prefill_s_per_run"]["median"]
                <= b["totals"]["wall_s"])


def test_demo_overlap_same_tokens_as_sync(tiny, tmp_path):
    """``--overlap``: both backends' tokens identical, and equal to the synchronous run's."""
    out = tmp_path / "overlap"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = main(TINY + ["--overlap", "--out", str(out)])
    assert rc == 0 and "identical tokens: YES" in stdout.getvalue()
    rep = json.loads((out / "report.json").read_text())
    sync = json.loads((tiny[3] / "report.json").read_text())
    assert rep["setup"]["overlap"] is True and sync["setup"]["overlap"] is False
    assert rep["backends"]["zos"]["totals"]["tokens"] == sync["backends"]["zos"]["totals"]["tokens"]
    assert rep["samples"] == sync["samples"]


def test_demo_spec_same_tokens_as_plain(tiny, tmp_path):
    """``--spec ngram --num-draft-tokens 3``: both backends' tokens identical, equal to the plain
    run's; the report gives the acceptance."""
    out = tmp_path / "spec"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = main(TINY + ["--spec", "ngram", "--num-draft-tokens", "3", "--out", str(out)])
    assert rc == 0 and "identical tokens: YES" in stdout.getvalue()
    assert "draft acceptance rate" in stdout.getvalue()
    rep = json.loads((out / "report.json").read_text())
    sync = json.loads((tiny[3] / "report.json").read_text())
    assert rep["setup"]["num_draft_tokens"] == 3 and sync["setup"]["num_draft_tokens"] == 0
    assert rep["samples"] == sync["samples"]
    tot = rep["backends"]["zos"]["totals"]
    assert tot["tokens"] == sync["backends"]["zos"]["totals"]["tokens"]
    assert tot["spec_rows"] > 0 and tot["spec_tokens"] >= tot["spec_rows"]
    kept, rows = tot["spec_tokens"], tot["spec_rows"]
    assert tot["acceptance_rate"] == (kept - rows) / (3 * rows)
    for bad, msg in ((["--num-draft-tokens", "2"], "--num-draft-tokens needs --spec ngram"),
                     (["--spec", "ngram", "--num-draft-tokens", "0"],
                      "--num-draft-tokens must be >= 1, got 0")):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            assert main(TINY + bad + ["--out", str(tmp_path / "bad")]) == 2
        assert msg in err.getvalue()


def test_demo_on_cpu_compares_no_times(tiny):
    """On a CPU the report compares no times (zos's are Triton's interpreter): no ratio in the
    table, the md or the json; time rows say what they are; bytes are not called H2D."""
    rc, printed, _, out = tiny
    rep = json.loads((out / "report.json").read_text())
    if rep["device"] != "cpu":
        pytest.skip("the CPU labelling applies to CPU runs")
    assert rc == 0 and rep["setup"]["device"] == "cpu"
    assert "ratios" not in rep and "not comparable" in rep["cpu_times"]
    assert "counted by the backend" in rep["bytes_source"]
    md = (out / "report.md").read_text()
    for text in (printed, md):
        assert re.search(r"\d\.\d\dx", text) is None and "H2D bytes" not in text
        assert "bytes handed to the copies / decode step, median (no H2D on CPU)" in text
        assert "metadata us / decode step, median (CPU, not comparable)" in text
        assert "(interpreter)" in text and "(numba)" in text
        assert "tokens/s, whole run incl. prefill (CPU, not comparable)" in text
        assert "decode ms / step (TPOT), median [IQR] of all steps (CPU, not comparable)" in text
        assert "graphs off on CPU" in text and "no bucket" not in text  # why steps are eager
        assert "A GPU run adds" in text and "TPOT: the wall time of each engine step" in text
    for b in rep["backends"].values():
        n = b["totals"]["decode_steps"]
        assert b["eager_reasons"] == {"graphs off on CPU": n}
        assert b["totals"]["graphs_captured"] == 0


def test_demo_without_matplotlib_skips_the_picture(tiny, tmp_path, monkeypatch, capsys):
    """matplotlib is not a dependency: without it the report says the picture was skipped."""
    rep = json.loads((tiny[3] / "report.json").read_text())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    paths = write_report(rep, str(tmp_path))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "report.png skipped: matplotlib is not installed" in err
    assert "png" not in paths and not (tmp_path / "report.png").exists()
    saved = json.loads((tmp_path / "report.json").read_text())
    assert "matplotlib is not installed" in saved["png_skipped"]
    md = (tmp_path / "report.md").read_text()
    assert "report.png skipped: matplotlib is not installed" in md and "](report.png)" not in md


def _bad_outs(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    bad = {"path is a file": afile, "parent is a file": afile / "sub"}
    if sys.platform == "linux":  # procfs: no directory or file can be created there, even as root
        bad.update({"parent cannot be created": "/proc/zos-no-such-dir/out",
                    "directory not writable": "/proc"})
    if hasattr(os, "geteuid") and os.geteuid() != 0:  # root writes into a 0o500 directory
        ro = tmp_path / "read_only"
        ro.mkdir(mode=0o500)
        bad["read-only directory"] = ro
    return bad


def test_demo_bad_out_fails_first_in_one_line(tmp_path, monkeypatch, capsys):
    """A report directory that cannot be written is an error before any work (no model is
    loaded), in one line, exit 2; no traceback."""
    monkeypatch.setattr(demo, "load_model", lambda *a, **k: pytest.fail("work before --out check"))
    for name, out in _bad_outs(tmp_path).items():
        rc = main(TINY + ["--out", str(out)])
        cap = capsys.readouterr()
        assert rc == 2, name
        assert cap.err.startswith(f"zos demo: error: --out {out}: "), (name, cap.err)
        assert cap.err.count("\n") == 1 and "Traceback" not in cap.err, (name, cap.err)
    assert (tmp_path / "a_file").read_text() == "x"



@pytest.mark.parametrize("extra,err", [
    (["--graph-memory-budget-mb", "64"], "--graph-memory-budget-mb: only with --graph-capture"),
    (["--graph-capture", "lazy", "--graph-memory-budget-mb", "-1"],
     "--graph-memory-budget-mb must be >= 0"),
])
def test_demo_graph_flags_checked_first(tmp_path, monkeypatch, capsys, extra, err):
    """Bad lazy-capture flags are one-line errors (exit 2) before any model is loaded."""
    monkeypatch.setattr(demo, "load_model", lambda *a, **k: pytest.fail("work before the check"))
    rc = main(TINY + ["--out", str(tmp_path / "r")] + extra)
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert cap.err.startswith(f"zos demo: error: {err}") and cap.err.count("\n") == 1


def test_demo_repeats_alternate_and_agree(tmp_path):
    """``--repeats 2``: the backends run host, zos, zos, host; every run's tokens are the same;
    TPOT has one value per decode step of both runs and the per-run figures a range over 2."""
    out = tmp_path / "rep"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = main(TINY + ["--repeats", "2", "--num-requests", "3", "--max-output", "5",
                          "--out", str(out)])
    assert rc == 0 and "identical tokens: YES" in stdout.getvalue()
    rep = json.loads((out / "report.json").read_text())
    assert rep["setup"]["repeats"] == 2 and rep["setup"]["run_order"] == "host, zos, zos, host"
    assert "2 runs per backend in alternating order (host, zos, zos, host)" in stdout.getvalue()
    assert "range of 2 runs" in stdout.getvalue()
    for b in rep["backends"].values():
        t = b["timing"]
        assert t["runs"] == 2 and t["tpot_s"]["n"] == 2 * b["totals"]["decode_steps"]
        for k in ("decode_s_per_run", "prefill_s_per_run", "tokens_per_s_per_run"):
            assert t[k]["n"] == 2 and t[k]["min"] <= t[k]["median"] <= t[k]["max"]


def _rec(step, kind, seconds):
    return StepRecord(step, kind, "eager", 1, 1, 0.0, 0, 0, seconds)


def test_split_step():
    """A step's wall time: its prefill records' seconds, the rest to decode when it decoded."""
    assert run_timing.split_step(3, 0.5, [_rec(3, "prefill", 0.2), _rec(3, "decode", 0.1)]) \
        == run_timing.StepTime(3, 0.2, 0.3, True)
    assert run_timing.split_step(4, 0.25, [_rec(4, "decode", 0.1)]) == \
        run_timing.StepTime(4, 0.0, 0.25, True)
    assert run_timing.split_step(5, 0.5, [_rec(5, "prefill", 0.125)]) == \
        run_timing.StepTime(5, 0.5, 0.0, False)  # no decode: all of it is prefill
    assert run_timing.split_step(6, 0.1, [_rec(6, "prefill", 0.3), _rec(6, "decode", 0)]) == \
        run_timing.StepTime(6, 0.1, 0.0, True)  # a prefill record never exceeds the wall
    with pytest.raises(ValueError, match="wall_s"):
        run_timing.split_step(1, -1.0, [])
    ph = run_timing.run_phases([run_timing.StepTime(1, 0.5, 0.0, False),
                                run_timing.StepTime(2, 0.25, 0.125, True),
                                run_timing.StepTime(3, 0.0, 0.375, True)])
    assert ph == dict(prefill_s=0.75, decode_s=0.5, decode_steps=2, tpot_s=[0.125, 0.375])


def test_timed_steps_wraps_the_engine_step():
    class FakeEngine:
        def step(self, progress=None):
            return [_rec(1, "prefill", 0.0), _rec(1, "decode", 0.0)]

    eng = FakeEngine()
    times = run_timing.timed_steps(eng)
    assert eng.step() and eng.step()
    assert [t.step for t in times] == [1, 1] and all(t.decoded for t in times)
    assert all(t.decode_s >= 0 and t.prefill_s == 0 for t in times)


@pytest.mark.parametrize("xs,expected", [
    ([2.0], dict(median=2.0, min=2.0, max=2.0, q1=2.0, q3=2.0, n=1)),
    ([4.0, 1.0, 3.0, 2.0, 5.0], dict(median=3.0, min=1.0, max=5.0, q1=2.0, q3=4.0, n=5)),
    ([1.0, 2.0], dict(median=1.5, min=1.0, max=2.0, q1=1.25, q3=1.75, n=2)),
])
def test_spread(xs, expected):
    assert run_timing.spread(xs) == expected


def test_spread_overlap_and_order():
    assert run_timing.spread([]) is None
    a, b, c = (run_timing.spread(x) for x in ([1.0, 2.0], [1.5, 3.0], [2.5, 4.0]))
    assert run_timing.overlap(a, b) and not run_timing.overlap(a, c) and run_timing.overlap(b, c)
    assert run_timing.overlap(a, None) is None
    assert run_timing.alternating(("host", "zos"), 1) == ["host", "zos"]
    assert run_timing.alternating(("host", "zos"), 3) == ["host", "zos", "zos", "host", "host",
                                                          "zos"]
