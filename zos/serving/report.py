"""The report of ``zos demo``: a table per backend, ``report.md``, ``report.png``, ``report.json``.

Figures per backend come from :class:`zos.serving.types.RunResult` (totals and per-step
records) of each of its runs and from the runs' wall time split into prefill and decode
(:mod:`zos.serving.run_timing`). Times are given as what they cover: decode time per step
(TPOT: the time between two tokens of a running request) with its quartiles over every decode
step of every run, prefill and decode seconds per run with the range over runs, and tokens/s
of whole runs, prefill included. On CUDA the H2D bytes per decode step come from
``torch.profiler`` samples, and the report compares the backends (host/zos ratios, and whether
the runs' ranges of TPOT overlap). On a CPU nothing is copied host-to-device and zos's prep
kernels run in Triton's interpreter, so the report shows correctness (identical tokens) and
the bytes each backend hands to its copies, labels its times as CPU times that compare nothing,
and computes no ratio.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from datetime import datetime

import torch

from zos.serving import run_timing
from zos.serving.report_plot import BACKENDS, CPU_BYTES, plot

CPU_BYTES_SOURCE = ("bytes each backend hands to its copies per decode step, counted by the "
                    "backend (on a CPU there is no host-to-device copy to observe)")
CPU_TIMES = ("CPU times, not comparable: zos's metadata time is its prep kernels run by "
             "Triton's CPU interpreter, the host backend's is numba and CPU copies; neither "
             "says what a GPU does, so no host/zos ratio is computed")
GPU_ADDS = ("A GPU run adds what this CPU run cannot show: CUDA graphs per bucket (prep "
            "kernels, forward and sampling replayed as one graph), the model's fused Triton "
            "kernels compiled, the bytes of its host-to-device copies measured with "
            "torch.profiler, and host/zos ratios of metadata time and TPOT")
CPU_EAGER = "graphs off on CPU"
NO_PNG = "report.png skipped: matplotlib is not installed (pip install matplotlib)"
TAIL_TOKENS = 32  # prompt tail shown with each sample text


def _median(xs):
    return statistics.median(xs) if xs else None


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def summarize(results: list, phases: list, samples: list | None, cpu: bool) -> dict:
    """One backend's figures over its runs (``results``: RunResults in run order, ``phases``:
    their :func:`zos.serving.run_timing.run_phases`): the first run's totals and per-decode-step
    series, eager reasons (on a CPU every eager step is "graphs off on CPU"), metadata-us
    median/mean and upload-bytes median over the decode steps of every run, the timing
    (``tpot_s``: spread over every decode step of every run; ``decode_s_per_run``,
    ``prefill_s_per_run``, ``mean_tpot_s_per_run``, ``tokens_per_s_per_run``: spread over runs,
    ``runs``), profiled H2D median (None without samples)."""
    first = results[0]
    dec = [r for res in results for r in res.steps if r.kind == "decode"]
    us, counted = [r.metadata_us for r in dec], [r.upload_bytes for r in dec]
    h2d = [x["h2d_bytes"] for x in samples or []]
    reasons: dict[str, int] = {}
    for r in first.steps:
        if r.kind == "decode" and r.path == "eager":
            key = CPU_EAGER if cpu else (r.eager_reason or "unknown")
            reasons[key] = reasons.get(key, 0) + 1
    spread = run_timing.spread
    timing = dict(
        runs=len(results), tpot_s=spread([t for p in phases for t in p["tpot_s"]]),
        decode_s_per_run=spread([p["decode_s"] for p in phases]),
        prefill_s_per_run=spread([p["prefill_s"] for p in phases]),
        mean_tpot_s_per_run=spread([p["decode_s"] / p["decode_steps"] for p in phases
                                    if p["decode_steps"]]),
        tokens_per_s_per_run=spread([r.totals["tokens_per_s"] for r in results]))
    first_dec = [r for r in first.steps if r.kind == "decode"]
    return dict(totals=dict(first.totals), eager_reasons=reasons, timing=timing,
                metadata_us_median=_median(us), metadata_us_mean=_mean(us),
                upload_bytes_median=_median(counted),
                h2d_bytes_median=_median(h2d) if samples else None, h2d_samples=samples or [],
                series=dict(step=[r.step for r in first_dec],
                            num_reqs=[r.num_reqs for r in first_dec],
                            padded_size=[r.padded_size for r in first_dec],
                            path=[r.path for r in first_dec],
                            metadata_us=[r.metadata_us for r in first_dec],
                            upload_bytes=[r.upload_bytes for r in first_dec],
                            tpot_s=phases[0]["tpot_s"]))


def _ratio(a, b):
    return a / b if a is not None and b else None


def first_mismatch(a: dict, b: dict) -> str | None:
    """None if the two ``{req_id: tokens}`` maps are equal, else where they first differ."""
    for rid in sorted(set(a) | set(b)):
        x, y = a.get(rid), b.get(rid)
        if x != y:
            if x is None or y is None:
                return f"request {rid} missing from one run"
            k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return (f"request {rid}: first difference at output token {k} "
                    f"(host {x[k:k + 4]}, zos {y[k:k + 4]}; lengths {len(x)}, {len(y)})")
    return None


def sample_texts(prompts, outputs, tokenizer, n=3) -> list[dict]:
    """The ``n`` requests with the longest outputs: prompt tail and completion (decoded
    with ``tokenizer``, or token ids without one)."""
    ids = sorted(outputs, key=lambda r: (-len(outputs[r]), r))[:n]
    dec = (lambda t: tokenizer.decode(t)) if tokenizer is not None else (lambda t: str(t))
    return [dict(request=r, prompt_tail=dec(prompts[r][-TAIL_TOKENS:]),
                 completion=dec(outputs[r])) for r in ids]


def format_samples(samples: list[dict], width: int = 400) -> str:
    """The sample texts for the console: whitespace collapsed, shortened to ``width``."""
    def one(t):
        t = " ".join(t.split())
        return t if len(t) <= width else t[:width - 3] + "..."
    return "".join(f"\n[request {x['request']}] ...{one(x['prompt_tail'])}\n  >>> "
                   f"{one(x['completion'])}\n" for x in samples)


def build_report(s: dict, info: dict, slice_, runs: dict, phases: dict, profiled: dict,
                 mismatch, samples: list, device: torch.device, order: list[str]) -> dict:
    """The report dict: ``device`` ("cuda" or "cpu"), ``setup`` (device, versions, date,
    model, trace slice, engine sizes, runs per backend and their order), ``backends``
    (:func:`summarize` per backend, from ``runs[b]`` / ``phases[b]``: lists in run order),
    ``identical``, ``mismatch``, ``distinct_completions`` (distinct token sequences among the
    requests' outputs), ``samples``, ``bytes_source``; on CUDA ``ratios`` host/zos (metadata us
    and H2D bytes, medians; TPOT, median of steps) and ``tpot_runs_overlap`` (whether the
    backends' ranges of per-run mean TPOT overlap; None with one run each), on a CPU
    ``cpu_times`` (why there is no ratio) and ``gpu_adds`` (what a GPU run adds)."""
    import triton

    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    backends = {b: summarize(runs[b], phases[b], profiled.get(b) if cuda else None, not cuda)
                for b in BACKENDS}
    h, z = backends["host"], backends["zos"]
    n = len(h["h2d_samples"])
    repeats = len(runs["host"])
    report = dict(
        device=device.type,
        setup=dict(device=device.type, device_name=name, torch=torch.__version__,
                   triton=triton.__version__, python=platform.python_version(),
                   date=datetime.now().isoformat(timespec="seconds"),
                   triton_interpret=os.environ.get("TRITON_INTERPRET") or "unset",
                   torch_threads=torch.get_num_threads(), **info,
                   model_kernels="Triton (compiled)" if cuda else
                   "torch ops (zos's prep kernels in Triton's interpreter)",
                   trace=s["trace"], start=s["start"], num_requests=len(slice_),
                   scale=s["scale"], max_prompt=s["max_prompt"], max_output=s["max_output"],
                   prompt_tokens=sum(r.prompt_len for r in slice_),
                   output_tokens=sum(r.output_len for r in slice_),
                   max_model_len=s["max_model_len"], block_size=s["block_size"],
                   num_kv_blocks=s["num_kv_blocks"], max_num_seqs=s["max_num_seqs"],
                   bucket_policy=s["bucket_policy"], graphs=s["graphs"], overlap=s["overlap"],
                   graph_capture=s.get("graph_capture", "eager"),
                   graph_memory_budget=s.get("graph_memory_budget"),
                   spec=s.get("spec"), num_draft_tokens=s.get("num_draft_tokens", 0),
                   seed=s["seed"], repeats=repeats, run_order=", ".join(order),
                   eos="ignored (outputs follow the trace's lengths)",
                   warm_up="2 short requests per backend, graphs off, before the timed runs"),
        bytes_source=(f"torch.profiler H2D, {n} sampled decode steps of a separate profiled run"
                      if cuda else CPU_BYTES_SOURCE),
        backends=backends, identical=mismatch is None, mismatch=mismatch, samples=samples,
        distinct_completions=len({tuple(v) for v in runs["zos"][0].outputs.values()}))
    if cuda:
        ht, zt = h["timing"], z["timing"]
        report["ratios"] = dict(
            metadata_us_median=_ratio(h["metadata_us_median"], z["metadata_us_median"]),
            h2d_bytes_median=_ratio(h["h2d_bytes_median"], z["h2d_bytes_median"]),
            tpot_median=_ratio(*(t["tpot_s"] and t["tpot_s"]["median"] for t in (ht, zt))))
        report["tpot_runs_overlap"] = (run_timing.overlap(ht["mean_tpot_s_per_run"],
                                                          zt["mean_tpot_s_per_run"])
                                       if repeats > 1 else None)
    else:
        report["cpu_times"] = CPU_TIMES
        report["gpu_adds"] = GPU_ADDS
    return report


def _fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.{nd}f}"
    return f"{int(x):,}"


def _range(sp: dict | None, scale: float = 1.0, nd: int = 1, iqr: bool = False) -> str:
    """``median [low-high]`` of a :func:`zos.serving.run_timing.spread` (quartiles with
    ``iqr``, else min-max), each value times ``scale``; the median alone for one value."""
    if sp is None:
        return "-"
    lo, hi = (sp["q1"], sp["q3"]) if iqr else (sp["min"], sp["max"])
    f = lambda x: f"{x * scale:,.{nd}f}"  # noqa: E731
    return f(sp["median"]) if sp["n"] == 1 else f"{f(sp['median'])} [{f(lo)}-{f(hi)}]"


def table_rows(report: dict) -> list[tuple[str, str, str]]:
    """``(label, host, zos)`` rows of the comparison table; each time row says what it covers
    (see :func:`time_notes`). On a CPU the time rows are marked as CPU times that compare
    nothing and the bytes row says what is counted."""
    b = report["backends"]
    cpu = report["device"] == "cpu"

    def row(label, f, tags=("", "")):
        return (label, *(f(b[k]) + t for k, t in zip(BACKENDS, tags)))

    def tot(k, nd=1):
        return lambda x: _fmt(x["totals"][k], nd)

    def tim(k, scale=1.0, nd=1, iqr=False):
        return lambda x: _range(x["timing"][k], scale, nd, iqr)

    what = (" (numba)", " (interpreter)") if cpu else ("", "")
    cpu_label = " (CPU, not comparable)" if cpu else ""
    runs = b["host"]["timing"]["runs"]
    over = f", range of {runs} runs" if runs > 1 else ""
    rows = [row("requests", tot("requests")),
            row("steps (prefill / decode)", lambda x: f"{x['totals']['prefill_steps']} / "
                f"{x['totals']['decode_steps']}"),
            row("generated tokens", tot("tokens")),
            row(f"decode ms / step (TPOT), median [IQR] of all steps{cpu_label}",
                tim("tpot_s", 1e3, iqr=True)),
            row(f"decode s / run{over}{cpu_label}", tim("decode_s_per_run", nd=2)),
            row(f"prefill s / run{over}{cpu_label}", tim("prefill_s_per_run", nd=2)),
            row(f"tokens/s, whole run incl. prefill{over}{cpu_label}",
                tim("tokens_per_s_per_run")),
            row(f"metadata us / decode step, median{cpu_label}",
                lambda x: _fmt(x["metadata_us_median"]), what),
            row(f"metadata us / decode step, mean{cpu_label}",
                lambda x: _fmt(x["metadata_us_mean"]), what)]
    if cpu:
        rows.append(row(f"{CPU_BYTES} / decode step, median (no H2D on CPU)",
                        lambda x: _fmt(x["upload_bytes_median"])))
    else:
        rows += [row("H2D bytes / decode step, median (torch.profiler)",
                     lambda x: _fmt(x["h2d_bytes_median"])),
                 row("upload bytes / decode step, median (counted by the backend)",
                     lambda x: _fmt(x["upload_bytes_median"]))]
    if "acceptance_rate" in b["host"]["totals"]:
        rows += [row("draft acceptance rate", tot("acceptance_rate", 3)),
                 row("tokens per request row and step", tot("mean_tokens_per_row", 2))]
    rows += [row("graphs captured", tot("graphs_captured")),
             row("eager decode steps (why)", lambda x: _fmt(x["totals"]["eager_decode_steps"]) + (
                 " (" + ", ".join(f"{k}: {v}" for k, v in sorted(x["eager_reasons"].items()))
                 + ")" if x["eager_reasons"] else "")),
             row("graph evictions", tot("graph_evictions")),
             row("preemptions", tot("preemptions")), row("capture s", tot("capture_s", 2))]
    return rows


def time_notes(report: dict) -> list[str]:
    """What each time row covers, and how the runs were ordered (one line each)."""
    s = report["setup"]
    runs = s["repeats"]
    order = ("one run per backend, host first" if runs == 1 else
             f"{runs} runs per backend in alternating order ({s['run_order']})")
    return [f"Runs: {order}, after a warm-up of both backends; every run generated the same "
            "tokens." if report["identical"] else f"Runs: {order}, after a warm-up.",
            "TPOT: the wall time of each engine step minus its prefill, per decode step (the "
            "time between two tokens of a running request: metadata, model, sampling, token "
            "read-back); median and interquartile range over the decode steps of every run.",
            "decode s / prefill s per run: the sums of those decode and prefill parts in one "
            "run (prefill: the packed prompt forward and its sampled tokens' copy to the host)"
            + (f"; median [min-max] over {runs} runs." if runs > 1 else "."),
            "tokens/s: generated tokens over a whole run's wall time, prefill included."]


def format_table(report: dict) -> str:
    """The table as Markdown (also readable as plain text); below it what each time row
    covers, then the host/zos ratios on CUDA, or on a CPU what the run shows, why its times
    compare nothing and what a GPU run adds."""
    rows = table_rows(report)
    w = max(len(r[0]) for r in rows)
    c = max(12, *(len(x) for r in rows for x in r[1:]))
    lines = [f"| {'':<{w}} | {'host':>{c}} | {'zos':>{c}} |",
             f"|{'-' * (w + 2)}|{'-' * (c + 1)}:|{'-' * (c + 1)}:|"]
    lines += [f"| {a:<{w}} | {h:>{c}} | {z:>{c}} |" for a, h, z in rows]
    lines += [""] + [f"- {x}" for x in time_notes(report)]
    if report["device"] == "cpu":
        lines += ["- CPU run: it shows that both backends generate identical tokens and "
                  "how many bytes each hands to its copies; the model runs torch ops, zos's "
                  "prep kernels run in Triton's interpreter.",
                  f"- {CPU_TIMES[0].upper()}{CPU_TIMES[1:]}.", f"- {report['gpu_adds']}."]
    else:
        r = report["ratios"]
        ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        over = report.get("tpot_runs_overlap")
        noise = ("one run per backend: no run-to-run spread to compare" if over is None else
                 "the backends' per-run ranges overlap: the difference is within run-to-run "
                 "noise" if over else "the backends' per-run ranges do not overlap")
        lines += [f"- host/zos TPOT (median of steps): {ratio(r['tpot_median'])} ({noise})",
                  f"- host/zos metadata us per decode step (median): "
                  f"{ratio(r['metadata_us_median'])}",
                  f"- host/zos H2D bytes per decode step (median): "
                  f"{ratio(r['h2d_bytes_median'])}"]
    return "\n".join(lines)


def _markdown(report: dict) -> str:
    s = report["setup"]
    out = ["# zos demo report", "", "## Setup", ""]
    out += [f"- **{k}**: {v}" for k, v in s.items()]
    out += [f"- **bytes source**: {report['bytes_source']}", "", "## Results", "",
            format_table(report), "", "## Identical tokens", "",
            "YES: both backends generated the same tokens for every request." if
            report["identical"] else f"**NO**: {report['mismatch']}", "",
            f"Distinct completions: {report['distinct_completions']} of "
            f"{report['setup']['num_requests']} requests (context-blind weights give one or "
            "a few, and then agreement proves little).", "", "## Sample texts", ""]
    for smp in report["samples"]:
        out += [f"### request {smp['request']}", "", "prompt tail:", "", "```",
                smp["prompt_tail"], "```", "", "completion:", "", "```", smp["completion"],
                "```", ""]
    out += ["## Per-step figures", ""]
    out += [f"{report['png_skipped']}." if report.get("png_skipped") else
            "![per-step figures](report.png)", ""]
    return "\n".join(x.rstrip() for x in out)


def write_report(report: dict, out_dir: str) -> dict:
    """Write ``report.png``, ``report.md`` and ``report.json`` into ``out_dir`` (created);
    returns ``{"md", "png", "json"}`` paths. Without matplotlib the picture is skipped: one
    line on stderr, ``report["png_skipped"]`` set (and so recorded in the md and the json),
    and no "png" path. OSError if ``out_dir`` cannot be written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"report.{k}") for k in ("md", "png", "json")}
    report.pop("png_skipped", None)
    try:
        plot(report, paths["png"])
    except ImportError:  # matplotlib is in the demo and test extras, not a dependency
        report["png_skipped"] = NO_PNG
        print(f"zos demo: {NO_PNG}", file=sys.stderr)
        del paths["png"]
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(_markdown(report))
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in report.items() if k != "paths"}, f, indent=1)
        f.write("\n")
    return paths
