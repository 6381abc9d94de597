"""Where a server's time goes: runs ``zos serve`` or ``transformers serve`` in this process with
a stack sampler and a step log, for ``bench_serve.py --profile``.

Usage: python bench/serve_profile.py OUT.json zos|tf|tf_async SERVER ARGS...

* stack sampler: every ``ZOS_PROFILE_INTERVAL`` seconds (default 0.005) the Python stack of
  every thread (``sys._current_frames``); per thread: samples in total and, per function
  (file:name), the samples in which it was on the stack (inclusive) and on top (self). A
  thread waiting for the GIL shows at the line where it waits, so self counts of a busy
  process include GIL waits;
* CPU time per thread (Linux, ``/proc/self/task``): per 2-s window, each Python thread's user
  + system seconds (``cpu_windows``: [window end (perf_counter s), {thread: s}]). A thread
  running Python holds the GIL, so the Python threads' sum near 1 s per second means the
  process is bound by the GIL (a thread in a native wait, e.g. a spinning CUDA synchronize,
  burns CPU without it);
* step log: each ``ContinuousBatchingManager._generation_loop_body`` that ran a batch: start
  (perf_counter s), seconds, requests in the batch and query tokens (from the scheduler's
  ``schedule_batch``);
* zos's stages (``zos``): each ``ZosDecodeRows.stage`` timed, and the backend's stage inside
  it (``zos_stages``: [start, seconds, backend seconds, whether the step had a carry map]):
  what the rest of it (the carry map and its copy, a torch call that releases the GIL, the
  metadata views) costs, measured rather than sampled.

``OUT.json`` is rewritten every 2 s (the server is stopped with SIGTERM, which uvicorn handles).
transformers 5.25's server runs each model in a spawned process of its own (its manager, the
scheduler and the steps): that process profiles itself into ``OUT.model.json`` (the server's
loader is replaced by a subclass that starts the sampler and the step log where it loads the
model; this script is the spawned process's main module, so the subclass unpickles there).
"""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

_steps: list = []
_stages: list = []  # zos's decode stages: [start, seconds, backend's stage seconds, carry]
_sched: dict = {}
_MODEL_PROFILE = None  # (path, kind) of the model's process, set by main on transformers 5.25


