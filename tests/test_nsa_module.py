"""The NSA nnx module (compression, gates) and the decode step against the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_nsa_reference import packed_segments

from coder.pallas.nsa import decode, reference
from coder.pallas.nsa.module import NSA
from configs.base import get_config


def _module(dk=16, dv=12):
    mc = get_config().model
    mc.nsa.update({"compress_block": 4, "compress_stride": 2, "select_block": 8, "select_topk": 3, "window": 8})
    mc.param_dtype = "float32"
    return NSA(mc, nnx.Rngs(0), key_dim=dk, value_dim=dv), mc


def _inputs(b, t, h, g, dk, dv, d, seed=1):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, t, h, dk)), jax.random.normal(ks[1], (b, t, g, dk)),
            jax.random.normal(ks[2], (b, t, g, dv)), jax.random.normal(ks[3], (b, t, d)))


@pytest.mark.slow
def test_module_xla_matches_reference_and_trains_every_part():
    nsa, mc = _module()
    b, t = 2, 21
    q, k, v, x = _inputs(b, t, 4, 1, 16, 12, mc.hidden_size)
    seg = packed_segments(b, t, 2, 1, seed=4)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = nsa(q, k, v, x, seg, pos, softmax_scale=0.3, impl="xla")
    ref = nsa(q, k, v, x, seg, pos, softmax_scale=0.3, impl="reference")
    assert out.shape == (b, t, 4, 12)
    np.testing.assert_allclose(out, ref, atol=2e-5)

    # perturb w2 away from its zero init so every parameter sits on the gradient path
    nsa.compress_k.w2[...] = 0.01 * jnp.ones_like(nsa.compress_k.w2[...])
    nsa.compress_v.w2[...] = 0.01 * jnp.ones_like(nsa.compress_v.w2[...])
    loss = lambda m: jnp.sum(m(q, k, v, x, seg, pos, softmax_scale=0.3, impl="xla") ** 2)
    grads = nnx.grad(loss)(nsa)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_compression_starts_as_mean_pooling_with_position_embedding():
    nsa, mc = _module()
    _, k, v, _ = _inputs(1, 10, 2, 1, 16, 12, mc.hidden_size)
    k_cmp, _ = nsa.compress(k, v)
    l, d = 4, 2
    blk = k[0, 2 * d: 2 * d + l, 0] + nsa.compress_k.pos[...]
    np.testing.assert_allclose(k_cmp[0, 2, 0], blk.mean(0), atol=1e-5)


def test_decode_step_matches_reference_last_position():
    """Cache filled token by token (compress_update), one decode step at the end of each row,
    including a row whose last document starts mid-row (doc_start > 0)."""
    nsa, mc = _module()
    b, t, s, h, g = 2, 37, 48, 4, 2
    q, k, v, x = _inputs(b, t, h, g, 16, 12, mc.hidden_size, seed=2)
    seg = jnp.stack([jnp.ones((t,), jnp.int32), jnp.where(jnp.arange(t) < 14, 1, 2)])
    pos_in_doc = jnp.broadcast_to(jnp.arange(t), (b, t))
    ref = nsa(q, k, v, x, seg, pos_in_doc, softmax_scale=0.3, impl="reference")

    pad = ((0, 0), (0, s - t), (0, 0), (0, 0))
    k_cache, v_cache = jnp.pad(k, pad), jnp.pad(v, pad)
    k_cmp = jnp.zeros((b, s // 2, g, 16))
    v_cmp = jnp.zeros((b, s // 2, g, 12))
    for p in range(t):
        k_cmp, v_cmp = nsa.compress_update(k_cache, v_cache, k_cmp, v_cmp, jnp.full((b,), p))
    full_k, _ = nsa.compress(k, v)
    n_done = (t - 4) // 2 + 1
    np.testing.assert_allclose(k_cmp[:, :n_done], full_k[:, :n_done], atol=1e-5)

    gates = nsa.gates(x)[:, -1]
    out = decode.decode_step(q[:, -1], k_cache, v_cache, k_cmp, v_cmp, gates, jnp.full((b,), t - 1),
                             jnp.array([0, 14]), cfg=nsa.cfg, softmax_scale=0.3)
    np.testing.assert_allclose(out, ref[:, -1], atol=2e-5)


def test_decode_bytes_read_grow_sublinearly():
    cfg = reference.NSAConfig()
    kw = {"key_bytes": 576 * 2, "value_bytes": 0, "cmp_bytes": (576 + 512) * 2, "shared_kv": True}
    small, dense_small = decode.bytes_per_token(4095, cfg, **kw)
    big, dense_big = decode.bytes_per_token(65535, cfg, **kw)
    assert dense_big / big > dense_small / small > 1
    # at 64k: 4095 compressed entries + 16 blocks of 64 slots (the window lies in them... or not)
    assert big <= 4095 * (576 + 512) * 2 + (16 * 64 + 512) * 576 * 2
