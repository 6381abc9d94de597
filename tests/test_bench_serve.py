"""The server benchmark's window figure (``bench/bench_serve.py``): tokens per second while all C
streams are active, against a count of each token's arrival time (tokens spread evenly between
a request's first and last content chunk, as the benchmark assumes)."""
import importlib.util
import random
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_serve", Path(__file__).resolve().parent.parent / "bench" / "bench_serve.py")
bench_serve = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_serve)


def rec(stream, sent, first, last, tokens, error=None):
    return dict(stream=stream, sent=sent, first=first, last=last, tokens=tokens, error=error,
                end=last if last is not None else sent)


def reference(records, end):
    """Token times first + k * (last - first) / (tokens - 1), counted inside the window."""
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
