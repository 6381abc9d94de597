"""Request traces for ``zos demo``: the Azure LLM inference trace 2023 and synthetic prompts.

The trace (``zos/serving/data/``, CC BY 4.0, see ``zos/serving/data/README.md``) gives, per
request, an arrival time, a prompt length and an output length, but no text. :func:`trace_slice`
takes a slice in arrival order and scales the lengths down (an integer divisor, then clamps) so
that they fit a small model and machine; :func:`synthesize_prompts` fills those lengths with
windows of real English prose (the docstrings of a fixed list of Python standard-library
modules, tokenized once), deterministically by seed.
"""
from __future__ import annotations

import csv
import functools
import importlib
import inspect
import io
import pydoc
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources

TRACES = ("conv", "code")
CORPUS_MODULES = ("argparse", "heapq", "itertools", "collections", "functools", "textwrap",
                  "random", "statistics", "unittest", "subprocess", "threading", "logging",
                  "http.client", "urllib.request", "sqlite3", "typing", "shutil", "pickle",
                  "string", "zipfile", "contextlib", "dataclasses", "pathlib", "json")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace slice.

    Attributes:
        index: row of the request in the trace file (0 = first request).
        arrival: seconds since the first request of the slice.
        prompt_len / output_len: scaled and clamped lengths (tokens) used by the demo.
        orig_prompt_len / orig_output_len: the trace's ``ContextTokens`` / ``GeneratedTokens``.
    """

    index: int
    arrival: float
    prompt_len: int
    output_len: int
    orig_prompt_len: int
    orig_output_len: int


def _parse_time(text: str) -> float:
    """``2023-11-16 18:15:46.6805900`` -> POSIX seconds (fraction kept to microseconds)."""
    head, _, frac = text.strip().partition(".")
    t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return t + (float("0." + frac) if frac else 0.0)


@functools.cache
def load_trace(name: str) -> tuple[tuple[float, int, int], ...]:
    """All rows of trace ``name`` ("conv" or "code") as ``(timestamp_s, prompt, output)``, in
    file (arrival) order, read from the package data with ``importlib.resources``.
    Raises ValueError for an unknown name."""
    if name not in TRACES:
        raise ValueError(f"trace: expected one of {TRACES}, got {name!r}")
    path = resources.files("zos.serving").joinpath(
        "data", f"azure_llm_inference_trace_2023_{name}.csv")
    rows = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))
    return tuple((_parse_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                 for r in rows)


def trace_slice(name: str, start: int, count: int, scale: int, *, max_prompt: int,
                max_output: int, min_prompt: int = 1, min_output: int = 1) -> list[TraceRequest]:
    """Requests ``start .. start + count - 1`` of trace ``name``, in arrival order, with
    ``prompt_len = clamp(ContextTokens // scale, min_prompt, max_prompt)`` and
    ``output_len = clamp(GeneratedTokens // scale, min_output, max_output)``.

    Raises ValueError: unknown trace, scale < 1, count < 1, a slice outside the trace, or
    clamps with min < 1 or min > max."""
    rows = load_trace(name)
    if scale < 1 or count < 1:
        raise ValueError(f"trace_slice: need scale >= 1 and count >= 1, got {scale}, {count}")
    if not 0 <= start or start + count > len(rows):
        raise ValueError(f"trace_slice: requests [{start}, {start + count}) outside the "
                         f"{len(rows)} requests of trace {name!r}")
    for what, lo, hi in (("prompt", min_prompt, max_prompt), ("output", min_output, max_output)):
        if not 1 <= lo <= hi:
            raise ValueError(f"trace_slice: {what} clamps need 1 <= min <= max, got {lo}, {hi}")
    t0 = rows[start][0]
    return [TraceRequest(i, rows[i][0] - t0,
                         min(max(rows[i][1] // scale, min_prompt), max_prompt),
                         min(max(rows[i][2] // scale, min_output), max_output),
                         rows[i][1], rows[i][2])
            for i in range(start, start + count)]


def _docs(module) -> list[str]:
    """The module's docstring, then those of its public classes and functions (by name)."""
    out = [pydoc.getdoc(module)]
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if (not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
                and getattr(obj, "__module__", None) == module.__name__):
            out.append(pydoc.getdoc(obj))
    return [d.strip() for d in out if d and len(d.strip()) > 40]


@functools.cache
def corpus_text() -> str:
    """Real English prose: the docstrings of :data:`CORPUS_MODULES` (modules and their public
    classes and functions), concatenated with blank lines. Fixed for a Python version."""
    parts: list[str] = []
    for m in CORPUS_MODULES:
        try:
            parts += _docs(importlib.import_module(m))
        except ImportError:  # pragma: no cover - a stripped-down Python
            continue
    return "\n\n".join(parts)


def corpus_ids(tokenizer) -> list[int]:
    """:func:`corpus_text` tokenized once with ``tokenizer`` (no special tokens)."""
    return list(tokenizer(corpus_text(), add_special_tokens=False)["input_ids"])


def synthesize_prompts(lengths: Sequence[int], ids: Sequence[int], seed: int) -> list[list[int]]:
    """One prompt per length: a window of ``ids`` (the tokenized corpus) at a seeded random
    offset; a length above the corpus size wraps around. Raises ValueError if ids is empty."""
    if not ids:
        raise ValueError("synthesize_prompts: empty corpus")
    rng, n = random.Random(seed), len(ids)
    out = []
    for length in lengths:
        off = rng.randrange(n)
        out.append([ids[(off + k) % n] for k in range(length)])
    return out


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int,
                   low: int = 3) -> list[list[int]]:
    """Seeded random token ids in ``[low, vocab_size)`` (no tokenizer; avoids the special
    ids below ``low``), one list per length."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(n)] for n in lengths]
