"""``zos serve``: transformers' OpenAI-compatible server (``transformers serve
--continuous-batching``) with zos preparing its decode steps. This module: transformers 5.17.0;
5.25.0's server is :mod:`zos.integrations.serve_525`.

transformers 5.17's server loads the model named on its command line at start-up but creates its
``ContinuousBatchingManager`` on the first request (``CBGenerateManager.init_cb`` in
``transformers/cli/serving/utils.py``), from that request's generation config, and the manager's
warm-up (every CUDA graph) then held that request, and every request behind it on the server's
event loop. :func:`install` wraps ``init_cb`` so that the model is zos-enabled
(:func:`zos.integrations.transformers.enable_zos`) right before the manager is created, and
``build_server`` so that the manager is created, warmed up and started before the server
listens (:func:`start_manager`): ``/health`` answers once every graph is captured, with a
progress line and the warm-up's report (graphs, seconds, memory per kind) on stderr. The
manager runs the model's generation config as a request with no sampling options gets it;
transformers' server keeps one config per manager (later requests' temperature and top-p are not
applied; per request only ``max_tokens`` and the end-of-sequence token), so a request whose
options differ is served with the manager's and logged with a one-line warning. Everything else
is transformers' server: its routes (``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``), streaming, cancellation of a stream whose client went away, and its
``--cb-*`` options. On CUDA the manager runs zos's fastest mode
(:func:`zos.integrations.transformers.enable_zos`): CUDA graphs on both paths, captured in the
warm-up, unless ``--cb-use-cuda-graph`` / ``--no-cb-use-cuda-graph`` chooses, and asynchronous
batching (the server has no flag for it).

The model comes from a local directory only: :func:`main` refuses anything else and runs the
server with ``HF_HUB_OFFLINE=1``. Needs the ``hf`` extra (transformers 5.17.0 or 5.25.0 and its
serving packages: fastapi, uvicorn, openai).
"""
from __future__ import annotations

import zos._interpret  # noqa: F401  (before transformers imports triton)

import logging
import os
import sys
import time

__all__ = ["install", "main", "start_manager"]

log = logging.getLogger("zos")

# Generation-config fields behind the logits processors and the sampler of transformers'
# continuous batching: those of sampling count only with do_sample
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
                   "eta_cutoff", "top_h")
PROCESSOR_FIELDS = ("do_sample", "repetition_penalty", "sequence_bias", "no_repeat_ngram_size",
                    "suppress_tokens", "renormalize_logits", "forced_eos_token_id")

# The query-padding interval (tokens) of the server's manager, where its ``--cb-*`` options
# leave it to transformers (64): the server is ready once every prefill graph is captured, one
# per padded size up to --cb-max-batch-tokens; 128 halves them (bench/NOTES.md, 2026-12-05:
# the warm-up and the padding it costs)
SERVE_Q_PADDING_INTERVAL = 128

# zos serve's own flag (taken out before transformers' parser sees the command line): keep
# transformers' mixed prefill + decode steps instead of zos's separate ones
# (ZosOptions.mixed_steps, zos.integrations.hf_scheduler)
MIXED_STEPS_FLAG = "--zos-mixed-steps"


def sampling_settings(gen_config) -> dict:
    """What of ``gen_config`` (a ``GenerationConfig``) decides the logits processors and the
    sampler of a continuous-batching manager: :data:`PROCESSOR_FIELDS`, and with ``do_sample``
    :data:`SAMPLING_FIELDS`."""
    fields = PROCESSOR_FIELDS + (SAMPLING_FIELDS if gen_config.do_sample else ())
    return {f: getattr(gen_config, f, None) for f in fields}


