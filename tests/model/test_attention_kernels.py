"""The dense backend's attention kernels (coder.model.attention_kernels) against the XLA reference,
forward and backward, in the Pallas interpreter: TPU splash attention and the GPU Triton flash
kernel (coder.pallas.flash_gpu), each on one device and split over heads, queries (zigzag) and
rows on 8 fake devices. MLA's widths (queries and keys 192, values 128), several documents per
row and a padded (segment 0) tail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from coder.model import attention_kernels as ak
from coder.model import sharding
from coder.model.context_parallel import zigzag_positions
from tests.model.model_inputs import cuda_grids

DQ, DV = 192, 128  # DeepSeek-V3's MLA: dn + dr = 128 + 64, dv = 128


def _inputs(b=2, t=256, h=2, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, h, DQ), jnp.float32)
    k = jax.random.normal(kk, (b, t, h, DQ), jnp.float32)
    v = jax.random.normal(kv, (b, t, h, DV), jnp.float32)
    seg = np.zeros((b, t), np.int32)
    seg[0, :100], seg[0, 100:230] = 1, 2  # two documents and a padded tail (26 tokens)
    seg[1, :] = 1  # one document filling the row
    seg[1, 130:] = 3  # ... split at a position that is not a block boundary
    return q, k, v, jnp.asarray(seg)


def _loss(fn, q, k, v, seg):
    o = fn(q, k, v, seg)
    w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))  # every output counts
    return jnp.sum(jnp.where((seg > 0)[:, :, None, None], o * w, 0.0))


def _check(fn, q, k, v, seg, tol):
    scale = DQ ** -0.5
    ref = lambda *a: ak.reference_attention(*a, scale=scale)
    mine = lambda *a: fn(*a, scale=scale)
    valid = (seg > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(valid, mine(q, k, v, seg), 0),
                               np.where(valid, ref(q, k, v, seg), 0), atol=tol, rtol=tol)
    g_ref = jax.grad(lambda *a: _loss(ref, *a, seg), argnums=(0, 1, 2))(q, k, v)
    g = jax.grad(lambda *a: _loss(mine, *a, seg), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g, g_ref):
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol, err_msg=f"d{name}")


def test_splash_attention_equals_reference_forward_and_backward():
    _check(lambda *a, scale: ak.splash_attention(*a, scale=scale, interpret=True), *_inputs(), tol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("data,seq", [(2, 2), (1, 4)])
def test_splash_attention_split_over_heads_queries_and_rows_on_8_devices(data, seq):
    """shard_map with the kernel's mask information split like the queries: heads over
    `tensor` (2), queries over `sequence` (2 or 4, exchanged into zigzag order), rows over
    `data`."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(data, 1, 1, 2, seq), sharding.AXES,
                axis_types=(AxisType.Auto,) * 5)
    rules = (("batch", "data"), ("seq", "sequence"), ("heads", "tensor"))
    q, k, v, seg = _inputs(t=512)
    with sharding.activate(mesh, rules):
        assert ak._specs(mesh, sharding.rules_dict(rules), 2, 512, 2) == ("data", "sequence", "tensor")
        _check(lambda *a, scale: jax.jit(lambda *b: ak.splash_attention(*b, scale=scale, interpret=True))(*a),
               q, k, v, seg, tol=2e-4)


@pytest.mark.parametrize("q_seq_shards, offset", [(1, 0), (4, 0), (1, 3)])
def test_corner_causal_mask_gives_splash_the_mask_information_of_its_causal_mask(q_seq_shards, offset):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi

    seq, heads = 1024, 2
    fast, stock = ak._corner_causal_mask_type()((seq, seq), offset=offset), sm.CausalMask((seq, seq), offset=offset)
    if q_seq_shards > 1:
        fast.q_sequence = stock.q_sequence = zigzag_positions(seq, q_seq_shards)
    for q0, k0, n in [(0, 0, 128), (256, 0, 128), (0, 512, 256), (130, 100, 77), (0, 0, seq)]:
        idx = (slice(q0, q0 + n), slice(k0, k0 + n))
        block = fast[idx]
        np.testing.assert_array_equal(np.asarray(block), stock[idx])
        assert (block.any(), block.all()) == (stock[idx].any(), stock[idx].all())
    for is_dkv in (False, True):
        got = mi._process_mask(sm.MultiHeadMask([fast] * heads), (128, 256), is_dkv, q_seq_shards=q_seq_shards)[0]
        want = mi._process_mask(sm.MultiHeadMask([stock] * heads), (128, 256), is_dkv, q_seq_shards=q_seq_shards)[0]
        for name in got._fields:
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                np.testing.assert_array_equal(a, b, err_msg=name)


