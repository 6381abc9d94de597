"""The comparison table of ``zos demo``'s report (console and ``report.md``): one row per
figure, each time row saying what it covers, and the lines below it (what each time covers, the
host/zos ratios on CUDA, on a CPU why its times compare nothing and what a GPU run adds)."""
from __future__ import annotations

from zos.serving.report_plot import BACKENDS, CPU_BYTES

CPU_TIMES = ("CPU times, not comparable: zos's metadata time is its prep kernels run by "
             "Triton's CPU interpreter, the host backend's is numba and CPU copies; neither "
             "says what a GPU does, so no host/zos ratio is computed")


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
                 row("upload bytes / decode step, median (counted by the backend: its copies, "
                     "or zos's record read from mapped host memory)",
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
                  "- host/zos H2D bytes per decode step (median): "
                  + ("zos makes no H2D copy (its staging record is read in place from mapped "
                     "host memory: the upload bytes row)"
                     if report["backends"]["zos"]["h2d_bytes_median"] == 0
                     else ratio(r["h2d_bytes_median"]))]
    return "\n".join(lines)
