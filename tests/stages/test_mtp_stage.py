"""Stage mtp: self-distillation of the MTP modules with the trunk frozen.

The distillation maths is checked against hand-computed values; the stage test pretrains a tiny
model for a few steps, runs the mtp stage, and checks that every trunk variable is bit-identical
while the MTP modules moved towards the main head (KL down, acceptance up).
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.train import distill as mtp
from configs import base


def test_distill_terms_by_hand():
    p = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))
    q = jnp.log(jnp.array([[[0.25, 0.5, 0.25]]]))
    kl, agree, accept, n = mtp.distill_terms(p, q, jnp.ones((1, 1)))
    expected_kl = 0.5 * np.log(2) + 0.25 * np.log(0.5)
    np.testing.assert_allclose(kl, expected_kl, rtol=1e-6)
    np.testing.assert_allclose(accept, 0.25 + 0.25 + 0.25, rtol=1e-6)  # sum of mins
    assert float(agree) == 0.0 and float(n) == 1.0
    kl_same, agree_same, accept_same, _ = mtp.distill_terms(p, p, jnp.full((1, 1), 2.0))
    np.testing.assert_allclose(kl_same, 0.0, atol=1e-6)
    np.testing.assert_allclose(accept_same, 2.0, rtol=1e-6)
    assert float(agree_same) == 2.0


def test_distill_loss_aligns_depths_with_the_main_head():
    """MTP module k at t must be compared with the main head at t + k + 1 (same target)."""
    rng = np.random.default_rng(0)
    B, T, V = 2, 9, 7
    logits = jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32)
    # Module k copies the main head shifted by k + 1: a perfect draft, so KL = 0, accept = 1.
    mtp_logits = jnp.stack([jnp.roll(logits, -(k + 1), axis=1) for k in range(2)])
    batch = dict(
        tokens=jnp.asarray(rng.integers(1, V, (B, T)), jnp.int32),
        segment_ids=jnp.ones((B, T), jnp.int32),
        loss_mask=jnp.ones((B, T), jnp.float32),
    )
    loss, m = mtp.distill_loss(logits, mtp_logits, batch, ce_weight=0.0)
    np.testing.assert_allclose(loss, 0.0, atol=1e-5)
    for d in (1, 2):
        np.testing.assert_allclose(m[f"accept_{d}"], 1.0, rtol=1e-5)
        assert float(m[f"agree_{d}"]) == 1.0
    # Misaligned by one position: clearly not zero.
    bad = jnp.stack([logits, logits])
    loss_bad, _ = mtp.distill_loss(logits, bad, batch, ce_weight=0.0)
    assert float(loss_bad) > 0.05
    # Targets across a document boundary are not scored.
    seg = np.ones((B, T), np.int32)
    seg[:, 4:] = 2
    batch2 = dict(batch, segment_ids=jnp.asarray(seg))
    _, m2 = mtp.distill_loss(logits, bad, batch2, ce_weight=0.0)
    # depth 1 (shift 2) targets: t in [0, T-2) with seg[t] == seg[t+2]: t=0,1 and t=4..6 -> 5 per row.
    assert float(m2["weight"]) == B * 5


def _tiny_config(tmp_path):
    from coder.data.tokenizer import train_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "x", "y", "0", "1"]
    with open(corpus, "w") as f:
        for i in range(300):
            text = "\n".join(" ".join(rng.choice(words, 8)) for _ in range(6))
            f.write(json.dumps({"text": text}) + "\n")
    texts = [json.loads(line)["text"] for line in open(corpus)]
    tok = train_tokenizer(texts, 300)
    tok_path = str(tmp_path / "tok.model")
    tok.save(tok_path)

    c = base.get_config()
    c.workdir = str(tmp_path / "run")
    c.data.sources = ({"path": str(corpus), "weight": 1.0, "format": "jsonl", "text_field": "text"},)
    c.data.tokenizer = tok_path
    c.data.seq_len = 64
    c.data.batch_size = 8
    c.data.heldout_fraction = 0.2
    m = c.model
    m.vocab_size = tok.padded_vocab_size
    m.hidden_size = 32
    m.intermediate_size = 64
    m.moe_intermediate_size = 16
    m.num_hidden_layers = 2
    m.num_attention_heads = 2
    m.kv_lora_rank = 16
    m.qk_nope_head_dim = 8
    m.qk_rope_head_dim = 8
    m.v_head_dim = 8
    m.n_routed_experts = 4
    m.num_experts_per_tok = 2
    m.n_group = 1
    m.topk_group = 1
    m.num_mtp_layers = 2
    m.max_position_embeddings = 64
    m.dtype = "float32"
    c.train.steps = 8
    c.train.warmup_steps = 0
    c.train.log_every = 1
    c.train.ckpt_every = 1000
    c.mtp.steps = 12
    c.mtp.lr = 1e-2
    c.mtp.eval_batches = 2
    return c


@pytest.mark.slow
def test_mtp_stage_freezes_the_trunk_and_learns(tmp_path):
    from coder import stages
    from coder.train import checkpoint as ckpt_lib
    from coder.train.flat import state_to_flat

    c = _tiny_config(tmp_path)
    pre = stages.run_one("pretrain", c, os.path.join(c.workdir, "pretrain"))
    out = stages.run_one("mtp", c, os.path.join(c.workdir, "mtp"), pre)

    from coder.model import Transformer

    model = Transformer(c.model, rngs=nnx.Rngs(0))
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
        for k, v in state_to_flat(nnx.state(model)).items()
    }

    def variables(path):
        found, missing, _ = ckpt_lib.load_params(path, abstract)
        assert not missing
        return {k: np.asarray(v) for k, v in found.items()}

    before, after = variables(pre), variables(out)
    assert before.keys() == after.keys()
    trunk = [k for k in before if "mtp" not in k]
    heads = [k for k in before if "mtp" in k]
    assert trunk and heads
    for k in trunk:  # bit-identical, router bias included
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    assert any(not np.array_equal(before[k], after[k]) for k in heads)

    records = [json.loads(line) for line in open(os.path.join(c.workdir, "mtp", "metrics.jsonl"))]
    train = [r for r in records if "kl_1" in r]
    assert train[-1]["kl"] < train[0]["kl"]
    held = records[-1]
    for d in (1, 2):
        assert 0.0 < held[f"heldout/accept_{d}"] <= 1.0
        assert 0.0 <= held[f"heldout/agree_{d}"] <= 1.0
    assert held["loss"] == held["heldout/kl"]
