"""NSA reference semantics and the blockwise XLA path against it (forward and gradients)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.pallas.nsa import ops, reference, xla
from coder.pallas.nsa.reference import NSAConfig
from tests.nsa_inputs import fast_compiles, make_inputs, normal, packed_segments  # noqa: F401

SMALL = NSAConfig(compress_block=4, compress_stride=2, select_block=8, select_topk=3, window=8)


SHAPES = [  # b, t, h, g, dk, dv, docs, pad
    pytest.param(2, 45, 6, 2, 24, 16, 3, 3, id="gqa-ragged-3docs-pad"),  # Hg = 3 != G = 2, Dk != Dv
    pytest.param(1, 40, 4, 1, 24, 16, 2, 0, id="mqa-mla-layout"),
    pytest.param(2, 5, 2, 2, 8, 8, 1, 0, id="shorter-than-blocks"),
]


def test_full_coverage_equals_dense_attention():
    """With n * l' and w covering the row, the selected and window branches are full attention."""
    cfg = NSAConfig(compress_block=4, compress_stride=2, select_block=8, select_topk=8, window=64)
    x = make_inputs(2, 45, 4, 2, 16, 16, cfg)
    seg = packed_segments(2, 45, 3, 3, seed=1)
    dense = jax.jit(reference.dense_attention)(x["q"], x["k"], x["v"], seg, 0.3)
    nsa = jax.jit(lambda g: reference.nsa(x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], g, seg, cfg, 0.3))
    for gates in ([0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.4, 0.6]):
        out = nsa(jnp.broadcast_to(jnp.array(gates), (2, 45, 4, 3)))
        np.testing.assert_allclose(out, dense, atol=1e-5)
    # and the dense reference is the textbook softmax for one document, one head
    q, k, v = x["q"][0, :, 0], x["k"][0, :, 0], x["v"][0, :, 0]
    s = np.where(np.tril(np.ones((45, 45), bool)), q @ k.T * 0.3, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    got = jax.jit(reference.dense_attention)(x["q"][:1], x["k"][:1], x["v"][:1], jnp.ones((1, 45), jnp.int32), 0.3)
    np.testing.assert_allclose(got[0, :, 0], want, atol=1e-5)


def test_selection_rules():
    t = 45
    seg = packed_segments(2, t, 3, 3, seed=2)
    x = make_inputs(2, t, 4, 2, 16, 16, SMALL)
    @jax.jit
    def select(x, seg):
        _, p = reference.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], seg, SMALL, 0.3)
        return reference.select_blocks(reference.selection_scores(p, 2, SMALL), seg, SMALL)

    sel = np.asarray(select(x, seg))
    ds = np.asarray(xla.doc_starts(seg))
    lb = SMALL.select_block
    assert np.all(np.diff(sel, axis=-1) >= 0), "canonical form is sorted"
    for b in range(2):
        for ti in range(t):
            cur, first = ti // lb, ds[b, ti] // lb
            for gi in range(2):
                s = set(sel[b, ti, gi].tolist())
                assert {cur, first} <= s and (cur - 1 < first or cur - 1 in s)
                assert all(first <= j <= cur for j in s), "only blocks of the query's document, no future"
                assert len(s) == min(SMALL.select_topk, cur - first + 1)


def test_compressed_visibility_respects_documents():
    seg = packed_segments(1, 30, 2, 0, seed=3)
    vis = np.asarray(reference.compressed_visibility(seg, SMALL))[0]
    s = np.asarray(seg)[0]
    for ti in range(30):
        for i in range(vis.shape[1]):
            lo, hi = i * SMALL.compress_stride, i * SMALL.compress_stride + SMALL.compress_block - 1
            want = hi <= ti and np.all(s[lo:hi + 1] == s[ti])
            assert vis[ti, i] == want


@pytest.mark.parametrize("b,t,h,g,dk,dv,docs,pad", SHAPES)
def test_xla_matches_reference(b, t, h, g, dk, dv, docs, pad):
    x = make_inputs(b, t, h, g, dk, dv, SMALL, seed=t)
    seg = packed_segments(b, t, docs, pad, seed=t)
    w = normal((b, t, h, dv), 7)
    names = ("q", "k", "v", "k_cmp", "v_cmp", "gates")

    def loss(impl):
        def f(*args):
            out = ops.nsa_attention(*args, seg, cfg=SMALL, softmax_scale=0.3, impl=impl, chunk=16)
            return jnp.sum(out * w), out
        return f

    args = [x[n] for n in names]
    run = lambda impl: jax.jit(jax.value_and_grad(loss(impl), argnums=range(6), has_aux=True))(*args)
    (_, ref), g_ref = run("reference")
    (_, out), g_xla = run("xla")
    np.testing.assert_allclose(out, ref, atol=2e-5)
    for n, a, c in zip(names, g_ref, g_xla):
        np.testing.assert_allclose(c, a, atol=5e-5, err_msg=n)


def test_xla_local_queries_at_an_offset_equal_the_whole_row():
    """Sequence parallelism's building block: the row's queries in 4 pieces, each run at its
    offset against the whole row's keys (xla.nsa_local, what one device of the shard_map runs),
    put together equal the whole row's NSA; forward and the gradients of the keys."""
    b, t, h, g, dk, dv = 2, 48, 4, 1, 16, 8
    x = make_inputs(b, t, h, g, dk, dv, SMALL, seed=5)
    seg = packed_segments(b, t, 3, 2, seed=5)
    w = normal((b, t, h, dv), 9)
    whole = lambda k, v: xla.nsa(x["q"], k, v, x["k_cmp"], x["v_cmp"], x["gates"], seg, SMALL, 0.3, 8)

    @jax.jit
    def pieces(k, v):
        step = t // 4
        return jnp.concatenate([
            xla.nsa_local(x["q"][:, i:i + step], k, v, x["k_cmp"], x["v_cmp"], x["gates"][:, i:i + step], seg,
                          jnp.int32(i), SMALL, 0.3, 8) for i in range(0, t, step)], axis=1)

    np.testing.assert_allclose(pieces(x["k"], x["v"]), whole(x["k"], x["v"]), atol=1e-5)
    grad = lambda f: jax.grad(lambda k, v: jnp.sum(f(k, v) * w), argnums=(0, 1))(x["k"], x["v"])
    for a, e in zip(grad(pieces), grad(whole)):
        np.testing.assert_allclose(a, e, atol=1e-4)
