"""Mosaic TPU NSA kernels in TPU interpret mode (simulated VMEM, DMAs, scalar prefetch) vs the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import (
    interpret_pallas_call as tpu_interpret,  # race state
)
from jax.experimental.pallas import tpu as pltpu
from tests.nsa_inputs import fast_compiles, make_inputs, normal, packed_segments  # noqa: F401

from coder.pallas.nsa import ops, reference, tpu, xla
from coder.pallas.nsa.reference import NSAConfig

# Small blocks and tiles (interpret mode takes any; Mosaic's block-shape rules are checked by
# test_kernels_lower_to_mosaic_tpu at the paper's sizes): a few tokens already span several
# selection blocks, window tiles and kernel calls, and the interpreter's cost is per grid step.
CFG = NSAConfig(compress_block=4, compress_stride=2, select_block=4, select_topk=3, window=7)
KERNEL = ops.Kernel(backend="pallas_tpu", interpret=pltpu.InterpretParams(), token_tile=4, window_tile=4,
                    max_tokens=8)  # several kernel calls per row: exercises token_offset


@jax.jit
def _selection(x, seg):
    g = x["k"].shape[2]
    _, p = reference.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], seg, CFG, 0.3)
    return reference.select_blocks(reference.selection_scores(p, g, CFG), seg, CFG)


def _check(f_ref, f_kernel, args, w):
    """Forward and gradients w.r.t. every argument agree."""
    def run(f):
        def loss(*a):
            out = f(*a)
            return jnp.sum(out * w), out
        return jax.jit(jax.value_and_grad(loss, argnums=range(len(args)), has_aux=True))(*args)

    (_, o_ref), g_ref = run(f_ref)
    (_, o_ker), g_ker = run(f_kernel)
    np.testing.assert_allclose(o_ker, o_ref, atol=2e-5)
    for i, (a, b) in enumerate(zip(g_ref, g_ker)):
        np.testing.assert_allclose(b, a, atol=5e-5, err_msg=f"grad of argument {i}")


CASES = [  # b, t, h, g, dk, dv, docs, pad
    # 2 rows of different layouts, 3 documents and 2 padding tokens each; T = 11 ragged: 3 selection
    # blocks (2 kernel calls of 8 and 4 tokens) and 3 window tiles, the window (7) reaching 2 tiles
    # back; GQA with Hg = 3 != G = 2; MLA's Dk != Dv
    pytest.param(2, 11, 6, 2, 24, 16, 3, 2, id="gqa-mla-widths-ragged-3docs-pad-batch2", marks=pytest.mark.slow),
    # T = 3: shorter than a selection block and a window tile; MQA; 2 rows of different layouts
    pytest.param(2, 3, 2, 1, 16, 8, 2, 0, id="mqa-batch2-shorter-than-a-block"),
]


def _case(b, t, h, g, dk, dv, docs, pad, seed):
    x = make_inputs(b, t, h, g, dk, dv, CFG, seed=t)
    seg = packed_segments(b, t, docs, pad, seed=t)
    assert b == 1 or not np.array_equal(seg[0], seg[1]), "rows must differ for batch indexing to show"
    return x, seg, xla.doc_starts(seg), normal((b, t, h, dv), seed)


@pytest.mark.parametrize("b,t,h,g,dk,dv,docs,pad", CASES)
def test_selected_branch(b, t, h, g, dk, dv, docs, pad):
    x, seg, ds, w = _case(b, t, h, g, dk, dv, docs, pad, seed=3)
    sel = _selection(x, seg)
    f_ref = lambda q, k, v: reference.selected_attention(q, k, v, sel, seg, CFG.select_block, 0.3)
    f_ker = lambda q, k, v: ops.selected_attention(q, k, v, sel, ds, block=CFG.select_block, scale=0.3,
                                                   kernel=KERNEL)
    _check(f_ref, f_ker, (x["q"], x["k"], x["v"]), w)


@pytest.mark.parametrize("b,t,h,g,dk,dv,docs,pad", CASES)
def test_window_branch(b, t, h, g, dk, dv, docs, pad):
    x, seg, ds, w = _case(b, t, h, g, dk, dv, docs, pad, seed=4)
    f_ref = lambda q, k, v: reference.window_attention(q, k, v, seg, CFG.window, 0.3)
    f_ker = lambda q, k, v: ops.window_attention(q, k, v, ds, window=CFG.window, scale=0.3, kernel=KERNEL)
    _check(f_ref, f_ker, (x["q"], x["k"], x["v"]), w)


@pytest.mark.slow
def test_full_layer_with_race_detection():
    """nsa_attention(impl=pallas_tpu) == reference, gradients w.r.t. q, k, v, compressed k/v and gates,
    with the interpreter's race detector on."""
    b, t, h, g, d = 1, 7, 2, 1, 16  # 2 selection blocks and window tiles, the second partial
    x = make_inputs(b, t, h, g, d, d, CFG, seed=5)
    seg = packed_segments(b, t, 2, 1, seed=5)
    w = normal((b, t, h, d), 5)
    kernel = ops.Kernel(interpret=pltpu.InterpretParams(detect_races=True), token_tile=4, window_tile=4)
    names = ("q", "k", "v", "k_cmp", "v_cmp", "gates")
    run = lambda impl, kern=None: lambda *a: ops.nsa_attention(*a, seg, cfg=CFG, softmax_scale=0.3, impl=impl,
                                                                kernel=kern)
    _check(run("reference"), run("pallas_tpu", kernel), [x[n] for n in names], w)
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found


