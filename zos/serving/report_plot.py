"""The picture of ``zos demo``'s report, ``report.png`` (matplotlib, optional)."""
from __future__ import annotations

BACKENDS = ("host", "zos")
CPU_BYTES = "bytes handed to the copies"


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
