"""coder.train.losses: the chunked output head and cross-entropy (train.loss_chunks) against the
whole logits: the loss, its metrics and every gradient of a tiny MoE model with an MTP module,
in float32 and bfloat16; and the logits it never holds whole, read off the compiled program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict

from coder.model.transformer import Transformer
from coder.train import losses
from tests.model.model_inputs import tiny_moe


def _batch(b=2, t=32, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.ones((b, t), np.int32)
    seg[0, 20:] = 2  # two documents in row 0
    seg[1, 28:] = 0  # a padded tail in row 1
    mask = (seg > 0).astype(np.float32)
    mask[1, :5] = 0  # a prompt the loss skips
    pos = np.concatenate([np.arange(20), np.arange(t - 20)])[None].repeat(b, 0)
    return dict(tokens=jnp.asarray(rng.integers(1, vocab, (b, t)), jnp.int32), positions=jnp.asarray(pos, jnp.int32),
                segment_ids=jnp.asarray(seg), loss_mask=jnp.asarray(mask))


def _loss_and_grads(model, batch, chunks):
    train = ConfigDict(dict(mtp_loss_weight=0.3, z_loss_weight=1e-3, loss_chunks=chunks))
    fn = losses.lm_loss_fn(train)
    graph, params = nnx.split(model)

    def loss(params):
        out, metrics = fn(nnx.merge(graph, params), batch, None)
        return out, metrics

    (value, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, metrics, grads


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-6), ("bfloat16", 2e-2)])
def test_chunked_head_gives_the_loss_and_gradients_of_the_whole_logits(dtype, tol):
    model = Transformer(tiny_moe(dtype=dtype), nnx.Rngs(0))
    batch = _batch()
    whole, m_whole, g_whole = _loss_and_grads(model, batch, 1)
    chunked, m_chunked, g_chunked = _loss_and_grads(model, batch, 4)
    np.testing.assert_allclose(chunked, whole, rtol=tol, atol=tol)
    for key in ("ce", "mtp_ce", "weight"):
        np.testing.assert_allclose(m_chunked[key], m_whole[key], rtol=tol, atol=tol, err_msg=key)
    flat_whole = dict(jax.tree_util.tree_leaves_with_path(g_whole))
    for path, g in jax.tree_util.tree_leaves_with_path(g_chunked):
        ref = np.asarray(flat_whole[path], np.float32)
        scale = max(float(np.abs(ref).max()), 1e-6)  # bf16 gradients: relative to the leaf's largest entry
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, ref / scale, atol=tol,
                                   err_msg=jax.tree_util.keystr(path))


def test_chunked_cross_entropy_sum_by_hand():
    """The pure function alone: sums of -log softmax at the targets, weighted, and its
    gradients against autodiff of the whole logits."""
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(k1, (2, 12, 8))
    w = jax.random.normal(k2, (8, 40))
    targets = jax.random.randint(k3, (2, 12), 0, 40)
    weights = jnp.asarray(np.random.default_rng(0).uniform(0, 1, (2, 12)), jnp.float32)
    whole = lambda h, w: losses.cross_entropy_sum(jnp.einsum("btd,dv->btv", h, w), targets, weights)[0]
    chunked = lambda h, w: losses.chunked_cross_entropy_sum(h, w, targets, weights, 3)[0]
    np.testing.assert_allclose(chunked(h, w), whole(h, w), rtol=1e-6)
    for a, b in zip(jax.grad(chunked, argnums=(0, 1))(h, w), jax.grad(whole, argnums=(0, 1))(h, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="does not divide rows of 12 tokens"):
        losses.chunked_cross_entropy_sum(h, w, targets, weights, 5)


def test_the_chunked_program_never_holds_the_whole_logits():
    """Compiled on CPU: the largest float32 [.., vocab] buffer of the chunked step is a chunk's
    (rows x T/4 x V), where the whole-logits step holds rows x T x V."""
    model = Transformer(tiny_moe(vocab_size=512, num_mtp_layers=0), nnx.Rngs(0))
    batch = _batch(t=64, vocab=512)
    graph, params = nnx.split(model)

    def largest_logits(chunks):
        fn = losses.lm_loss_fn(ConfigDict(dict(mtp_loss_weight=0.0, z_loss_weight=0.0, loss_chunks=chunks)))
        step = jax.jit(jax.grad(lambda p: fn(nnx.merge(graph, p), batch, None)[0]))
        text = step.lower(params).compile().as_text()
        sizes = [int(np.prod([int(d) for d in m.split(",")])) for m in re.findall(r"f32\[([\d,]+)\]", text)
                 if m.endswith(",512")]
        return max(sizes)

    assert largest_logits(1) == 2 * 64 * 512
    assert largest_logits(4) == 2 * 16 * 512