@pytest.mark.slow
def test_queries_at_a_traced_offset_equal_the_whole_row():
    """Sequence parallelism's kernel path (ops.nsa_local, what one device of the model's
    shard_map runs): a row of 15 queries in 3 pieces of 5, each at its offset against the whole
    row's keys, put together equal the reference over the whole row, forward and gradients
    w.r.t. q, k, v, the compressed keys/values and the gates. One jitted program serves the
    three pieces (the offset is traced, as `axis_index` is in a shard_map); the pieces cut
    selection blocks and window tiles (offsets 5 and 10, blocks of 4), the window (7) reaches
    into the piece before (the halo) and, for the first piece, past the row's start; 5 queries
    pad to 8 (two token tiles)."""
    b, t, h, g, dk, dv, piece = 2, 15, 4, 1, 16, 8, 5
    x = make_inputs(b, t, h, g, dk, dv, CFG, seed=8)
    seg = packed_segments(b, t, 3, 2, seed=8)
    w = normal((b, t, h, dv), 8)
    local = jax.jit(lambda q, k, v, kc, vc, gates, offset: ops.nsa_local(
        q, k, v, kc, vc, gates, seg, offset, cfg=CFG, softmax_scale=0.3, kernel=KERNEL))

    def pieces(q, k, v, kc, vc, gates):
        return jnp.concatenate([local(q[:, i:i + piece], k, v, kc, vc, gates[:, i:i + piece], jnp.int32(i))
                                for i in range(0, t, piece)], axis=1)

    whole = lambda *a: ops.nsa_attention(*a, seg, cfg=CFG, softmax_scale=0.3, impl="reference")
    _check(whole, pieces, [x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp", "gates")], w)


@pytest.mark.parametrize("h,g,dk,dv,dtype", [
    pytest.param(16, 1, 576, 512, jnp.bfloat16, id="mla-absorbed"),
    pytest.param(8, 2, 128, 128, jnp.float32, id="gqa"),
])
def test_kernels_lower_to_mosaic_tpu(h, g, dk, dv, dtype):
    """jax.grad of nsa_attention(impl=pallas_tpu) at the paper's sizes lowers for TPU (from this CPU, via an
    abstract TPU device) to six Mosaic kernels (selected and window: forward, dQ, dK/dV). Lowering applies
    Mosaic's block-shape rules, which interpret mode does not (a window tile of 100 fails here)."""
    cfg = NSAConfig()
    t = 1000  # ragged: not a multiple of l' = 64 or of the 128-token window tile
    nc = reference.num_compressed(t, cfg)
    shapes = [(1, t, h, dk), (1, t, g, dk), (1, t, g, dv), (1, nc, g, dk), (1, nc, g, dv), (1, t, h, 3)]
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    seg = jnp.ones((1, t), jnp.int32)
    tpu_mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="TPU v5p", num_cores=1, platform="tpu"))

    def grads(kernel):
        f = lambda *a: ops.nsa_attention(*a, seg, cfg=cfg, softmax_scale=0.1, impl="pallas_tpu", kernel=kernel)
        return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=range(6))

    def lowered(kernel):
        with jax.sharding.use_abstract_mesh(tpu_mesh):
            return jax.jit(grads(kernel)).trace(*args).lower(lowering_platforms=("tpu",)).as_text()

    assert lowered(ops.Kernel()).count("stablehlo.custom_call @tpu_custom_call") == 6
    with pytest.raises(ValueError, match="divisible by 8"):
        lowered(ops.Kernel(window_tile=100))


def test_selection_pairs_invert_the_selection():
    sel = jnp.array([[[[0, 0], [0, 1], [1, 1], [0, 1]]]], jnp.int32)  # [B=1,G=1,T=4,n=2]
    blk, tok, on = (np.asarray(a)[0, 0] for a in tpu.selection_pairs(sel, num_blocks=3))
    assert np.all(np.diff(blk) >= 0), "sorted by block, so each output block is one run of grid steps"
    assert set(blk.tolist()) == {0, 1, 2}, "every block visited, even the unselected one"
    active = sorted((int(bk), int(tk)) for bk, tk, o in zip(blk, tok, on) if o)
    assert active == [(0, 0), (0, 1), (0, 3), (1, 1), (1, 2), (1, 3)]
    packed = np.asarray(tpu.pack_pairs(*tpu.selection_pairs(sel, num_blocks=3)))[0, 0]  # the kernel's operand
    assert [(p >> 17, (p >> 1) & 0xFFFF, p & 1) for p in packed.tolist()] == list(zip(blk, tok, on))


def test_dkv_kernel_refuses_calls_its_packed_pairs_cannot_hold():
    """A pair's token takes 16 bits of the packed int32: a call of 2**16 tokens names the knob."""
    t = 1 << 16
    q, k = jnp.zeros((1, 1, t, 1, 8)), jnp.zeros((1, 1, t, 8))
    sel, ds, lse = jnp.zeros((1, 1, t, 1), jnp.int32), jnp.zeros((1, t), jnp.int32), jnp.zeros((1, 1, t, 1, 1))
    with pytest.raises(ValueError, match="Kernel.max_tokens"):
        tpu.selected_dkv(q, k, k, sel, ds, q, lse, lse, block=64, scale=1.0)
