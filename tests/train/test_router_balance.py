"""Aux-loss-free balancing over a short run: the quickstart's routing must not collapse.

At model.bias_update_rate=1e-3 (DeepSeek-V3's rate, for ~10^5 steps) the quickstart's
pretraining routed every token of every MoE layer to 2 of its 4 experts from step ~10 on
(load_imbalance 2.00 = E/k, the maximum): early in training the hidden states share one
direction, so the score gap the router learns between experts sends all tokens the same way,
and a bias moving 1e-3 per step cannot undo it within 150 steps.
"""
import json
import logging
import os

import numpy as np
import pytest

from coder import stages
from coder.model import Transformer, sharding
from coder.model.config import routing_errors
from coder.model.routing import balancing_warning
from coder.train import losses
from coder.train.balancing import router_balancing
from coder.train.trainer import Trainer
from configs import quickstart


def test_quickstart_bias_rate_reaches_the_score_range(caplog):
    c = quickstart.get_config()
    assert balancing_warning(c.model, c.train.steps) == ""
    with caplog.at_level(logging.WARNING):
        stages.validate(c, 1, check_tools=False)
    assert "bias_update_rate" not in caplog.text
    c.model.bias_update_rate = 1e-3  # the old default: warned at start-up
    assert "at most 0.15" in balancing_warning(c.model, c.train.steps)
    with caplog.at_level(logging.WARNING):
        stages.validate(c, 1, check_tools=False)
    assert "stage pretrain: model.bias_update_rate=0.001" in caplog.text
    c.init_from = "some/ckpt"  # a model already trained: its routing is balanced
    c.stages = ("pretrain",)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        stages.validate(c, 1, check_tools=False)
    assert "bias_update_rate" not in caplog.text


@pytest.mark.parametrize("kw,match", [
    (dict(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3), "fewer than"),
    (dict(n_routed_experts=4, n_group=4, topk_group=2, num_experts_per_tok=2), "top-2"),
    (dict(n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=5), "must be in"),
])
def test_impossible_group_limited_routing_is_refused(kw, match):
    from flax import nnx

    c = quickstart.get_config()
    c.model.update(kw)
    assert any(match in e for e in routing_errors(c.model))
    with pytest.raises(ValueError, match=match):
        sharding.validate(c.model, c.mesh, 8)
    with pytest.raises(ValueError, match=match):
        nnx.eval_shape(lambda: Transformer(c.model, rngs=nnx.Rngs(0)))


def _text_rows(rows: int, seq: int, seed: int):
    """Rows of bytes of Python source (real text: skewed unigram statistics, as the quickstart's
    stdlib corpus; random tokens do not reproduce the collapse)."""
    src = os.path.dirname(json.__file__)
    text = b"".join(open(os.path.join(src, f), "rb").read() for f in sorted(os.listdir(src)) if f.endswith(".py"))
    text = np.frombuffer(text, np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(text) - seq, rows)
        yield dict(tokens=np.stack([text[s:s + seq] for s in starts]),
                   positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
                   segment_ids=np.ones((rows, seq), np.int32), loss_mask=np.ones((rows, seq), np.float32))


@pytest.mark.slow
def test_quickstart_pretraining_keeps_experts_in_use(tmp_path):
    """The quickstart's model and pretraining schedule (its own bias_update_rate) on text:
    the load imbalance leaves its maximum (2.00) and stays well below it."""
    c = quickstart.get_config()
    c.data.batch_size, c.data.seq_len = 8, 64
    steps = 90  # at the old rate (1e-3): 2.00 from step ~10 to the end (the last 25: mean 1.99)
    trainer = Trainer(c, str(tmp_path), losses.lm_loss_fn(c.train), stage="pretrain",
                      post_update=router_balancing(c.model))
    data = _text_rows(8, 64, seed=0)
    imbalance = []
    try:
        for _ in range(steps):
            imbalance.append(float(trainer.train_step(next(data))["load_imbalance"]))
    finally:
        trainer.close()
    late = imbalance[-25:]  # now (1e-2): mean 1.20, down to 1.07
    assert np.mean(late) < 1.6 and min(late) < 1.4, np.round(imbalance, 2).tolist()
