"""The report of ``zos demo``: a table per backend, ``report.md``, ``report.png``, ``report.json``.

Figures per backend come from :class:`zos.serving.types.RunResult` (totals and per-step
records). On CUDA the H2D bytes per decode step come from ``torch.profiler`` samples, and the
report compares the backends' host times and bytes (host/zos ratios). On a CPU nothing is
copied host-to-device and zos's prep kernels run in Triton's interpreter, so the report shows
correctness (identical tokens) and the bytes each backend hands to its copies, labels its
times as CPU times that compare nothing, and computes no ratio.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from datetime import datetime

import torch

BACKENDS = ("host", "zos")
CPU_BYTES = "bytes handed to the copies"
CPU_BYTES_SOURCE = ("bytes each backend hands to its copies per decode step, counted by the "
                    "backend (on a CPU there is no host-to-device copy to observe)")
CPU_TIMES = ("CPU times, not comparable: zos's metadata time is its prep kernels run by "
             "Triton's CPU interpreter, the host backend's is numba and CPU copies; neither "
             "says what a GPU does, so no host/zos ratio is computed")
NO_PNG = "report.png skipped: matplotlib is not installed (pip install matplotlib)"
TAIL_TOKENS = 32  # prompt tail shown with each sample text


def _median(xs):
    return statistics.median(xs) if xs else None


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def summarize(result, samples: list | None) -> dict:
    """One backend's figures: engine totals, metadata-us median/mean and upload-bytes median
    over decode steps, profiled H2D median (None without samples), per-decode-step series."""
    dec = [r for r in result.steps if r.kind == "decode"]
    us, counted = [r.metadata_us for r in dec], [r.upload_bytes for r in dec]
    h2d = [x["h2d_bytes"] for x in samples or []]
    reasons: dict[str, int] = {}
    for r in dec:
        if r.path == "eager":
            key = r.eager_reason or "unknown"
            reasons[key] = reasons.get(key, 0) + 1
    return dict(totals=dict(result.totals), eager_reasons=reasons, metadata_us_median=_median(us),
                metadata_us_mean=_mean(us), upload_bytes_median=_median(counted),
                h2d_bytes_median=_median(h2d) if samples else None, h2d_samples=samples or [],
                series=dict(step=[r.step for r in dec], num_reqs=[r.num_reqs for r in dec],
                            padded_size=[r.padded_size for r in dec], path=[r.path for r in dec],
                            metadata_us=us, upload_bytes=counted,
                            seconds=[r.seconds for r in dec]))


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


def build_report(s: dict, info: dict, slice_, runs: dict, profiled: dict, mismatch,
                 samples: list, device: torch.device) -> dict:
    """The report dict: ``device`` ("cuda" or "cpu"), ``setup`` (device, versions, date,
    model, trace slice, engine sizes), ``backends`` (:func:`summarize` per backend),
    ``identical``, ``mismatch``, ``distinct_completions`` (distinct token sequences among the
    requests' outputs), ``samples``, ``bytes_source``; on CUDA ``ratios`` host/zos
    (metadata us and H2D bytes, medians), on a CPU ``cpu_times`` (why there is no ratio)."""
    import triton

    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    backends = {b: summarize(runs[b], profiled.get(b) if cuda else None) for b in BACKENDS}
    h, z = backends["host"], backends["zos"]
    n = len(h["h2d_samples"])
    report = dict(
        device=device.type,
        setup=dict(device=device.type, device_name=name, torch=torch.__version__,
                   triton=triton.__version__, python=platform.python_version(),
                   date=datetime.now().isoformat(timespec="seconds"),
                   triton_interpret=os.environ.get("TRITON_INTERPRET") or "unset", **info,
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
                   seed=s["seed"],
                   eos="ignored (outputs follow the trace's lengths)",
                   warm_up="2 short requests per backend, graphs off, before the timed runs"),
        bytes_source=(f"torch.profiler H2D, {n} sampled decode steps of a separate profiled run"
                      if cuda else CPU_BYTES_SOURCE),
        backends=backends, identical=mismatch is None, mismatch=mismatch, samples=samples,
        distinct_completions=len({tuple(v) for v in runs["zos"].outputs.values()}))
    if cuda:
        report["ratios"] = dict(
            metadata_us_median=_ratio(h["metadata_us_median"], z["metadata_us_median"]),
            h2d_bytes_median=_ratio(h["h2d_bytes_median"], z["h2d_bytes_median"]))
    else:
        report["cpu_times"] = CPU_TIMES
    return report


def _fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.{nd}f}"
    return f"{int(x):,}"


def table_rows(report: dict) -> list[tuple[str, str, str]]:
    """``(label, host, zos)`` rows of the comparison table. On a CPU the time rows say what
    each backend's time is (numba / Triton interpreter) and the bytes row what is counted."""
    b = report["backends"]
    cpu = report["device"] == "cpu"

    def row(label, f, tags=("", "")):
        return (label, *(f(b[k]) + t for k, t in zip(BACKENDS, tags)))

    def tot(k, nd=1):
        return lambda x: _fmt(x["totals"][k], nd)

    what = (" (numba)", " (interpreter)") if cpu else ("", "")
    cpu_label = " (CPU, not comparable)" if cpu else ""
    rows = [row("requests", tot("requests")),
            row("steps (prefill / decode)", lambda x: f"{x['totals']['prefill_steps']} / "
                f"{x['totals']['decode_steps']}"),
            row("generated tokens", tot("tokens")),
            row(f"tokens/s{cpu_label}", tot("tokens_per_s")),
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
                 " (" + ", ".join(f"{k} {v}" for k, v in sorted(x["eager_reasons"].items()))
                 + ")" if x["eager_reasons"] else "")),
             row("graph evictions", tot("graph_evictions")),
             row("preemptions", tot("preemptions")), row("capture s", tot("capture_s", 2))]
    return rows


