"""The policy's trunk as semantic_search's encoder (coder.infer.embedding): the config's spec, and
the encoder through the tool in a real sandbox."""
import os

import numpy as np
import pytest

from coder.env.tools import semantic_search as sem
from coder.env.tools import registry as tools
from coder.env.episode import Episode
from coder.env.protocol import ToolCall
from coder.env.tasks import Task
from coder.infer import embedding
from tests.env.tools.search_inputs import FILES


def test_spec_from_config_says_what_is_missing(policy_checkpoint, tmp_path, monkeypatch):
    from configs import base

    env = base.get_config().env
    with pytest.raises(ValueError, match="semantic_checkpoint"):
        embedding.semantic_spec(env)
    with pytest.raises(ValueError, match="holds none"):  # e.g. a Hugging Face directory
        embedding.semantic_spec(env, str(tmp_path))
    spec = embedding.semantic_spec(env, policy_checkpoint)
    assert spec.encoder == embedding.POLICY
    assert dict(spec.options) == {"checkpoint": policy_checkpoint, "max_tokens": 256}
    monkeypatch.setattr(embedding, "MAX_HOST_SHARE", 1e-9)  # as a 1T policy against any host
    with pytest.raises(ValueError, match="installed encoder"):
        embedding.semantic_spec(env, policy_checkpoint)
    env.semantic_encoder = "wordllama"
    with pytest.raises(ValueError, match="package.module:factory"):
        embedding.semantic_spec(env)
    env.semantic_encoder = "bench.search_recall:WordLlamaEncoder"
    assert embedding.semantic_spec(env).encoder == "bench.search_recall:WordLlamaEncoder"
    env.semantic_encoder = ""
    assert embedding.semantic_spec(env) is None


@pytest.fixture(scope="module")
def policy_checkpoint(tmp_path_factory):
    """A coder checkpoint of tests/rl_toy.py's tiny model (its own tokenizer), as stages write."""
    from flax import nnx

    from coder.data import tokenizer as tokenizer_lib
    from coder.model import Transformer
    from coder.train import checkpoint as ckpt_lib
    from coder.train.flat import state_to_flat
    from tests import rl_toy

    tok = rl_toy.tokenizer()
    cfg = rl_toy.tiny_config(tok, 128)
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    path = str(tmp_path_factory.mktemp("policy") / "checkpoints")
    ck = ckpt_lib.Checkpointer(path, keep=1, async_save=False)
    ck.save(1, arrays={"model": state_to_flat(nnx.state(model)), "opt_state": {}}, meta={"step": 1},
            data_state=None, config=cfg.to_dict(), tokenizer=tokenizer_lib.to_record(tok))
    return path


def test_policy_encoder_finds_the_file_through_the_tool(policy_checkpoint, tmp_path):
    """The default encoder: the checkpoint's trunk, mean-pooled, through the tool in a sandbox
    (episode in this process: the encoder loads once per process, as in an env worker)."""
    spec = sem.SemanticSpec(embedding.POLICY, (("checkpoint", policy_checkpoint),), cache_dir=str(tmp_path))
    enc = sem.encoder_of(spec)
    v = enc.encode(["def f():\n    return 1", "x" * 3000, "retry"])
    assert v.shape == (3, 64) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert np.allclose(enc.encode(["retry"]), v[2:], atol=1e-6)  # batch and padding do not change it
    task = Task(id="s", prompt="", files=FILES, tests={})
    ep = Episode(len, tools=("semantic_search", "search"), semantic=spec)
    ep.reset(task)
    try:
        # the model is untrained (its ranking quality is bench/search_recall.py's figure): the
        # known case is a query that is the definition's own text, which must come first
        query = FILES["net/retry.py"].replace("def ", "").strip()
        out = ep.call(ToolCall("semantic_search", {"query": query, "k": 2}, ""))
        assert out.split(":", 1)[0] == "net/retry.py", out
        assert "(score " in out and "def backoff_delay" in out
        assert len(list(tmp_path.rglob("*.npz"))) == 1
    finally:
        ep.close()
    off = Episode(len, tools=("semantic_search",))
    off.reset(task)
    try:
        assert "semantic search is off" in off.call(ToolCall("semantic_search", {"query": "x"}, ""))
    finally:
        off.close()
    assert "semantic_search" in tools.HOST_SIDE  # read from the host, with the terminal frozen
    assert os.path.isdir(policy_checkpoint)
