"""zos's vLLM plug-in: ``ZOS_VLLM=1 vllm serve ...`` (vLLM 0.26.0, model runner v2).

``pip install zos[vllm]`` registers :func:`register` in vLLM's ``vllm.general_plugins`` entry
point group; vLLM calls it in every process it starts, before a worker resolves its model
runner. With ``ZOS_VLLM`` unset or ``0`` it does nothing. With ``ZOS_VLLM=1`` it wraps four
methods of runner v2's ``GPUModelRunner`` class in memory (nothing of vLLM is changed on disk):
``initialize_kv_cache`` (binds a :class:`~zos.integrations.vllm_prep.ZosVllmPrep` to the
runner, or logs one line saying why vLLM keeps every step: :func:`unsupported`),
``execute_model`` (zos's mirror reads every scheduler output), ``prepare_inputs`` and
``prepare_attn`` (zos prepares the pure-decode steps; vLLM the others). Asynchronous scheduling,
vLLM's CUDA graphs (FULL_AND_PIECEWISE) and attention backend stay as vLLM picks them. A model
that vLLM runs with its V1 runner (not runner v2) gets the same one-line log.

Variables (read once, in :func:`register`):

* ``ZOS_VLLM``: ``1`` on, ``0`` or unset off.
* ``ZOS_VLLM_SHADOW``: ``1``: every zos step is prepared by vLLM too and compared field by
  field (slower; for checking).
* ``ZOS_VLLM_STATS``: a path: at shutdown the worker writes there, as JSON, its step counts,
  the shadow comparison's result and the host time of input preparation per decode step
  (``prepare_inputs`` to the end of ``prepare_attn``, plus zos's mirror) and, with zos on, its
  parts (``mirror_s``, ``prep_s`` and ``phase_s`` in seconds over the run); works with
  ``ZOS_VLLM=0`` too (vLLM's own time).

Raises (from :func:`register`): ValueError for a variable set to another value; RuntimeError
when ``ZOS_VLLM=1`` or ``ZOS_VLLM_STATS`` is set and the installed vLLM is not 0.26.0.
"""
from __future__ import annotations

import atexit
import json
import os
import time

import numpy as np

