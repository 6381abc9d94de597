"""The server benchmark (``bench/bench_serve.py``): its window figure, tokens per second while all C
streams are active, against a count of each token's arrival time (tokens spread evenly between
a request's first and last content chunk, as the benchmark assumes); the open-loop workload; the
merge of runs on two transformers release lines."""
import importlib.util
import itertools
import json
import random
import threading
import types
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_serve", Path(__file__).resolve().parent.parent / "bench" / "bench_serve.py")
bench_serve = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_serve)


def rec(stream, sent, first, last, tokens, error=None):
    return dict(stream=stream, sent=sent, first=first, last=last, tokens=tokens, error=error,
                end=last if last is not None else sent)


def reference(records, end, start=None):
    """Token times first + k * (last - first) / (tokens - 1), counted inside the window (from
    ``start``; None: when the last stream sent its first request)."""
    if start is None:
        start = max(min(r["sent"] for r in records if r["stream"] == s)
                    for s in {r["stream"] for r in records})
    n = 0.0
    for r in records:
        if r["error"] or not r["tokens"] or r["first"] is None:
            continue
        k = r["tokens"]
        step = (r["last"] - r["first"]) / (k - 1) if k > 1 else 0.0
        n += sum(start <= r["first"] + i * step <= end for i in range(k))
    return n / (end - start)


def test_window_starts_when_the_last_stream_starts_and_skips_failed_requests():
    records = [rec(0, 0.0, 0.5, 4.5, 9),     # 9 tokens spread over 0.5 .. 4.5
               rec(1, 2.0, 2.0, 4.0, 5),     # the last stream's first request: window from 2.0
               rec(1, 4.0, 5.0, 9.0, 5),     # starts at the window's end: none of it counted
               rec(0, 4.5, 4.6, 4.8, 3, error="stream cut"),  # failed: not counted
               rec(0, 0.1, 1.0, 1.0, 1),     # one token before the window: not counted
               rec(0, 4.8, 4.9, 4.9, 1)]     # one token inside it: counted
    # stream 0: of 9 tokens over 0.5 .. 4.5, the part 2.0 .. 4.5 (9 * 2.5 / 4), and one more;
    # stream 1: all 5 of its first request
    assert bench_serve.window_tokens_per_s(records, 5.0) == pytest.approx(
        (9 * 2.5 / 4 + 1 + 5) / 3)
    assert bench_serve.window_tokens_per_s(records, 2.0) is None


def test_window_ends_when_a_stream_ran_out_of_requests_before_the_deadline():
    records = [rec(0, 0.0, 0.1, 3.0, 9), rec(0, 3.0, 3.1, 6.0, 9),  # its whole share of 2
               rec(1, 1.0, 1.1, 9.0, 9),                             # 1 of its share of 3
               rec(2, 1.5, 1.6, 7.0, 9), rec(2, 7.0, 7.1, 11.0, 9)]  # all 2, past the deadline
    assert bench_serve.window_end(records, [2, 3, 2], 10.0) == (6.0, 1)
    assert bench_serve.window_end(records, [3, 3, 3], 10.0) == (10.0, 0)
    assert bench_serve.window_end(records, [2, 3, 2], 5.0) == (5.0, 0)


@pytest.mark.parametrize("seed", range(5))
def test_window_agrees_with_counting_token_times(seed):
    rng = random.Random(seed)
    records = []
    for s in range(rng.randint(2, 7)):
        t = rng.uniform(0, 2)
        for _ in range(rng.randint(1, 6)):
            k = rng.randint(1, 400)
            first = t + rng.uniform(0.01, 0.2)
            last = first + (k - 1) * rng.uniform(0.002, 0.03)
            records.append(rec(s, t, first, last, k))
            t = last
    end = rng.uniform(3, 8)
    got = bench_serve.window_tokens_per_s(records, end)
    start = max(min(r["sent"] for r in records if r["stream"] == s)
                for s in {r["stream"] for r in records})
    # even spread against whole tokens: at most one token apart per request at each edge
    assert got == pytest.approx(reference(records, end), abs=2 * len(records) / (end - start))