def start_manager(model_manager, chat_handler, generation_state) -> None:
    """Create, warm up and start the continuous-batching manager of the server's model (the one
    its command line names, ``model_manager.force_model``), as its first request would, with
    the generation config of a request with no options (``chat_handler``'s). Prints a progress
    line and the warm-up's report to stderr. Nothing for a server without a model or whose
    model continuous batching does not serve.

    Raises:
        whatever the manager's creation or warm-up raises: a server that cannot warm up does not
        start.
    """
    from zos.integrations.hf_manager import describe_warmup

    if model_manager.force_model is None:
        return
    model_id = model_manager.process_model_name(model_manager.force_model)
    model, processor = model_manager.load_model_and_processor(model_id)
    modality = model_manager.get_model_modality(model, processor=processor)
    if not generation_state.use_continuous_batching(model, modality):
        return
    gen_config = chat_handler._build_generation_config({}, model.generation_config, use_cb=True)
    print(f"zos: warming up the manager of {model.name_or_path} before serving",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    cb = generation_state.get_manager(model_id, use_cb=True)
    cb.init_cb(model, gen_config)
    report = getattr(cb._cb, "zos_warmup", {})
    print(f"zos: ready in {time.perf_counter() - t0:.1f} s: {describe_warmup(report)}",
          file=sys.stderr, flush=True)


def install(options=None) -> None:
    """Make every continuous-batching manager that transformers' server creates from now on
    serve a zos-enabled model (5.17: once per process, later calls change nothing; 5.25: the
    latest call's options go to the models loaded after it). ``options``: a
    :class:`~zos.integrations.transformers.ZosOptions` (when None: the defaults with
    ``q_padding_interval_size`` :data:`SERVE_Q_PADDING_INTERVAL` and ``mixed_steps=False``:
    prefill and decode in separate steps; on 5.25 a copy reaches the
    model's process, so a ``timings`` list stays empty in the server's).

    On transformers 5.25 the server loads, warms up and starts the model's manager in a process
    of its own before ``/health`` answers: :mod:`zos.integrations.serve_525`.

    Raises:
        RuntimeError: transformers is not a tested release
            (:func:`~zos.integrations.hf_internals.internals`).
    """
    from zos.integrations.hf_internals import internals

    internals().install_server(serve_options() if options is None else options)


def serve_options(mixed_steps: bool = False):
    """``zos serve``'s :class:`~zos.integrations.transformers.ZosOptions`: the defaults with
    ``q_padding_interval_size`` :data:`SERVE_Q_PADDING_INTERVAL` and ``mixed_steps``."""
    from zos.integrations.transformers import ZosOptions

    return ZosOptions(q_padding_interval_size=SERVE_Q_PADDING_INTERVAL, mixed_steps=mixed_steps)


def install_517(options) -> None:
    """:func:`install` on transformers 5.17: wraps ``CBGenerateManager.init_cb`` and
    ``build_server`` (module docstring)."""
    from transformers.cli.serving import server, utils

    from zos.integrations.transformers import enable_zos

    manager = utils.CBGenerateManager
    if getattr(manager.init_cb, "_zos_hook", False):
        return
    original, original_build = manager.init_cb, server.build_server

    def init_cb(self, model, gen_config):
        if self._cb is None and getattr(model, "_zos_options", None) is None:
            # enable_zos warns and leaves the model as it is where zos cannot serve it
            if enable_zos(model, options):
                print(f"zos: serving the decode steps of {model.name_or_path}", file=sys.stderr,
                      flush=True)
        elif self._cb is not None:
            ours = sampling_settings(self._cb.generation_config)
            asked = sampling_settings(gen_config)
            if asked != ours:
                log.warning("zos serve: a request asks %s; every request of this server runs "
                            "its manager's generation config (%s)",
                            {k: v for k, v in asked.items() if ours.get(k) != v}, ours)
        return original(self, model, gen_config)

    def build_server(model_manager, chat_handler, *args, generation_state, **kwargs):
        start_manager(model_manager, chat_handler, generation_state)
        return original_build(model_manager, chat_handler, *args,
                              generation_state=generation_state, **kwargs)

    for fn, was in ((init_cb, original), (build_server, original_build)):
        fn._zos_hook = True
        fn.__doc__ = was.__doc__
    manager.init_cb = init_cb
    server.build_server = build_server


def main(argv: list[str]) -> int:
    """``zos serve MODEL_DIR [--zos-mixed-steps] [transformers serve options]``: run
    transformers' server on the local model directory with continuous batching
    (``--continuous-batching`` is added when missing) and zos on (:func:`install`'s defaults;
    ``--zos-mixed-steps``: ``mixed_steps=True``, transformers' own schedule). Returns the
    server's exit status.

    Raises:
        ValueError: no model directory, or MODEL_DIR is not an existing directory (the model
            never comes from a hub), or ``--zos-mixed-steps`` is given a value (it takes none).
    """
    if not argv or argv[0].startswith("-"):
        raise ValueError("MODEL_DIR: the first argument must be a local model directory (with "
                         "config.json, weights and tokenizer), got "
                         f"{argv[0] if argv else 'nothing'!r}")
    if not os.path.isdir(argv[0]) or not os.path.isfile(os.path.join(argv[0], "config.json")):
        raise ValueError(f"MODEL_DIR: {argv[0]!r} is not a local model directory (no "
                         f"config.json there); zos serve loads no model from a hub")
    valued = [a for a in argv if a.startswith(MIXED_STEPS_FLAG + "=")]
    if valued:
        raise ValueError(f"{MIXED_STEPS_FLAG} takes no value, got {valued[0]!r}")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")
    args = [a for a in argv if a != MIXED_STEPS_FLAG]  # the model as given (transformers' rule)
    install(serve_options(mixed_steps=MIXED_STEPS_FLAG in argv))
    from transformers.cli.transformers import main as transformers_main

    if "--continuous-batching" not in args:
        args.append("--continuous-batching")
    sys.argv = ["transformers", "serve", *args]
    try:
        transformers_main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return 0
