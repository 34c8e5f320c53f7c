"""Fixtures the rl tests share: the weight path of a one-process actor on a tiny model."""
import types

import jax
import pytest
from flax import nnx

from coder.model import Transformer
from coder.rl import actor as actor_lib
from coder.rl import actor_learner, weight_sync
from tests import rl_toy


@pytest.fixture(scope="session")
def toy_tokenizer():
    """tests/rl_toy.py's small tokenizer of the toy prompts (~0.3 s to fit)."""
    return rl_toy.tokenizer()


def _decode(engine, n: int = 2) -> list[int]:
    """`n` tokens of one row sampled by `engine`; the policy version of each."""
    from coder.infer.engine import SamplingParams

    group = engine.start_group([3, 4, 5], 1)
    try:
        (gen,) = engine.generate(group, SamplingParams(max_new_tokens=n), jax.random.key(0))
    finally:
        group.close()
    return [int(v) for v in gen.policy_version]


@pytest.fixture
def weight_path(tmp_path, toy_tokenizer):
    """The learner's end and the store of GRPO's weight path as configs/base.py sets its dtypes:
    model.dtype bfloat16, float32 parameters, rl.engine_dtype "" (serve in model.dtype), on
    tests/rl_toy.py's tiny MoE. `publish(v)` writes version v (a model initialised with seed v)
    through the learner's publisher; `decode(engine)` samples two tokens of one row and returns
    the policy version of each; `mesh` is one device (an actor's engine); `config` may be changed
    before the first publish."""
    config = rl_toy.tiny_config(toy_tokenizer, 64)
    config.model.dtype = "bfloat16"
    config.rl.update(dict(engine_dtype="", engine_slots=2, decode_steps=2))
    url = str(tmp_path / "weights")
    ns = types.SimpleNamespace(config=config, tok=toy_tokenizer, url=url,
                               mesh=actor_lib.engine_mesh(config, jax.local_devices()[:1]), publisher=None)

    def publish(version: int) -> None:
        if ns.publisher is None:  # one publisher for the run, as the learner's: versions after the first are deltas
            ns.publisher = actor_learner.learner_weights(ns.config, url)
        ns.publisher.publish(Transformer(ns.config.model, rngs=nnx.Rngs(version)), version)
        assert weight_sync.latest_version(url) == version

    ns.publish, ns.decode = publish, _decode
    return ns