def _thread_cpu() -> dict:
    """User + system CPU seconds of each live Python thread, by name ({} without /proc)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError, TypeError):
            continue
        out[t.name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return out


def _sampler(path: str, interval: float) -> None:
    me = threading.get_ident()
    cpu_windows: list = []
    last_cpu = _thread_cpu()
    inclusive: dict = collections.defaultdict(collections.Counter)
    self_: dict = collections.defaultdict(collections.Counter)
    total: collections.Counter = collections.Counter()
    last_dump = time.monotonic()
    while True:
        time.sleep(interval)
        names = {t.ident: t.name for t in threading.enumerate()}
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            name = names.get(tid, str(tid))
            total[name] += 1
            seen = set()
            top = True
            while frame is not None:
                code = frame.f_code
                key = f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_name}"
                if top:
                    self_[name][key] += 1
                    top = False
                if key not in seen:
                    seen.add(key)
                    inclusive[name][key] += 1
                frame = frame.f_back
        if time.monotonic() - last_dump > 2.0:
            last_dump = time.monotonic()
            cpu = _thread_cpu()
            cpu_windows.append([round(time.perf_counter(), 3), {
                n: round(c - last_cpu.get(n, 0.0), 3) for n, c in cpu.items()}])
            last_cpu = cpu
            doc = dict(interval_s=interval, threads={
                n: dict(samples=total[n], inclusive=inclusive[n].most_common(60),
                        self=self_[n].most_common(40)) for n in total},
                steps=list(_steps), cpu_windows=cpu_windows, zos_stages=list(_stages))
            with open(path + ".tmp", "w") as f:
                json.dump(doc, f)
            os.replace(path + ".tmp", path)


def _recorded(schedule_batch):
    def recorder(*a, **k):
        out = schedule_batch(*a, **k)
        _sched["n"] = len(out[0]) if out[0] is not None else 0
        _sched["q"] = out[2]
        return out
    return recorder


def _hook_steps(kind: str) -> None:
    from transformers.generation.continuous_batching import continuous_api, scheduler

    for cls in vars(scheduler).values():
        if isinstance(cls, type) and "schedule_batch" in vars(cls):
            cls.schedule_batch = _recorded(cls.schedule_batch)
    if kind == "zos":  # zos's split schedule replaces schedule_batch on the instance
        from zos.integrations import hf_manager
        _time_stages()

        split = hf_manager.split_steps

        def split_steps(sched):
            split(sched)
            sched.schedule_batch = _recorded(sched.schedule_batch)
        hf_manager.split_steps = split_steps
    body = continuous_api.ContinuousBatchingManager._generation_loop_body

    def loop_body(self, *a, **k):
        _sched.clear()
        t = time.perf_counter()
        out = body(self, *a, **k)
        if _sched.get("n"):
            _steps.append((round(t, 6), round(time.perf_counter() - t, 6), _sched["n"],
                           _sched["q"]))
        return out
    continuous_api.ContinuousBatchingManager._generation_loop_body = loop_body


def _time_stages() -> None:
    """Time each ``ZosDecodeRows.stage`` and the backend stage it calls (``_stages``)."""
    from zos.device_backend import DeviceMetadataBackend
    from zos.integrations.hf_rows import ZosDecodeRows

    stage, backend_stage, inner = ZosDecodeRows.stage, DeviceMetadataBackend.stage, [0.0]

    def timed_backend(self, step):
        t = time.perf_counter()
        try:
            return backend_stage(self, step)
        finally:
            inner[0] = time.perf_counter() - t

    def timed_stage(self, built, **kw):
        inner[0] = 0.0
        t = time.perf_counter()
        try:
            return stage(self, built, **kw)
        finally:
            _stages.append((round(t, 6), round(time.perf_counter() - t, 7), round(inner[0], 7),
                            built.carry is not None))
    DeviceMetadataBackend.stage = timed_backend
    ZosDecodeRows.stage = timed_stage


def _start(path: str, kind: str) -> None:
    """The step log and the stack sampler of this process, into ``path``."""
    _hook_steps(kind)
    threading.Thread(target=_sampler, daemon=True, name="zos-sampler", args=(
        path, float(os.environ.get("ZOS_PROFILE_INTERVAL", "0.005")))).start()


try:  # transformers 5.25: the model's process is spawned by the server
    from transformers.cli.serving import model_manager as _model_manager

    from zos.integrations.serve_525 import ZosModelLoader
except (ImportError, AttributeError):  # 5.17: the model runs in the server's process (its
    _model_manager = None                 # model_manager has no ModelLoader)

if _model_manager is not None:
    class _ProfiledLoad:
        """A loader whose ``load_model_and_processor`` (in the model's process) first starts
        the profile there."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.zos_profile = _MODEL_PROFILE

        def load_model_and_processor(self, model_id, on_progress=None):
            if self.zos_profile:
                _start(*self.zos_profile)
            return super().load_model_and_processor(model_id, on_progress)

    class ProfiledLoader(_ProfiledLoad, _model_manager.ModelLoader):
        """transformers' loader, profiled."""

    class ProfiledZosLoader(_ProfiledLoad, ZosModelLoader):
        """zos's loader, profiled."""


def _profile_model_process(path: str, kind: str) -> None:
    """On transformers 5.25, make the server build profiled loaders (zos's after
    ``serve_525.install`` sets its own)."""
    global _MODEL_PROFILE
    if _model_manager is None:
        return
    _MODEL_PROFILE = (path.removesuffix(".json") + ".model.json", kind)
    if kind != "zos":
        _model_manager.ModelLoader = ProfiledLoader
        return
    from zos.integrations import serve_525

    install = serve_525.install

    def profiled_install(options=None):
        install(options)
        _model_manager.ModelLoader = ProfiledZosLoader
    serve_525.install = profiled_install


def main() -> int:
    path, kind, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if kind == "zos":
        from zos.integrations import serve
    _start(path, kind)
    _profile_model_process(path, kind)
    if kind == "zos":
        return serve.main(args)
    if kind == "tf_async":  # transformers' server with async batching, as bench_serve runs it
        from bench_serve import ASYNC_HOOK  # this script's directory is on sys.path
        exec(ASYNC_HOOK, {})
    from transformers.cli.transformers import main as tf_main
    sys.argv = ["transformers", *args]
    tf_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
