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

from zos._interpret import kernels_interpreted

import json
import os
import platform
import statistics
import sys
from datetime import datetime

import torch

from zos.serving import run_timing
from zos.serving.report_plot import BACKENDS, plot
from zos.serving.report_table import CPU_TIMES, format_table, table_rows  # noqa: F401

CPU_BYTES_SOURCE = ("bytes each backend hands to its copies per decode step, counted by the "
                    "backend (on a CPU there is no host-to-device copy to observe)")
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
                   triton_kernels="interpreted" if kernels_interpreted() else "compiled",
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
