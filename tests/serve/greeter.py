"""The serving tests' model (tests/serve/test_serve.py, tests/rl/test_realtime.py,
test_realtime_learning.py, tests/infer/test_engine_multiprocess.py): a tiny model fitted so that
greedy decoding answers a user turn with a greeting and, when the system prompt lists the
`submit` tool, with `submit(answer="3")`; its tokenizer and config, the committed fit
(`GREETER`, tests/fits.py), an engine of one batch and one length bucket, and uvicorn serving an
app on a free local port."""
import functools
import inspect
import json
import random
import socket
import threading
import time
import urllib.request

import numpy as np
import optax
from flax import nnx

from coder.data import tokenizer as tokenizer_lib
from coder.env import protocol
from coder.infer.engine import Engine
from coder.model import Transformer
from tests import fits
from tests.rl_toy import train_steps
from configs.base import model_config

MAX_LEN = 256
PREAMBLE = "Answer with the submit tool."
PARAMS = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
SUBMIT = protocol.ToolSpec("submit", "Submit your answer.", PARAMS)
TOOLS = [{"type": "function", "function": {"name": "submit", "description": "Submit your answer.",
                                           "parameters": PARAMS}}]
CALL = protocol.render_tool_call("submit", {"answer": "3"})
GREETING = "Hello! How can I help?"
NAMES = ["Ada", "Alan", "Grace", "Linus", "Guido", "Barbara", "Donald", "Edsger", "Ken", "Dennis"]


def prompts(n, seed):
    rng = random.Random(seed)
    return [f"{rng.choice(['Hi', 'Hello', 'Dear'])} {rng.choice(NAMES)}, pick a number from 1 to 4." for _ in range(n)]


def make_tokenizer():
    """A small tokenizer fitted to the system prompt, the prompts, the replies (and some code,
    so it has 600 pieces: the tools' system prompt + a user turn + the call is ~216 tokens)."""
    import json.decoder
    import json.encoder

    code = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    system = protocol.render_system_prompt([SUBMIT], PREAMBLE)
    texts = [system] * 20 + prompts(100, 1) + [CALL, GREETING] * 20 + [code]
    return tokenizer_lib.train_tokenizer(texts, 600)


def tiny_cfg(tok):
    cfg = model_config()
    cfg.update(dict(vocab_size=tok.padded_vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_group=1, topk_group=1,
                    num_experts_per_tok=2, first_k_dense_replace=1, num_mtp_layers=0,
                    max_position_embeddings=MAX_LEN, dtype="float32"))
    return cfg


def fit(cfg, tok, steps=160, seed=0):
    """A tiny model that greets a plain user turn and calls submit(answer="3") under the tools'
    system prompt (teacher forcing on both conversations, Adam)."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    # decayed to 0: the last steps settle instead of ending on one of the spikes lr 1e-2 makes
    opt = nnx.Optimizer(model, optax.adam(optax.cosine_decay_schedule(1e-2, steps)), wrt=nnx.Param)
    system = protocol.render_system_prompt([SUBMIT], PREAMBLE)
    rng = random.Random(seed)
    pool = prompts(200, 2)
    rows = 8

    def batch():
        toks, masks, seg = (np.zeros((rows, MAX_LEN), np.int32), np.zeros((rows, MAX_LEN), np.float32),
                            np.zeros((rows, MAX_LEN), np.int32))
        for i in range(rows):
            user = {"role": "user", "content": rng.choice(pool)}
            if i % 2:
                msgs = [{"role": "system", "content": system}, user, {"role": "assistant", "content": CALL}]
            else:
                msgs = [user, {"role": "assistant", "content": GREETING}]
            ids, mask = tok.render_conversation(msgs)
            toks[i, :len(ids)], masks[i, :len(ids)], seg[i, :len(ids)] = ids, mask, 1
        pos = np.broadcast_to(np.arange(MAX_LEN, dtype=np.int32), (rows, MAX_LEN))
        return dict(tokens=toks, positions=pos, segment_ids=seg, loss_mask=masks)

    return model, train_steps(model, opt, batch, steps)


def greeter_setup():
    tok = make_tokenizer()
    return tok, tiny_cfg(tok)


GREETER = fits.Recipe("serve_greeter", greeter_setup, fit, sources=(train_steps,))  # tests/fits.py


@functools.lru_cache(maxsize=1)
def fitted():
    """(tokenizer, model config, fitted model, final loss), once per test process (the serving and
    real-time tests share it; nothing mutates the model: engines copy its weights): the committed
    fit (tests/fits.py) when this recipe made it, else fitted here."""
    tok, cfg = greeter_setup()
    return (tok, cfg, *GREETER.model(tok, cfg))


def start_uvicorn(app):
    """uvicorn serving `app` in a daemon thread on a free local port; returns (server, base url).
    (uvicorn is the serve extra's: imported here, so the engine tests that use this module's model
    load without it.)"""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def make_engine(model, cfg):
    # one batch and one length bucket: a handful of programs compile, once
    return Engine(model, cfg, max_len=MAX_LEN, max_slots=8, decode_steps=8, batch_buckets=(8,),
                  len_buckets=(MAX_LEN,))


def post_json(url, body):
    """POST `body` as JSON to `url`; the decoded JSON answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as f:
        return json.load(f)
