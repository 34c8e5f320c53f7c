"""Ring attention (coder.model.context_parallel, model.context_parallel="ring") against whole-row
attention on 8 fake devices, forward and backward: XLA's blocks, splash's (TPU) and the Triton
flash kernel's (GPU) in the Pallas interpreter, packed documents and a padded tail; and the
MLA layer with the key set, against the same layer unsharded."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

from coder.model import attention_kernels as ak
from coder.model import context_parallel as cp
from coder.model import sharding
from tests.model.model_inputs import tiny_moe

DQ, DV = 192, 128  # DeepSeek-V3's MLA: dn + dr = 128 + 64, dv = 128


def _inputs(b=2, t=512, h=2, dq=DQ, dv=DV, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, h, dq), jnp.float32)
    k = jax.random.normal(kk, (b, t, h, dq), jnp.float32)
    v = jax.random.normal(kv, (b, t, h, dv), jnp.float32)
    seg = np.zeros((b, t), np.int32)
    seg[0, :100], seg[0, 100:t - 26] = 1, 2  # two documents and a padded tail (26 tokens)
    seg[1, :] = 1  # one document filling the row ...
    seg[1, 300:] = 3  # ... split where no shard or half-chunk starts
    return q, k, v, jnp.asarray(seg)


def _mesh(data, tensor, seq):
    return Mesh(np.asarray(jax.devices()[:data * tensor * seq]).reshape(data, 1, 1, tensor, seq), sharding.AXES,
                axis_types=(AxisType.Auto,) * 5)


RULES = (("batch", "data"), ("seq", "sequence"), ("heads", "tensor"))


def _check(fn, q, k, v, seg, tol):
    scale = q.shape[-1] ** -0.5
    ref = lambda *a: ak.reference_attention(*a, scale=scale)
    valid = (seg > 0)[:, :, None, None]
    w = jnp.cos(jnp.arange(v.size // v.shape[-1] * v.shape[-1], dtype=jnp.float32).reshape(*q.shape[:3], v.shape[-1]))
    loss = lambda f: lambda *a: jnp.sum(jnp.where(valid, f(*a, seg) * w, 0.0))
    mine = jax.jit(lambda *a: fn(*a, scale=scale))
    np.testing.assert_allclose(np.where(valid, mine(q, k, v, seg), 0), np.where(valid, ref(q, k, v, seg), 0),
                               atol=tol, rtol=tol)
    g = jax.jit(jax.grad(loss(lambda *a: fn(*a, scale=scale)), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g, g_ref):
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol, err_msg=f"d{name}")


@pytest.mark.parametrize("data,tensor,seq", [pytest.param(1, 1, 8, marks=pytest.mark.slow), (2, 2, 2), (1, 2, 4)])
def test_the_ring_of_xla_blocks_equals_whole_row_attention(data, tensor, seq):
    with sharding.activate(_mesh(data, tensor, seq), RULES):
        _check(lambda *a, scale: ak.ring_attention(*a, scale, kernel="reference"), *_inputs(dq=24, dv=16), tol=1e-5)


@pytest.mark.slow
def test_the_ring_of_splash_blocks_equals_whole_row_attention():
    """TPU: splash's causal and whole-block kernels (interpret mode) over 2 sequence shards x 2
    head shards x 2 row shards: 1024-token rows, 256-token half-chunks (two kernel blocks)."""
    with sharding.activate(_mesh(2, 2, 2), RULES):
        _check(lambda *a, scale: ak.ring_attention(*a, scale, kernel="splash", interpret=True), *_inputs(t=1024),
               tol=2e-4)


@pytest.mark.slow
def test_the_ring_of_flash_blocks_equals_whole_row_attention():
    """GPU: the Triton flash kernels at positions (interpret mode), 4 sequence shards x 2 rows."""
    with sharding.activate(_mesh(2, 1, 4), RULES):
        _check(lambda *a, scale: ak.ring_attention(*a, scale, kernel="flash", interpret=True), *_inputs(t=1024),
               tol=2e-4)


def test_the_ring_holds_a_device_share_of_the_keys_where_gather_holds_the_row():
    """What the ring exists for, read off the compiled CPU program: over 4 sequence shards x 2
    head shards the gathering path's program holds each row's keys and values whole (an
    all-gather), the ring's moves a device's own share by collective permutes: its keys in
    half-chunks `[rows, T/8, heads/2, dq]` (a ring that left the heads unsplit computed the same
    numbers with every head on every device)."""
    q, k, v, seg = _inputs(t=1024, dq=24, dv=16)
    mesh = _mesh(1, 2, 4)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence", "tensor"))
    args = [jax.device_put(a, spec) for a in (q, k, v)] + [jax.device_put(seg, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, "sequence")))]
    with sharding.activate(mesh, RULES):
        ring = jax.jit(lambda *a: ak.ring_attention(*a, 0.2, kernel="reference")).lower(*args).compile().as_text()
    gather = jax.jit(lambda *a: ak.reference_attention(*a, 0.2), out_shardings=spec).lower(*args).compile().as_text()
    assert "all-gather" in gather and "all-gather" not in ring
    permuted = re.findall(r"= (f32\[[\d,]+\])\S* collective-permute", ring)
    assert "f32[2,128,1,24]" in permuted and "f32[2,128,2,24]" not in permuted, permuted


def test_ring_refuses_rows_it_cannot_split_into_half_chunks_and_shared_prefix_rows():
    q, k, v, seg = _inputs(b=2, t=520, dq=24, dv=16)
    with sharding.activate(_mesh(1, 1, 8), RULES):
        with pytest.raises(ValueError, match="half-chunks of whole 128-token blocks"):
            ak.ring_attention(q, k, v, seg, 0.2, kernel="splash")
        with pytest.raises(ValueError, match="no shared-prefix mask"):
            ak.attention(q, k, v, seg, 0.2, prefix_segment=seg, context_parallel_mode="ring")
    with pytest.raises(ValueError, match="model.context_parallel='rings'"):
        ak.attention(q, k, v, seg, 0.2, context_parallel_mode="rings")


def test_mla_with_a_ring_equals_the_unsharded_layer():
    """The layer as the model runs it (model.context_parallel="ring", CPU: XLA's blocks through
    `attention_kernels.attention`, rows padded to whole half-chunks): output and gradients of
    the unsharded layer, on 4 sequence shards x 2 row shards with packed documents."""
    from coder.model.attention import MLA

    cfg = tiny_moe(context_parallel="ring")
    layer = MLA(cfg, nnx.Rngs(0))
    t = 60  # padded to 64: 4 shards x 2 half-chunks of 8
    x = jax.random.normal(jax.random.key(1), (2, t, cfg.hidden_size), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    seg = jnp.asarray(np.where(np.arange(t) < 23, 1, 2)[None].repeat(2, 0), jnp.int32)
    graph, params = nnx.split(layer)

    def loss(params, x):
        out, _ = nnx.merge(graph, params)(x, pos, seg)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))), out

    (l_ref, o_ref), g_ref = jax.value_and_grad(loss, has_aux=True)(params, x)
    with sharding.activate(_mesh(2, 1, 4), RULES):
        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (l, o), g = step(params, x)
        assert "collective-permute" in step.lower(params, x).compile().as_text()  # the ring ran
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_zigzag_order_gives_every_query_shard_the_same_causal_work():
    n, t = 4, 64
    pos = cp.zigzag_positions(t, n)
    assert sorted(pos) == list(range(t))
    work = [int((pos[s * t // n:(s + 1) * t // n] + 1).sum()) for s in range(n)]  # keys at or before
    assert len(set(work)) == 1
    contiguous = [int(np.arange(s * t // n, (s + 1) * t // n).sum() + t // n) for s in range(n)]
    assert max(contiguous) / np.mean(contiguous) > 1.7  # what zigzag removes: (2n-1)/n


def test_nsa_refuses_the_ring_by_name():
    from coder.model.attention import MLA

    with pytest.raises(ValueError, match="model.context_parallel='ring' is the dense backend's"):
        MLA(tiny_moe(attention_backend="nsa", context_parallel="ring"), nnx.Rngs(0))
    with pytest.raises(ValueError, match="model.context_parallel='zigzag': choose one of"):
        MLA(tiny_moe(context_parallel="zigzag"), nnx.Rngs(0))
