"""An engine over two processes (jax.distributed on localhost, 4 CPU devices each) decodes exactly
as one process with the same 8 devices, a follower that dies makes the leader raise, and stage
serve runs on such an engine.

The scenario (`scenario`, run by process 0 of either job) covers what the leader drives: a greedy
group, a sampled group joining, a row leaving, a tool-output append, an in-flight weight update
through the store (each process reads its own slices: weight_channel.StoreLoad), and all of it again
with speculative decoding (MTP drafts, k = 1).
"""
import json
import os
import signal
import sys
import time

import numpy as np
import pytest

from tests import multiprocess_jobs as jobs

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

PROMPTS = [[3, 17, 42, 5, 99, 7], [8, 120, 33, 1, 2]]


def _engine(spec_k: int, timeout_s: float = 60.0):
    import jax
    from flax import nnx

    from coder.infer.engine import Engine
    from coder.model import Transformer, sharding
    from configs.base import get_config
    from tests.infer.engine_inputs import tiny_cfg

    cfg = tiny_cfg()
    mcfg = get_config().mesh
    mcfg.update(dict(data=2, fsdp=1, expert=2, tensor=2))
    mesh = sharding.make_mesh(mcfg, jax.devices())  # every process's devices
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    return cfg, Engine(model, cfg, max_len=64, max_slots=8, decode_steps=4, batch_buckets=(1, 4, 8),
                       len_buckets=(32, 64), speculative_k=spec_k, mesh=mesh, rules=mcfg.rules,
                       follower_timeout_s=timeout_s)


def _publish_version_1(cfg, url):
    """Version 1 of the weights (seed 1): every process of the job publishes (each builds the same
    model; a process's own arrays are written by process 0, and every process writes its part)."""
    from flax import nnx

    from coder.model import Transformer
    from coder.rl import weight_channel

    weight_channel.ModelPublisher(url).publish(Transformer(cfg, rngs=nnx.Rngs(1)), 1)


def scenario(engine, url) -> list:
    """The leader's calls; every generation as a dict (tokens, logprobs, experts, versions)."""
    import jax

    from coder.infer.engine import SamplingParams
    from coder.rl import weight_channel

    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6)
    out = []
    record = lambda gens: out.extend({"tokens": g.tokens, "logprobs": [float(x) for x in g.logprobs],
                                      "experts": np.asarray(g.expert_ids).tolist(),
                                      "versions": list(g.policy_version), "finish": g.finish_reason}
                                     for g in gens)
    a = engine.start_group(PROMPTS[0], 3)
    record(engine.generate(a, greedy, jax.random.key(1)))
    b = engine.start_group(PROMPTS[1], 2)  # joins while a holds its slots
    record(engine.generate(b, sampled, jax.random.key(2)))
    a.release(2)  # a row leaves
    engine.append(a, 0, [5, 6, 7])  # a tool's output
    record(engine.generate(a, sampled, jax.random.key(3), rows=[0, 1]))
    engine.load_weights(weight_channel.StoreLoad(url, 1), version=1)  # in flight: b keeps its cache
    engine.append(b, 1, [9])
    record(engine.generate(b, sampled, jax.random.key(4), rows=[0, 1]))
    a.close()
    b.close()
    return out


def serve_worker(workdir: str):
    """Stage serve's `run` on this process (both processes run it): process 0 serves HTTP on the
    port in {workdir}/http_port until SIGTERM, process 1 follows; the model follows the store."""
    from flax import nnx

    from coder import stages
    from coder.data import tokenizer as tokenizer_lib
    from coder.model import Transformer
    from coder.rl import weight_channel
    from coder.stages import serve as serve_stage
    from configs import base
    from tests.serve.greeter import PREAMBLE, tiny_cfg

    tok = tokenizer_lib.load(os.path.join(workdir, "tok.model"))
    c = base.get_config()
    c.model.update(tiny_cfg(tok).to_dict())
    c.mesh.update(dict(expert=2, tensor=2))
    store = os.path.join(workdir, "store")
    weight_channel.ModelPublisher(store).publish(Transformer(c.model, rngs=nnx.Rngs(7)), 3)  # every process
    c.update(dict(workdir=os.path.join(workdir, "run"), stage="serve"))
    c.data.tokenizer = os.path.join(workdir, "tok.model")
    with open(os.path.join(workdir, "http_port")) as f:
        http_port = int(f.read())
    c.serve.update(dict(weight_store=store, model_name="tiny-2p", max_slots=4, poll_seconds=0.2,
                        host="127.0.0.1", port=http_port, system_prompt=PREAMBLE))
    serve_stage.run(stages.stage_config("serve", c), "", "")
    print("RESULT " + json.dumps({"exit": "clean"}), flush=True)


def worker(process_id: int, num_processes: int, port: int, workdir: str, mode: str):
    import jax

    if num_processes > 1:
        jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                                   process_id=process_id)
    if mode == "serve":
        return serve_worker(workdir)
    url = os.path.join(workdir, "store")
    if mode == "die":  # the follower takes a few calls, then the test kills it; the leader must raise
        cfg, engine = _engine(0, timeout_s=10.0)
        if process_id == 0:
            from coder.infer import channel
            from coder.infer.engine import SamplingParams

            g = engine.start_group(PROMPTS[0], 2)
            engine.generate(g, SamplingParams(temperature=0.0, max_new_tokens=4), jax.random.key(0))
            print("READY", flush=True)
            while not os.path.exists(os.path.join(workdir, "killed")):
                time.sleep(0.1)
            t0 = time.monotonic()
            try:
                engine.generate(g, SamplingParams(temperature=0.0, max_new_tokens=4), jax.random.key(1), rows=[0, 1])
                print("RESULT " + json.dumps({"raised": None}), flush=True)
            except (RuntimeError, channel.FollowerLost) as e:
                cause = e.__cause__ or e
                print("RESULT " + json.dumps({"raised": type(cause).__name__, "message": str(cause),
                                              "seconds": time.monotonic() - t0}), flush=True)
            os._exit(0)  # the job's other process is gone: no orderly shutdown to wait for
        engine.follow()
        return
    results = {}
    for spec_k in (0, 1):
        cfg, engine = _engine(spec_k)
        if spec_k == 0:
            _publish_version_1(cfg, url)
        if process_id == 0:
            results[spec_k] = scenario(engine, url)
            engine.close()
        else:
            engine.follow()
    if process_id == 0:
        print("RESULT " + json.dumps(results), flush=True)


