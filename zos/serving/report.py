"""The report of ``zos demo``: a table per backend, ``report.md``, ``report.png``, ``report.json``.

Figures per backend come from :class:`zos.engine.RunResult` (totals and per-step records);
the H2D bytes per decode step come from ``torch.profiler`` samples on CUDA, and from the
backends' own counts on the CPU (where there is no host-to-device copy to observe).
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
CPU_BYTES = "counted by the backend (no torch.profiler H2D on CPU)"
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
    return dict(totals=dict(result.totals), metadata_us_median=_median(us),
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
    """The report dict: ``setup`` (device, versions, date, model, trace slice, engine sizes),
    ``backends`` (:func:`summarize` per backend), ``ratios`` host/zos, ``identical``,
    ``mismatch``, ``samples``, ``h2d_source``."""
    import triton

    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    backends = {b: summarize(runs[b], profiled.get(b) if cuda else None) for b in BACKENDS}
    key = "h2d_bytes_median" if cuda else "upload_bytes_median"
    h, z = backends["host"], backends["zos"]
    n = len(h["h2d_samples"])
    return dict(
        setup=dict(device=device.type, device_name=name, torch=torch.__version__,
                   triton=triton.__version__, python=platform.python_version(),
                   date=datetime.now().isoformat(timespec="seconds"),
                   triton_interpret=os.environ.get("TRITON_INTERPRET", ""), **info,
                   trace=s["trace"], start=s["start"], num_requests=len(slice_),
                   scale=s["scale"], max_prompt=s["max_prompt"], max_output=s["max_output"],
                   prompt_tokens=sum(r.prompt_len for r in slice_),
                   output_tokens=sum(r.output_len for r in slice_),
                   max_model_len=s["max_model_len"], block_size=s["block_size"],
                   num_kv_blocks=s["num_kv_blocks"], max_num_seqs=s["max_num_seqs"],
                   bucket_policy=s["bucket_policy"], graphs=s["graphs"], seed=s["seed"],
                   eos="ignored (outputs follow the trace's lengths)",
                   warm_up="2 short requests per backend, graphs off, before the timed runs"),
        h2d_source=(f"torch.profiler, {n} sampled decode steps of a separate profiled run"
                    if cuda else CPU_BYTES),
        backends=backends, identical=mismatch is None, mismatch=mismatch, samples=samples,
        ratios=dict(metadata_us_median=_ratio(h["metadata_us_median"], z["metadata_us_median"]),
                    h2d_bytes_median=_ratio(h[key], z[key])))


def _fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.{nd}f}"
    return f"{int(x):,}"


def table_rows(report: dict) -> list[tuple[str, str, str]]:
    """``(label, host, zos)`` rows of the comparison table."""
    b = report["backends"]
    cuda = report["setup"]["device"] == "cuda"

    def row(label, f):
        return (label, *(f(b[k]) for k in BACKENDS))

    def tot(k, nd=1):
        return lambda x: _fmt(x["totals"][k], nd)

    rows = [row("requests", tot("requests")),
            row("steps (prefill / decode)", lambda x: f"{x['totals']['prefill_steps']} / "
                f"{x['totals']['decode_steps']}"),
            row("generated tokens", tot("tokens")), row("tokens/s", tot("tokens_per_s")),
            row("metadata us / decode step, median", lambda x: _fmt(x["metadata_us_median"])),
            row("metadata us / decode step, mean", lambda x: _fmt(x["metadata_us_mean"]))]
    if cuda:
        rows += [row("H2D bytes / decode step, median (torch.profiler)",
                     lambda x: _fmt(x["h2d_bytes_median"])),
                 row("upload bytes / decode step, median (counted by the backend)",
                     lambda x: _fmt(x["upload_bytes_median"]))]
    else:
        rows.append(row("H2D bytes / decode step, median (*)",
                        lambda x: _fmt(x["upload_bytes_median"])))
    rows += [row("graphs captured", tot("graphs_captured")),
             row("eager decode steps", tot("eager_decode_steps")),
             row("preemptions", tot("preemptions")), row("capture s", tot("capture_s", 2))]
    return rows


def format_table(report: dict) -> str:
    """The table as Markdown (also readable as plain text), with the host/zos ratios below."""
    rows = table_rows(report)
    w = max(len(r[0]) for r in rows)
    lines = [f"| {'':<{w}} | {'host':>12} | {'zos':>12} |", f"|{'-' * (w + 2)}|{'-' * 13}:|"
             f"{'-' * 13}:|"]
    lines += [f"| {a:<{w}} | {h:>12} | {z:>12} |" for a, h, z in rows]
    r = report["ratios"]
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    cpu = report["setup"]["device"] == "cpu"
    meta = ("n/a on CPU: zos's time there is Triton's interpreter running the prep kernels, "
            "which says nothing about GPU cost" if cpu else ratio(r["metadata_us_median"]))
    lines += ["", f"- host/zos metadata us per decode step (median): {meta}",
              f"- host/zos H2D bytes per decode step (median): {ratio(r['h2d_bytes_median'])}"]
    if cpu:
        lines += [f"- (*) {CPU_BYTES}.", "- On a CPU the run shows correctness (identical tokens) "
                  "and the upload sizes; time and tokens/s are for a GPU run."]
    return "\n".join(lines)


def _markdown(report: dict) -> str:
    s = report["setup"]
    out = ["# zos demo report", "", "## Setup", ""]
    out += [f"- **{k}**: {v}" for k, v in s.items()]
    out += [f"- **H2D bytes source**: {report['h2d_source']}", "", "## Results", "",
            format_table(report), "", "## Identical tokens", "",
            "YES: both backends generated the same tokens for every request." if
            report["identical"] else f"**NO**: {report['mismatch']}", "", "## Sample texts", ""]
    for smp in report["samples"]:
        out += [f"### request {smp['request']}", "", "prompt tail:", "", "```",
                smp["prompt_tail"], "```", "", "completion:", "", "```", smp["completion"],
                "```", ""]
    out += ["![per-step figures](report.png)", ""]
    return "\n".join(out)


def plot(report: dict, path: str) -> None:
    """Two panels, x = decode step: upload bytes per decode step (profiler samples marked on
    CUDA) and host metadata microseconds per decode step, one line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5))
    for name, color, mark in zip(BACKENDS, ("tab:red", "tab:blue"), ("x", "+")):
        b = report["backends"][name]
        ser = b["series"]
        ax1.plot(ser["step"], ser["upload_bytes"], ".-", ms=3, lw=0.8, color=color,
                 label=f"{name} (counted)")
        if b["h2d_samples"]:
            ax1.plot([x["step"] for x in b["h2d_samples"]],
                     [x["h2d_bytes"] for x in b["h2d_samples"]], mark, ms=8, color=color,
                     label=f"{name} (torch.profiler)")
        ax2.plot(ser["step"], ser["metadata_us"], ".-", ms=3, lw=0.8, color=color, label=name)
    cpu = report["setup"]["device"] == "cpu"
    ax1.set_ylabel("H2D bytes / decode step")
    ax1.set_title(CPU_BYTES if cpu else report["h2d_source"], fontsize=8)
    ax2.set_ylabel("host metadata us / decode step")
    ax2.set_title("CPU: zos's time includes its prep kernels run by the Triton interpreter"
                  if cpu else "stage (+ eager build); graph steps build inside the replay",
                  fontsize=8)
    ax2.set_xlabel("decode step")
    for ax in (ax1, ax2):
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    s = report["setup"]
    fig.suptitle(f"zos demo: {s['model']} on {s['device_name']}, trace {s['trace']} "
                 f"[{s['start']}, {s['start'] + s['num_requests']}) / {s['scale']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out_dir: str) -> dict:
    """Write ``report.md``, ``report.png`` and ``report.json`` into ``out_dir`` (created);
    returns ``{"md", "png", "json"}`` paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"report.{k}") for k in ("md", "png", "json")}
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(_markdown(report))
    try:
        plot(report, paths["png"])
    except ImportError as e:  # matplotlib is a demo extra
        print(f"zos demo: no report.png ({e}); pip install matplotlib", file=sys.stderr)
        del paths["png"]
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in report.items() if k != "paths"}, f, indent=1)
    return paths