@pytest.mark.parametrize("seed", range(3))
def test_open_loop_window_counts_from_the_first_arrival(seed):
    """The open loop's window runs from the first arrival (an explicit start), not from when
    the last stream started: one stream per request, arrivals spread over the window."""
    rng = random.Random(seed)
    records = []
    for s in range(40):
        t = rng.uniform(0, 5)
        k = rng.randint(1, 200)
        first = t + rng.uniform(0.01, 0.3)
        records.append(rec(s, t, first, first + (k - 1) * rng.uniform(0.002, 0.03), k))
    start = min(r["sent"] for r in records)
    got = bench_serve.window_tokens_per_s(records, 5.0, start)
    assert got == pytest.approx(reference(records, 5.0, start), abs=2 * len(records) / 5)
    assert got != pytest.approx(bench_serve.window_tokens_per_s(records, 5.0))


def test_open_workload_is_poisson_with_some_streams_closed(monkeypatch):
    """Arrivals of a Poisson process of the offered rate within the duration (their count
    within 5% of rate x duration for 5000 expected), one request per stream, in order; about
    the asked share closed after 2 .. 5 chunks, the others run to their end."""
    monkeypatch.setattr(bench_serve, "workload", lambda tok, streams, count, args, seed: [
        (0.0, [(f"p{i}", 8 + i % 5) for i in range(count)])])
    args = types.SimpleNamespace(duration=100.0, close_early=0.1)
    load = bench_serve.open_workload(None, 50.0, args, seed=3)
    arrivals = [at for at, _ in load]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 100.0
    assert abs(len(load) - 5000) < 250
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert all(len(items) == 1 for _, items in load)
    closed = [items[0][2] for _, items in load if len(items[0]) == 3]
    assert abs(len(closed) / len(load) - 0.1) < 0.02 and set(closed) <= {2, 3, 4, 5}
    assert [items[0][:2] for _, items in load] == [(f"p{i}", 8 + i % 5) for i in range(len(load))]


def test_window_counts_what_closed_and_unfinished_requests_received():
    """A request its client closed, or one given up at the drain limit, has no usage figure:
    its content chunks (a token each) count; a failed request's do not."""
    closed = dict(rec(0, 0.0, 1.0, 2.0, None), chunks=5, closed=True)
    unfinished = dict(rec(1, 0.0, 1.0, 3.0, None, error=bench_serve.UNFINISHED), chunks=9)
    failed = dict(rec(2, 0.0, 1.0, 2.0, None, error="HTTP 500"), chunks=4)
    done = rec(3, 0.0, 1.0, 2.0, 3)
    got = bench_serve.window_tokens_per_s([closed, unfinished, failed, done], 4.0, 0.0)
    assert got == pytest.approx((5 + 9 + 3) / 4.0)
    assert bench_serve.window_tokens_per_s([], 4.0, 0.0) is None
    assert bench_serve.summarize([], 4.0, 0, start=0.0)["requests"] == 0


def _level(tps, tpot):
    return dict(tokens_per_s=tps, span_tokens_per_s=tps, tpot_ms=dict(p50=tpot))


