"""``zos serve``: transformers' OpenAI-compatible server (``transformers serve
--continuous-batching``, transformers 5.17.0) with zos preparing its decode steps.

transformers' server loads the model named on its command line and creates one
``ContinuousBatchingManager`` for it on the first request (``CBGenerateManager.init_cb`` in
``transformers/cli/serving/utils.py``). :func:`install` wraps that method so that the model is
zos-enabled (:func:`zos.integrations.transformers.enable_zos`) right before the manager is
created; everything else is transformers' server: its routes (``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses``), streaming, cancellation of a stream whose client went
away, request options and their limits (one generation config per manager, taken from the first
request: temperature and top-p of later requests are not applied; per request only
``max_tokens`` and the end-of-sequence token), and its ``--cb-*`` options. On CUDA the manager
runs zos's fastest mode (:func:`zos.integrations.transformers.enable_zos`): CUDA graphs on both
paths, captured in the warm-up, unless ``--cb-use-cuda-graph`` / ``--no-cb-use-cuda-graph``
chooses, and asynchronous batching (the server has no flag for it).

The model comes from a local directory only: :func:`main` refuses anything else and runs the
server with ``HF_HUB_OFFLINE=1``. Needs the ``hf`` extra (transformers 5.17.0 and its serving
packages: fastapi, uvicorn, openai).
"""
from __future__ import annotations

import zos._interpret  # noqa: F401  (before transformers imports triton)

import os
import sys

__all__ = ["install", "main"]


def install(options=None) -> None:
    """Make every continuous-batching manager that transformers' server creates from now on
    serve a zos-enabled model (once per process; later calls change nothing). ``options``: a
    :class:`~zos.integrations.transformers.ZosOptions` (defaults when None).

    Raises:
        RuntimeError: transformers is not 5.17.0 (from ``enable_zos``'s check).
    """
    from zos.integrations.transformers import _transformers, enable_zos

    _transformers()
    from transformers.cli.serving import utils

    manager = utils.CBGenerateManager
    if getattr(manager.init_cb, "_zos_hook", False):
        return
    original = manager.init_cb

    def init_cb(self, model, gen_config):
        if self._cb is None and getattr(model, "_zos_options", None) is None:
            # enable_zos warns and leaves the model as it is where zos cannot serve it
            if enable_zos(model, options):
                print(f"zos: serving the decode steps of {model.name_or_path}", file=sys.stderr,
                      flush=True)
        return original(self, model, gen_config)

    init_cb._zos_hook = True
    init_cb.__doc__ = original.__doc__
    manager.init_cb = init_cb


def main(argv: list[str]) -> int:
    """``zos serve MODEL_DIR [transformers serve options]``: run transformers' server on the
    local model directory with continuous batching (``--continuous-batching`` is added when
    missing) and zos on. Returns the server's exit status.

    Raises:
        ValueError: no model directory, or MODEL_DIR is not an existing directory (the model
            never comes from a hub).
    """
    if not argv or argv[0].startswith("-"):
        raise ValueError("MODEL_DIR: the first argument must be a local model directory (with "
                         "config.json, weights and tokenizer), got "
                         f"{argv[0] if argv else 'nothing'!r}")
    if not os.path.isdir(argv[0]) or not os.path.isfile(os.path.join(argv[0], "config.json")):
        raise ValueError(f"MODEL_DIR: {argv[0]!r} is not a local model directory (no "
                         f"config.json there); zos serve loads no model from a hub")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")
    install()
    from transformers.cli.transformers import main as transformers_main

    args = list(argv)  # requests name the model as given here (transformers' rule)
    if "--continuous-batching" not in args:
        args.append("--continuous-batching")
    sys.argv = ["transformers", "serve", *args]
    try:
        transformers_main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return 0
