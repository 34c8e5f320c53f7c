"""Fixtures the rl tests share: the weight path of a one-process actor on a tiny model."""
import json
import types

import fsspec
import jax
import pytest
from flax import nnx

from coder.model import Transformer
from coder.rl import actor as actor_lib
from coder.rl import topology, weight_sync
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
    tests/rl_toy.py's tiny MoE; `mesh` is one device (an actor's engine); `config` may be changed
    before the first publish.

    `publish(v, seed=v, hold=False)` writes version v (a model initialised with `seed`: the
    seed of the version before makes every leaf a delta on it) through the learner's publisher
    into a staging store, then (`deliver(v)`, not with `hold`) into the store at `url`, data
    before the manifest; `corrupt(v)` flips a byte of staged version v's first leaf and returns
    its name. A reader of `url` sees a version only once it is delivered as the test wants it.
    `decode(engine)` samples two tokens of one row and returns the policy version of each."""
    config = rl_toy.tiny_config(toy_tokenizer, 64)
    config.model.dtype = "bfloat16"
    config.rl.update(dict(engine_dtype="", engine_slots=2, decode_steps=2))
    url, staging = str(tmp_path / "weights"), str(tmp_path / "staging")
    ns = types.SimpleNamespace(config=config, tok=toy_tokenizer, url=url,
                               mesh=actor_lib.engine_mesh(config, jax.local_devices()[:1]), publisher=None)
    fs = fsspec.filesystem("file")

    def files(version: int) -> tuple[str, dict]:
        vdir = f"{staging}/v{version:010d}"
        return vdir, json.loads(fs.cat_file(f"{vdir}/part-00000-of-00001.json"))

    def deliver(version: int) -> None:
        vdir, part = files(version)
        fs.makedirs(f"{url}/v{version:010d}", exist_ok=True)
        for name in (part["data"], "part-00000-of-00001.json"):  # the manifest commits the version
            fs.copy(f"{vdir}/{name}", f"{url}/v{version:010d}/{name}")
        assert weight_sync.latest_version(url) == version

    def publish(version: int, seed: int | None = None, hold: bool = False) -> None:
        if ns.publisher is None:  # one publisher for the run, as the learner's
            ns.publisher = topology.learner_weights(ns.config, staging)
        ns.publisher.publish(Transformer(ns.config.model, rngs=nnx.Rngs(version if seed is None else seed)), version)
        if not hold:
            deliver(version)

    def corrupt(version: int) -> str:
        vdir, part = files(version)
        name = min(part["leaves"])
        entry, path = part["leaves"][name], f"{vdir}/{part['data']}"
        data = bytearray(fs.cat_file(path))
        data[entry["offset"] + entry["length"] // 2] ^= 0x40
        fs.pipe_file(path, bytes(data))
        return name

    ns.publish, ns.deliver, ns.corrupt, ns.decode = publish, deliver, corrupt, _decode
    return ns