def _spawn(process_id, num_processes, devices, port, workdir, mode="run"):
    return jobs.spawn(__file__, [process_id, num_processes, port, workdir, mode], devices)


def _result(proc, timeout=900):
    return jobs.tagged_json(proc, "RESULT", timeout)


def test_two_process_engine_equals_one_process(tmp_path):
    """Greedy and sampled groups, a row leaving, an append, an in-flight weight update from the
    store, plain and speculative: the 2 x 4-device engine emits the 1 x 8-device engine's tokens,
    expert ids and policy versions; logprobs agree to float32 rounding (the collectives meet
    over two processes in another order)."""
    os.makedirs(tmp_path / "single")
    os.makedirs(tmp_path / "pair")
    single = _result(_spawn(0, 1, 8, jobs.free_port(), str(tmp_path / "single")))
    port = jobs.free_port()
    pair = [_spawn(i, 2, 4, port, str(tmp_path / "pair")) for i in range(2)]
    multi = _result(pair[0])
    pair[1].communicate(timeout=300)
    assert pair[1].returncode == 0
    for k in ("0", "1"):
        assert len(single[k]) == len(multi[k]) == 9
        for i, (a, b) in enumerate(zip(single[k], multi[k])):
            assert a["tokens"] == b["tokens"] and a["experts"] == b["experts"], (k, i)
            assert a["versions"] == b["versions"] and a["finish"] == b["finish"], (k, i)
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-4, rtol=0, err_msg=f"{k} {i}")
        # the update applied in flight: each row's next tokens are version 1's (a row's first token
        # may come from the logits its last decode step left, computed with version 0)
        assert all(v == 1 for g in multi[k][-2:] for v in g["versions"][1:]), [g["versions"] for g in multi[k]]
        assert multi[k][-1]["versions"][0] == 1  # its appended token was prefilled with version 1
        assert all(v == 0 for g in multi[k][:-2] for v in g["versions"])
        assert multi[k][3]["tokens"] != multi[k][4]["tokens"]  # group b's rows sample with their own keys


def test_a_killed_follower_makes_the_leader_raise_naming_it(tmp_path):
    port = jobs.free_port()
    pair = [_spawn(i, 2, 4, port, str(tmp_path), mode="die") for i in range(2)]
    leader = pair[0]
    deadline = time.monotonic() + 600
    while "READY" not in leader.output()[0] and time.monotonic() < deadline:
        assert leader.poll() is None, leader.output()[1][-4000:]
        time.sleep(0.1)
    os.kill(pair[1].pid, signal.SIGKILL)
    pair[1].wait()
    (tmp_path / "killed").write_text("1")
    got = _result(leader, timeout=120)
    assert got["raised"] == "FollowerLost", got
    assert "follower process(es) [1]" in got["message"] and got["seconds"] < 30, got


def test_stage_serve_on_two_processes_answers_the_openai_client(tmp_path):
    """Stage serve over a 2-process engine: process 0 answers plain, streamed and tools requests,
    process 1 runs its engine calls; the weight store's version 3 reaches both (each reads its own
    slices); SIGTERM to process 0 stops the server and the follower cleanly."""
    import urllib.request

    openai = pytest.importorskip("openai")
    from tests.serve.greeter import TOOLS, make_tokenizer

    make_tokenizer().save(str(tmp_path / "tok.model"))
    http_port = jobs.free_port()
    (tmp_path / "http_port").write_text(str(http_port))
    port = jobs.free_port()
    pair = [_spawn(i, 2, 4, port, str(tmp_path), mode="serve") for i in range(2)]
    base = f"http://127.0.0.1:{http_port}"
    deadline, health = time.monotonic() + 600, None
    try:
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in pair), [p.communicate()[1][-3000:] for p in pair if p.poll() is not None]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as f:
                    health = json.load(f)
                if health["policy_version"] == 3:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert health == {"status": "ok", "model": "tiny-2p", "policy_version": 3,
                          "weights": {"version": 3, "store": str(tmp_path / "store")}}, health
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=300)
        msgs = [{"role": "user", "content": "Hi Ada, pick a number from 1 to 4."}]
        plain = client.chat.completions.create(model="tiny-2p", messages=msgs, temperature=0, max_tokens=12)
        assert plain.choices[0].finish_reason in ("stop", "length") and plain.usage.completion_tokens > 0
        chunks = list(client.chat.completions.create(model="tiny-2p", messages=msgs, temperature=0, max_tokens=12,
                                                     stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == (plain.choices[0].message.content or "")  # greedy: the same reply, streamed
        tools = client.chat.completions.create(model="tiny-2p", messages=msgs, tools=TOOLS, temperature=1.0,
                                               max_tokens=12, seed=1)
        assert tools.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finally:
        if pair[0].poll() is None:
            pair[0].send_signal(signal.SIGTERM)
    assert _result(pair[0], timeout=120) == {"exit": "clean"}
    assert _result(pair[1], timeout=120) == {"exit": "clean"}


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
