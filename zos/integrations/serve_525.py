"""``zos serve`` on transformers 5.25's server (:mod:`zos.integrations.serve` picks it).

5.25's server runs each model in a process of its own, started with ``spawn``: what zos
patches in the server's process never reaches the model. The model's process gets a pickled
copy of the server's ``ModelLoader`` and calls its ``load_model_and_processor``; then it creates,
warms up (``manager.warmup()``: transformers' warm-up, then zos's, every graph) and starts the
continuous-batching manager, and only then reports the model loaded, so ``/health`` answers
once every graph is captured. :func:`install` makes the server build a :class:`ZosModelLoader`
instead (the class is importable, so its copy unpickles in the model's process, importing zos
there): it enables zos on the model it loads and announces the manager's warm-up and its
report on stderr, which the model's process shares with the server. 5.25's server applies each
request's temperature, top-k and top-p itself (``per_request_processors``); zos's manager hook
checks their ranges (:func:`zos.integrations.hf_manager.check_request_options`).
"""
from __future__ import annotations

import sys
import time

from transformers.cli.serving import model_manager, utils

_OPTIONS = None  # the ZosOptions of loaders built from now on (set by install)


class ZosModelLoader(model_manager.ModelLoader):
    """transformers' ``ModelLoader`` that enables zos on each model it loads (in the model's
    process), with the options :func:`install` was given (an instance attribute, pickled with
    the loader)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.zos_options = _OPTIONS

    def load_model_and_processor(self, model_id, on_progress=None):
        from zos.integrations.transformers import enable_zos

        model, processor = super().load_model_and_processor(model_id, on_progress)
        _announce_warmup()
        # enable_zos warns and leaves the model as it is where zos cannot serve it
        if enable_zos(model, self.zos_options):
            print(f"zos: serving the decode steps of {model.name_or_path}", file=sys.stderr,
                  flush=True)
        return model, processor


def _announce_warmup() -> None:
    """Wrap ``CBGenerateRunner._start_continuous_batching`` (creates, warms up and starts the
    manager) once per process: a progress line before, the time and zos's warm-up report after,
    on stderr."""
    runner = utils.CBGenerateRunner
    original = runner._start_continuous_batching
    if getattr(original, "_zos_hook", False):
        return
    from zos.integrations.hf_manager import describe_warmup

    def _start_continuous_batching(self, model, *args, **kwargs):
        print(f"zos: warming up the manager of {model.name_or_path} before serving",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        manager = original(self, model, *args, **kwargs)
        print(f"zos: ready in {time.perf_counter() - t0:.1f} s: "
              f"{describe_warmup(getattr(manager, 'zos_warmup', {}))}", file=sys.stderr,
              flush=True)
        return manager

    _start_continuous_batching._zos_hook = True
    runner._start_continuous_batching = _start_continuous_batching


def install(options=None) -> None:
    """Make transformers' server load its models with :class:`ZosModelLoader` (``options``: a
    :class:`~zos.integrations.transformers.ZosOptions`, defaults when None)."""
    global _OPTIONS
    _OPTIONS = options
    model_manager.ModelLoader = ZosModelLoader