VLLM_VERSION = "0.26.0"
_FLAGS = ("ZOS_VLLM", "ZOS_VLLM_SHADOW")


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (see the module docstring)."""
    on, shadow = (_flag(name) for name in _FLAGS)
    stats_path = os.environ.get("ZOS_VLLM_STATS") or None
    if not (on or stats_path):
        return
    import vllm
    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"ZOS_VLLM / ZOS_VLLM_STATS: zos's vLLM plug-in is written against vLLM "
                           f"{VLLM_VERSION} (model runner v2), found {vllm.__version__}")
    from vllm.v1.worker import gpu_model_runner as v1
    from vllm.v1.worker.gpu import model_runner as v2
    if getattr(v2.GPUModelRunner, "_zos_installed", False):
        return
    _install(v2.GPUModelRunner, v1.GPUModelRunner, on=on, shadow=shadow, stats_path=stats_path)


def _install(cls, v1_cls, *, on: bool, shadow: bool, stats_path: str | None) -> None:
    from vllm.logger import init_logger

    from zos.integrations.vllm_prep import ZosVllmPrep, unsupported
    log = init_logger("zos.vllm")
    init_kv, execute, prep_inputs, prep_attn = (
        cls.initialize_kv_cache, cls.execute_model, cls.prepare_inputs, cls.prepare_attn)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        init_kv(self, kv_cache_config, *args, **kwargs)
        self._zos = None
        self._zos_timing = _Timing(self, stats_path, zos=on) if stats_path else None
        if not on:
            return
        why = unsupported(self)
        if why:
            log.warning("zos: vLLM prepares every step of this model (%s)", why)
            return
        self._zos = ZosVllmPrep(self, shadow=shadow)
        if self._zos_timing is not None:
            self._zos_timing.prep = self._zos
        log.info("zos: prepares the decode steps (shadow comparison %s)",
                 "on" if shadow else "off")

    def execute_model(self, scheduler_output, *args, **kwargs):
        z = getattr(self, "_zos", None)
        timing = getattr(self, "_zos_timing", None)
        dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
        if z is None or dummy:
            return execute(self, scheduler_output, *args, **kwargs)
        t0 = time.perf_counter()
        z.observe(scheduler_output)
        if timing is not None:
            timing.observe_s = time.perf_counter() - t0
            timing.observe_total_s += timing.observe_s
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            z.finish_step()

    def prepare_inputs(self, scheduler_output, batch_desc):
        timing = getattr(self, "_zos_timing", None)
        if timing is not None:
            timing.start = time.perf_counter()
        z = getattr(self, "_zos", None)
        batch = None
        if z is not None:
            batch = z.prepare_inputs(scheduler_output, batch_desc, prep_inputs, prep_attn)
            self._zos_batch = batch
        return batch if batch is not None else prep_inputs(self, scheduler_output, batch_desc)

    def prepare_attn(self, input_batch):
        z = getattr(self, "_zos", None)
        if z is not None and getattr(self, "_zos_batch", None) is input_batch:
            out = z.prepare_attn(input_batch)
        else:
            out = prep_attn(self, input_batch)
        timing = getattr(self, "_zos_timing", None)
        if timing is not None:
            timing.record(input_batch)
        return out

    v1_init_kv = v1_cls.initialize_kv_cache

    def v1_initialize_kv_cache(self, *args, **kwargs):
        v1_init_kv(self, *args, **kwargs)
        if on and not kwargs.get("is_profiling"):
            log.warning("zos: vLLM runs its V1 model runner for this model, not runner v2: "
                        "zos prepares no step (VLLM_USE_V2_MODEL_RUNNER=1 asks for v2)")

    cls.initialize_kv_cache, cls.execute_model = initialize_kv_cache, execute_model
    cls.prepare_inputs, cls.prepare_attn = prepare_inputs, prepare_attn
    v1_cls.initialize_kv_cache = v1_initialize_kv_cache
    cls._zos_installed = True


class _Timing:
    """Host time of input preparation per step, written as JSON at exit (``ZOS_VLLM_STATS``).
    A decode step is one whose every row runs one token past its prefill; its time runs from
    ``prepare_inputs`` to the end of ``prepare_attn``, plus zos's mirror of its scheduler
    output where zos is on."""

    def __init__(self, runner, path: str, *, zos: bool) -> None:
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_world_size() > 1:  # one file per worker
            path = f"{path}.rank{dist.get_rank()}"
        self.path, self.mode, self.prep, self.written = path, "zos" if zos else "vllm", None, False
        self.start = self.observe_s = self.observe_total_s = 0.0
        self.decode_us: list[float] = []
        self.other_us: list[float] = []
        atexit.register(self.write)
        shutdown = runner.shutdown

        def shutdown_and_write():
            self.write()
            return shutdown()
        runner.shutdown = shutdown_and_write

    def record(self, batch) -> None:
        us = (time.perf_counter() - self.start + self.observe_s) * 1e6
        self.observe_s = 0.0
        decode = batch.num_tokens == batch.num_reqs and not batch.is_prefilling_np.any()
        (self.decode_us if decode else self.other_us).append(us)

    def write(self) -> None:
        if self.written:
            return
        self.written = True

        def summary(xs):
            a = np.asarray(xs)
            return dict(steps=len(xs), **({} if not xs else dict(
                median_us=float(np.median(a)), p90_us=float(np.percentile(a, 90)))))
        out = dict(mode=self.mode, decode=summary(self.decode_us), other=summary(self.other_us))
        if self.prep is not None:
            out["zos"] = dict(self.prep.stats, mirror_s=self.observe_total_s)
        with open(self.path, "w") as f:
            json.dump(out, f, indent=1)