def format_table(report: dict) -> str:
    """The table as Markdown (also readable as plain text); below it the host/zos ratios on
    CUDA, or on a CPU what the run shows and why its times compare nothing."""
    rows = table_rows(report)
    w = max(len(r[0]) for r in rows)
    c = max(12, *(len(x) for r in rows for x in r[1:]))
    lines = [f"| {'':<{w}} | {'host':>{c}} | {'zos':>{c}} |",
             f"|{'-' * (w + 2)}|{'-' * (c + 1)}:|{'-' * (c + 1)}:|"]
    lines += [f"| {a:<{w}} | {h:>{c}} | {z:>{c}} |" for a, h, z in rows]
    if report["device"] == "cpu":
        lines += ["", "- CPU run: it shows that both backends generate identical tokens and "
                  "how many bytes each hands to its copies.",
                  f"- {CPU_TIMES[0].upper()}{CPU_TIMES[1:]}."]
    else:
        r = report["ratios"]
        ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        lines += ["", f"- host/zos metadata us per decode step (median): "
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


def plot(report: dict, path: str) -> None:
    """Two panels, x = decode step, one line per backend. CUDA: upload bytes per decode step
    (profiler samples marked) and host metadata microseconds per decode step. CPU: the bytes
    each backend hands to its copies, and the rows of each step; no times (zos's are Triton's
    interpreter, which says nothing about a GPU). ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = report["device"] == "cpu"
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5))
    for name, color, mark in zip(BACKENDS, ("tab:red", "tab:blue"), ("x", "+")):
        b = report["backends"][name]
        ser = b["series"]
        ax1.plot(ser["step"], ser["upload_bytes"], ".-", ms=3, lw=0.8, color=color,
                 label=name if cpu else f"{name} (counted)")
        if b["h2d_samples"]:
            ax1.plot([x["step"] for x in b["h2d_samples"]],
                     [x["h2d_bytes"] for x in b["h2d_samples"]], mark, ms=8, color=color,
                     label=f"{name} (torch.profiler)")
        if not cpu:
            ax2.plot(ser["step"], ser["metadata_us"], ".-", ms=3, lw=0.8, color=color,
                     label=name)
    if cpu:
        ser = report["backends"]["host"]["series"]  # the same steps for both backends
        ax2.plot(ser["step"], ser["num_reqs"], ".-", ms=3, lw=0.8, color="tab:gray",
                 label="request rows N (both backends)")
        ax1.set_ylabel(f"{CPU_BYTES}\nper decode step (no H2D on CPU)", fontsize=8)
        ax1.set_title("CPU: bytes each backend hands to its copies (no host-to-device copy)",
                      fontsize=8)
        ax2.set_ylabel("request rows per decode step")
        ax2.yaxis.get_major_locator().set_params(integer=True)
        ax2.set_title("no times plotted on a CPU: zos's prep kernels run in Triton's "
                      "interpreter there, which says nothing about a GPU", fontsize=8)
    else:
        ax1.set_ylabel("H2D bytes / decode step")
        ax1.set_title(report["bytes_source"], fontsize=8)
        ax2.set_ylabel("host metadata us / decode step")
        ax2.set_title("stage (+ eager build); graph steps build inside the replay", fontsize=8)
        ax2.set_yscale("log")
    ax1.set_yscale("log")
    ax2.set_xlabel("decode step")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    s = report["setup"]
    fig.suptitle(f"zos demo: {s['model']} on {s['device_name']}, trace {s['trace']} "
                 f"[{s['start']}, {s['start'] + s['num_requests']}) / {s['scale']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
