"""The NSA nnx module (compression, gates) and the decode step against the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.nsa_inputs import fast_compiles, packed_segments  # noqa: F401

from coder.pallas.nsa import decode, reference
from coder.pallas.nsa.module import NSA
from configs.base import get_config


def _module(dk=16, dv=12):
    mc = get_config().model
    mc.nsa.update({"compress_block": 4, "compress_stride": 2, "select_block": 8, "select_topk": 3, "window": 8})
    mc.param_dtype = "float32"
    return NSA(mc, nnx.Rngs(0), key_dim=dk, value_dim=dv), mc


def _inputs(b, t, h, g, dk, dv, d, seed=1):
    """Standard-normal q, k, v and gate input, float32 (numpy's generator: eager jax.random compiles per shape)."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    return draw(b, t, h, dk), draw(b, t, g, dk), draw(b, t, g, dv), draw(b, t, d)


def _call(nsa, q, k, v, x, seg, impl):
    pos = jnp.broadcast_to(jnp.arange(seg.shape[1]), seg.shape)
    return nsa(q, k, v, x, seg, pos, softmax_scale=0.3, impl=impl)


_apply = nnx.jit(_call, static_argnames=("impl",))


@pytest.mark.slow
def test_module_xla_matches_reference_and_trains_every_part():
    nsa, mc = _module()
    b, t = 2, 21
    q, k, v, x = _inputs(b, t, 4, 1, 16, 12, mc.hidden_size)
    seg = packed_segments(b, t, 2, 1, seed=4)
    out = _apply(nsa, q, k, v, x, seg, "xla")
    ref = _apply(nsa, q, k, v, x, seg, "reference")
    assert out.shape == (b, t, 4, 12)
    np.testing.assert_allclose(out, ref, atol=2e-5)

    # perturb w2 away from its zero init so every parameter sits on the gradient path
    nsa.compress_k.w2[...] = 0.01 * jnp.ones_like(nsa.compress_k.w2[...])
    nsa.compress_v.w2[...] = 0.01 * jnp.ones_like(nsa.compress_v.w2[...])
    loss = lambda m: jnp.sum(_call(m, q, k, v, x, seg, "xla") ** 2)
    grads = nnx.jit(nnx.grad(loss))(nsa)
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
    ref = _apply(nsa, q, k, v, x, seg, "reference")

    pad = ((0, 0), (0, s - t), (0, 0), (0, 0))
    k_cache, v_cache = jnp.pad(k, pad), jnp.pad(v, pad)
    k_cmp = jnp.zeros((b, s // 2, g, 16))
    v_cmp = jnp.zeros((b, s // 2, g, 12))
    update = nnx.jit(lambda m, *a: m.compress_update(*a))  # one program, called once per slot
    for p in range(t):
        k_cmp, v_cmp = update(nsa, k_cache, v_cache, k_cmp, v_cmp, jnp.full((b,), p))
    full_k, _ = nnx.jit(lambda m, k, v: m.compress(k, v))(nsa, k, v)
    n_done = (t - 4) // 2 + 1
    np.testing.assert_allclose(k_cmp[:, :n_done], full_k[:, :n_done], atol=1e-5)

    step = nnx.jit(lambda m, q, x, *a: decode.decode_step(q, *a[:4], m.gates(x)[:, -1], *a[4:], cfg=m.cfg,
                                                          softmax_scale=0.3))
    out = step(nsa, q[:, -1], x, k_cache, v_cache, k_cmp, v_cmp, jnp.full((b,), t - 1), jnp.array([0, 14]))
    np.testing.assert_allclose(out, ref[:, -1], atol=2e-5)


def _bytes_read(jaxpr, var):
    """Bytes of array `var` that `jaxpr` reads: a gather or slice of it reads its output's size, a
    call into a sub-jaxpr is followed, any other use reads the whole array. Reads of one primitive
    and output shape count once: decode_step gathers the same slots of MLA's latent for the keys
    and for the values (identical gathers, which XLA merges)."""
    seen, total = set(), 0
    for eqn in jaxpr.eqns:
        for i, x in enumerate(eqn.invars):
            if x is not var:
                continue
            sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            if sub is not None:
                sub = getattr(sub, "jaxpr", sub)
                total += _bytes_read(sub, sub.invars[i])
                continue
            out = eqn.outvars[0].aval
            sliced = eqn.primitive.name in ("gather", "dynamic_slice", "slice") and i == 0
            key = (eqn.primitive.name, out.shape if sliced else None)
            if key not in seen:
                seen.add(key)
                total += out.size * out.dtype.itemsize if sliced else var.aval.size * var.aval.dtype.itemsize
    return total


@pytest.mark.parametrize("s_len", [200, 4096, 65536])
def test_decode_reads_what_bytes_per_token_counts(s_len):
    """bytes_per_token (bench/nsa.py's decode column) equals what decode_step's program reads from the
    caches, for DeepSeek-V3's MLA cache (bf16 latent 512 + RoPE key 64 per slot, V = the latent;
    compressed K 576 + V 512 per entry), and at 64k it reads a small fraction of the raw cache."""
    cfg = reference.NSAConfig()
    sc = -(-s_len // cfg.compress_stride)
    bf16 = jnp.bfloat16
    shapes = [((1, s_len, 1, 512), bf16), ((1, s_len, 1, 64), bf16), ((1, sc, 1, 576), bf16),
              ((1, sc, 1, 512), bf16), ((1, 16, 576), jnp.float32), ((1, 16, 3), jnp.float32), ((1,), jnp.int32)]
    step = lambda lat, rope, k_cmp, v_cmp, q, g, pos: decode.decode_step(
        q, (lat, rope), lat, k_cmp, v_cmp, g, pos, cfg=cfg, softmax_scale=0.1)
    closed = jax.make_jaxpr(step)(*[jax.ShapeDtypeStruct(s, d) for s, d in shapes])
    reads = [_bytes_read(closed.jaxpr, v) for v in closed.jaxpr.invars[:4]]
    nsa_bytes, dense_bytes = decode.bytes_per_token(s_len - 1, cfg, key_bytes=576 * 2, value_bytes=0,
                                                    cmp_bytes=(576 + 512) * 2, shared_kv=True)
    assert sum(reads) == nsa_bytes
    assert dense_bytes == s_len * 576 * 2
    if s_len == 65536:  # n l' + w = 1536 of 65536 slots of the raw cache
        assert reads[0] == 1536 * 512 * 2 and reads[1] == 1536 * 64 * 2
        assert 6 < dense_bytes / nsa_bytes < 8  # the compressed entries (S/d, 2176 bytes each) dominate