def test_gpu_flash_attention_equals_reference_forward_and_backward():
    _check(lambda *a, scale: ak.gpu_flash_attention(*a, scale=scale, interpret=True), *_inputs(), tol=2e-4)


def test_attention_lowers_to_splash_for_tpu_and_to_xla_for_cpu(monkeypatch):
    q, k, v, seg = _inputs()
    assert sharding.targets_cpu()  # here: the reference alone is traced
    monkeypatch.setattr(sharding, "target_platform", lambda: None)  # decided where lowered: each lowering below
    fn = jax.jit(lambda *a: ak.attention(*a, scale=0.1))
    tpu = fn.trace(q, k, v, seg).lower(lowering_platforms=("tpu",)).as_text()
    cpu = fn.trace(q, k, v, seg).lower(lowering_platforms=("cpu",)).as_text()
    assert "splash_mha_fwd_segmented" in tpu and "tpu_custom_call" in tpu
    assert "tpu_custom_call" not in cpu and "splash" not in cpu





def test_attention_lowers_to_triton_flash_for_cuda_with_tiles_an_h100_holds(monkeypatch):
    """Lowered for GPU from this CPU host: the Triton flash kernels, forward, dQ and dK/dV,
    over flash_gpu.Tiles' tiles (grid = tokens / tile, rows, heads). 512-token tiles (the TPU's)
    asked an H100 for 1.25 MiB of shared memory and failed to compile (docs/accelerator.md);
    lowering cannot see shared memory, the tile count can."""
    from coder.pallas.flash_gpu import Tiles

    *qkv, seg = _inputs()
    q, k, v = (a.astype(jnp.bfloat16) for a in qkv)
    t, b, h = q.shape[1], q.shape[0], q.shape[2]
    monkeypatch.setattr(sharding, "target_platform", lambda: None)
    loss = lambda q, k, v: jnp.sum(ak.attention(q, k, v, seg, scale=0.1).astype(jnp.float32))
    grids = cuda_grids(jax.grad(loss, (0, 1, 2)), q, k, v)
    tiles = Tiles()
    assert grids == {"flash_fwd_at_positions": (t // tiles.block_q, b, h),
                     "flash_dq_at_positions": (t // tiles.block_q_bwd, b, h),
                     "flash_dkv_at_positions": (t // tiles.block_k_bwd, b, h)}, grids


@pytest.mark.parametrize("data,seq", [(2, 2), (1, 4)])
def test_gpu_flash_attention_split_over_heads_queries_and_rows_on_8_devices(data, seq):
    """Context parallelism on GPU meshes, in the interpreter: heads over `tensor` (2), queries
    over `sequence` (2 or 4, in zigzag order, each device's kernel given its queries' positions),
    rows over `data`, keys and values whole per device; equal to the reference forward and
    backward."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(data, 1, 1, 2, seq), sharding.AXES,
                axis_types=(AxisType.Auto,) * 5)
    rules = (("batch", "data"), ("seq", "sequence"), ("heads", "tensor"))
    q, k, v, seg = _inputs(t=512)
    with sharding.activate(mesh, rules):
        _check(lambda *a, scale: jax.jit(lambda *b: ak.gpu_flash_attention(*b, scale=scale, interpret=True))(*a),
               q, k, v, seg, tol=2e-4)


def test_a_sequence_split_gpu_mesh_gives_each_device_its_share_of_the_queries(monkeypatch):
    """Lowered for CUDA under a mesh with queries over 4 `sequence` devices: each device's
    kernels run over T/4 queries against the T keys (a query-tile grid of T/4/64), where the
    whole-row kernel would run over every query on every device."""
    from coder.pallas.flash_gpu import Tiles

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 1, 1, 1, 4), sharding.AXES,
                axis_types=(AxisType.Auto,) * 5)
    rules = (("batch", "data"), ("seq", "sequence"), ("heads", "tensor"))
    *qkv, seg = _inputs(t=1024)
    q, k, v = (a.astype(jnp.bfloat16) for a in qkv)
    monkeypatch.setattr(sharding, "target_platform", lambda: None)
    loss = lambda q, k, v: jnp.sum(ak.attention(q, k, v, seg, scale=0.1).astype(jnp.float32))
    with sharding.activate(mesh, rules):
        grids = cuda_grids(jax.grad(loss, (0, 1, 2)), q, k, v)
    tiles, rows, heads = Tiles(), 1, q.shape[2]  # 2 rows over data 2, both heads per device
    assert grids["flash_fwd_at_positions"] == (1024 // 4 // tiles.block_q, rows, heads), grids
    assert grids["flash_dq_at_positions"] == (1024 // 4 // tiles.block_q_bwd, rows, heads), grids
    assert grids["flash_dkv_at_positions"] == (1024 // tiles.block_k_bwd, rows, heads), grids  # all keys


def test_rows_not_a_multiple_of_the_block_are_padded_for_the_kernel():
    q, k, v, seg = (a[:, :200] for a in _inputs())
    _check(lambda *a, scale: ak._padded(lambda *b: ak.splash_attention(*b, scale=scale, interpret=True))(*a),
           q, k, v, seg, tol=2e-4)


def test_block_len_refuses_a_sequence_no_kernel_block_divides():
    assert ak.block_len(4096, 32768) == 512 and ak.block_len(384) == 128
    with pytest.raises(ValueError, match="divisible by 128"):
        ak.block_len(200)


def test_save_attention_remat_keeps_the_kernel_output_instead_of_rerunning_it(monkeypatch):
    """Lowered for TPU: under remat "full" the backward pass reruns the forward kernel, under
    "save_attention" (its output and log-sum-exp kept) it does not."""
    from coder.model.transformer import REMAT_POLICIES

    monkeypatch.setattr(sharding, "target_platform", lambda: None)
    q, k, v, seg = _inputs()

    def kernel_calls(policy):
        block = jax.checkpoint(lambda q, k, v: ak.attention(q, k, v, seg, scale=0.1), policy=policy)
        f = lambda q, k, v: (block(q, k, v) ** 2).sum()  # the output is used: forward runs first
        text = jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(q, k, v).lower(
            lowering_platforms=("tpu",)).as_text()
        return text.count("tpu_custom_call(")  # forward (+ rerun), fused backward (dq, dk, dv)

    assert kernel_calls(REMAT_POLICIES["full"]) == 3
    assert kernel_calls(REMAT_POLICIES["save_attention"]) == 2


# ----------------------------------------------------------------------------- shared prefix
def test_shared_prefix_mask_by_hand():
    """A prompt (segment 1, 3 tokens), two continuations (segments 2 and 3, prefix 1), a second
    document on its own (segment 4) and a padded tail: each continuation sees the prompt and
    itself, never the other continuation; the document sees only itself."""
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 4, 4, 0]], jnp.int32)
    pre = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 0, 0, 0]], jnp.int32)
    expected = np.array([
        # 1  1  1  2  2  3  3  4  4  0   <- key segment
        [1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # continuation A: prompt + itself
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 0, 0],  # continuation B: prompt + itself, not A
        [1, 1, 1, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 0, 0],  # a document of its own
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1],  # padding sees padding only (as without a prefix)
    ], bool)
    np.testing.assert_array_equal(np.asarray(ak.attention_mask(seg, pre))[0, 0], expected)
    plain = np.asarray(ak.attention_mask(seg))[0, 0]  # no prefix: the continuations see only themselves
    np.testing.assert_array_equal(plain[3:7, :3], np.zeros((4, 3), bool))
    np.testing.assert_array_equal(plain, expected & (np.asarray(seg)[0][:, None] == np.asarray(seg)[0][None]))


@pytest.mark.slow
def test_shared_prefix_attention_equals_unshared_rows():
    """reference_attention over [prompt | cont A | cont B] with the prefix mask gives each
    continuation token the output of its own row [prompt | cont], forward and backward (the
    prompt's gradient is the sum of both rows')."""
    p, a, b_len, h, d = 5, 3, 4, 2, 8
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    shared = [jax.random.normal(key, (1, p + a + b_len, h, d), jnp.float32) for key in (kq, kk, kv)]
    seg = jnp.asarray([[1] * p + [2] * a + [3] * b_len], jnp.int32)
    pre = jnp.asarray([[0] * p + [1] * (a + b_len)], jnp.int32)
    rows = [jnp.r_[0:p, p:p + a], jnp.r_[0:p, p + a:p + a + b_len]]  # the unshared rows' indices
    w = jax.random.normal(jax.random.key(2), (1, p + a + b_len, h, d), jnp.float32)

    def packed(q, k, v):
        return ak.reference_attention(q, k, v, seg, 0.3, prefix_segment=pre)

    def unshared(q, k, v):
        outs = [ak.reference_attention(q[:, i], k[:, i], v[:, i], jnp.ones((1, i.size), jnp.int32), 0.3)
                for i in rows]
        # the prompt's outputs are the same in both rows: count them once, as the packed row does
        return jnp.concatenate([outs[0], outs[1][:, p:]], axis=1)

    np.testing.assert_allclose(packed(*shared), unshared(*shared), rtol=1e-5, atol=1e-6)
    g_packed = jax.grad(lambda *x: jnp.sum(packed(*x) * w), argnums=(0, 1, 2))(*shared)
    g_unshared = jax.grad(lambda *x: jnp.sum(unshared(*x) * w), argnums=(0, 1, 2))(*shared)
    for x, y in zip(g_packed, g_unshared):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def _prefix_rows(t=256):
    """Row 0: a prompt of 90 tokens (segment 1), continuations of 70, 50 and 30 (segments 2-4,
    prefix 1) and a padded tail; row 1: a document of its own and a second prompt with two
    continuations crossing a kernel tile."""
    seg, pre = np.zeros((2, t), np.int32), np.zeros((2, t), np.int32)
    seg[0, :90], seg[0, 90:160], seg[0, 160:210], seg[0, 210:240] = 1, 2, 3, 4
    pre[0, 90:240] = 1
    seg[1, :40], seg[1, 40:140], seg[1, 140:200], seg[1, 200:] = 5, 6, 7, 8
    pre[1, 140:] = 6
    return jnp.asarray(seg), jnp.asarray(pre)


@pytest.mark.parametrize("seq", [1, 4])
def test_gpu_flash_attention_takes_shared_prefix_rows(seq):
    """The flash kernel with the prefix mask equals reference_attention with it, forward and
    backward, whole rows and with queries over 4 `sequence` devices (zigzag, each device's
    prefix ids exchanged with its queries)."""
    q, k, v, _ = _inputs(t=512)
    seg, pre = (jnp.tile(a, (1, 2)) for a in _prefix_rows())  # two copies of the layout per row
    ref = lambda q, k, v, s, scale: ak.reference_attention(q, k, v, s, scale, prefix_segment=pre)
    mine = lambda q, k, v, s, scale: ak.gpu_flash_attention(q, k, v, s, scale=scale, interpret=True,
                                                             prefix_segment=pre)
    scale = DQ ** -0.5
    w = jnp.cos(jnp.arange(q.shape[0] * 512 * 2 * DV, dtype=jnp.float32).reshape(q.shape[:3] + (DV,)))
    loss = lambda f: lambda *a: jnp.sum(jnp.where((seg > 0)[:, :, None, None], f(*a, seg, scale) * w, 0.0))
    mesh = Mesh(np.asarray(jax.devices()[:2 * seq]).reshape(2, 1, 1, 1, seq), sharding.AXES,
                axis_types=(AxisType.Auto,) * 5)
    rules = (("batch", "data"), ("seq", "sequence"), ("heads", "tensor"))
    with sharding.activate(mesh, rules):
        g = jax.jit(jax.grad(loss(mine), argnums=(0, 1, 2)))(q, k, v)
        o = jax.jit(lambda *a: mine(*a, seg, scale))(q, k, v)
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    valid = (seg > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(valid, o, 0), np.where(valid, ref(q, k, v, seg, scale), 0), atol=2e-4)
    for name, a, b in zip("qkv", g, g_ref):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4, err_msg=f"d{name}")


def test_shared_prefix_rows_lower_to_the_flash_kernel_for_cuda_and_to_xla_for_tpu(monkeypatch):
    q, k, v, _ = _inputs()
    seg, pre = _prefix_rows()
    monkeypatch.setattr(sharding, "target_platform", lambda: None)
    fn = jax.jit(lambda q, k, v: ak.attention(q, k, v, seg, 0.1, prefix_segment=pre))
    assert set(cuda_grids(fn, q, k, v)) == {"flash_fwd_at_positions"}
    tpu = fn.trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" not in tpu  # splash has no prefix mask: the reference there