def test_merge_puts_release_lines_in_one_level_and_rates_zos_against_the_best(tmp_path):
    """Two runs on one GPU (one per transformers release line) merge into one file: each
    level holds every run's servers, and a zos server's ratios are to the best transformers
    server of either line (highest tokens/s, lowest median TPOT), old ratios dropped."""
    def run(name, date, levels):
        path = tmp_path / name
        path.write_text(json.dumps(dict(gpu="G", date=date, transformers="x", args={},
                                        results=[dict(model="m", levels=levels)])))
        return str(path)

    a = run("a.json", "2026-12-06", {"16.0": {
        "tf_graphs_async@5.17.0": _level(100.0, 40.0), "zos@5.17.0": _level(300.0, 5.0),
        "zos@5.17.0_over_best_tf": {"stale": 1}}})
    b = run("b.json", "2026-12-07", {"16.0": {
        "tf_graphs@5.25.0": _level(200.0, 20.0), "zos@5.25.0": _level(500.0, 4.0)}})
    doc = json.loads(bench_serve.merge([a, b], tmp_path).read_text())
    assert doc["date"] == "2026-12-07" and len(doc["merged_from"]) == 2
    lv = doc["results"][0]["levels"]["16.0"]
    assert lv["zos@5.17.0_over_best_tf"]["tokens_per_s"] == pytest.approx(1.5)
    assert lv["zos@5.25.0_over_best_tf"]["tokens_per_s"] == pytest.approx(2.5)
    assert lv["zos@5.25.0_over_best_tf"]["tpot_p50"] == pytest.approx(0.2)
    c = run("c.json", "2026-12-07", {"48.0": {"zos@5.25.0": _level(1.0, 1.0)}})
    with pytest.raises(ValueError, match="levels"):
        bench_serve.merge([a, c], tmp_path)
    d = run("serve_G_2026-12-07.json", "2026-12-07", {"16.0": {}})
    with pytest.raises(ValueError, match="is one of the runs merged"):
        bench_serve.merge([a, d], tmp_path)


def test_server_spec_names_its_release_and_refuses_a_bad_one(tmp_path):
    """``KIND@DIR`` runs with DIR first on the path; an unknown kind, a DIR without
    transformers or, for the vLLM servers, a vLLM that does not import is refused before any
    server starts."""
    import transformers

    assert bench_serve.parse_server("zos") == ("zos", None, f"zos@{transformers.__version__}")
    with pytest.raises(ValueError, match="kind 'sglang'"):
        bench_serve.parse_server("sglang")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("__version__ = '0.26.0'")
    assert bench_serve.parse_server(f"vllm_zos@{tmp_path}") == (
        "vllm_zos", str(tmp_path), "vllm_zos@vllm0.26.0")
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('no vllm')")
    with pytest.raises(ValueError, match="(?s)vllm does not import: .*no vllm"):
        bench_serve.parse_server(f"vllm@{tmp_path}")
    with pytest.raises(ValueError, match="no transformers"):
        bench_serve.parse_server(f"tf_graphs@{tmp_path}")
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("raise ImportError('broken')")
    with pytest.raises(ValueError, match="(?s)does not import: .*ImportError: broken"):
        bench_serve.parse_server(f"tf_graphs@{tmp_path}")


def test_two_servers_of_one_kind_and_release_are_refused(capsys):
    assert bench_serve.main(["--servers", "zos,zos", "--smoke"]) == 2
    assert "same kind and release" in capsys.readouterr().err


def test_gpu_util_samples_on_a_thread_and_windows_by_time():
    """bench/gpu_util.py with a stand-in reader and clock: samples are taken on its thread
    until stop, each stamped when read; a window holds those stamped inside it; without a
    reader nothing is sampled."""
    gpu_util = importlib.import_module("gpu_util")  # bench/, on the path since bench_serve
    values = itertools.chain([10.0, 90.0, 100.0, 40.0, 0.0], itertools.repeat(50.0))
    clock = itertools.count(100.0)
    five = threading.Semaphore(0)

    def read():
        five.release()
        return next(values)
    util = gpu_util.GpuUtil(read, interval_s=0.001, clock=lambda: next(clock)).start()
    for _ in range(5):
        assert five.acquire(timeout=30)
    util.stop()
    assert util.samples[:5] == [(100.0, 10.0), (101.0, 90.0), (102.0, 100.0), (103.0, 40.0),
                                (104.0, 0.0)]
    assert util.window(101.0, 103.0) == dict(mean=pytest.approx(230 / 3, abs=0.05), p50=90.0,
                                             samples=3)
    assert util.window(98.0, 99.5) is None
    off = gpu_util.GpuUtil(None).start()
    off.stop()
    assert off.samples == [] and off.window(0, 1e12) is None
