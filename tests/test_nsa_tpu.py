"""Mosaic TPU NSA kernels in TPU interpret mode (simulated VMEM, DMAs, scalar prefetch) vs the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import (
    interpret_pallas_call as tpu_interpret,  # race state
)
from jax.experimental.pallas import tpu as pltpu
from test_nsa_reference import make_inputs, packed_segments

from coder.pallas.nsa import ops, reference, tpu, xla
from coder.pallas.nsa.reference import NSAConfig

CFG = NSAConfig(compress_block=4, compress_stride=2, select_block=8, select_topk=3, window=11)
KERNEL = ops.Kernel(backend="pallas_tpu", interpret=pltpu.InterpretParams(), token_tile=8, window_tile=8,
                    max_tokens=16)  # several kernel calls per row: exercises token_offset


def _selection(x, seg, g):
    _, p = reference.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], seg, CFG, 0.3)
    return reference.select_blocks(reference.selection_scores(p, g, CFG), seg, CFG)


def _check(f_ref, f_kernel, args, w):
    """Forward and gradients w.r.t. every argument agree."""
    def run(f):
        def loss(*a):
            out = f(*a)
            return jnp.sum(out * w), out
        return jax.value_and_grad(loss, argnums=range(len(args)), has_aux=True)(*args)

    (_, o_ref), g_ref = run(f_ref)
    (_, o_ker), g_ker = run(f_kernel)
    np.testing.assert_allclose(o_ker, o_ref, atol=2e-5)
    for i, (a, b) in enumerate(zip(g_ref, g_ker)):
        np.testing.assert_allclose(b, a, atol=5e-5, err_msg=f"grad of argument {i}")


@pytest.mark.parametrize("b,t,h,g,dk,dv,docs,pad", [
    pytest.param(1, 19, 4, 2, 16, 16, 2, 2, id="gqa-ragged-2docs-pad"),
    pytest.param(1, 12, 4, 1, 24, 16, 2, 0, id="mqa-mla-layout"),
])
def test_selected_branch(b, t, h, g, dk, dv, docs, pad):
    x = make_inputs(b, t, h, g, dk, dv, CFG, seed=t)
    seg = packed_segments(b, t, docs, pad, seed=t)
    sel, ds = _selection(x, seg, g), xla.doc_starts(seg)
    w = jax.random.normal(jax.random.key(3), (b, t, h, dv))
    f_ref = lambda q, k, v: reference.selected_attention(q, k, v, sel, seg, CFG.select_block, 0.3)
    f_ker = lambda q, k, v: ops.selected_attention(q, k, v, sel, ds, block=CFG.select_block, scale=0.3,
                                                   kernel=KERNEL)
    _check(f_ref, f_ker, (x["q"], x["k"], x["v"]), w)


@pytest.mark.parametrize("b,t,h,g,dk,dv,docs,pad", [
    pytest.param(1, 21, 4, 2, 16, 16, 3, 3, id="gqa-ragged-3docs-pad"),
    pytest.param(1, 13, 2, 1, 24, 16, 1, 0, id="mqa-short"),
])
def test_window_branch(b, t, h, g, dk, dv, docs, pad):
    x = make_inputs(b, t, h, g, dk, dv, CFG, seed=t)
    seg = packed_segments(b, t, docs, pad, seed=t)
    ds = xla.doc_starts(seg)
    w = jax.random.normal(jax.random.key(4), (b, t, h, dv))
    f_ref = lambda q, k, v: reference.window_attention(q, k, v, seg, CFG.window, 0.3)
    f_ker = lambda q, k, v: ops.window_attention(q, k, v, ds, window=CFG.window, scale=0.3, kernel=KERNEL)
    _check(f_ref, f_ker, (x["q"], x["k"], x["v"]), w)


@pytest.mark.slow
def test_full_layer_with_race_detection():
    """nsa_attention(impl=pallas_tpu) == reference, gradients w.r.t. q, k, v, compressed k/v and gates,
    with the interpreter's race detector on."""
    b, t, h, g, d = 1, 13, 2, 1, 16
    x = make_inputs(b, t, h, g, d, d, CFG, seed=5)
    seg = packed_segments(b, t, 2, 1, seed=5)
    w = jax.random.normal(jax.random.key(5), (b, t, h, d))
    kernel = ops.Kernel(interpret=pltpu.InterpretParams(detect_races=True), token_tile=8, window_tile=8)
    names = ("q", "k", "v", "k_cmp", "v_cmp", "gates")
    run = lambda impl, kern=None: lambda *a: ops.nsa_attention(*a, seg, cfg=CFG, softmax_scale=0.3, impl=impl,
                                                                kernel=kern)
    _check(run("reference"), run("pallas_tpu", kernel), [x[n] for n in names], w)
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found


def test_selection_pairs_invert_the_selection():
    sel = jnp.array([[[[0, 0], [0, 1], [1, 1], [0, 1]]]], jnp.int32)  # [B=1,G=1,T=4,n=2]
    blk, tok, on = (np.asarray(a)[0, 0] for a in tpu.selection_pairs(sel, num_blocks=3))
    assert np.all(np.diff(blk) >= 0), "sorted by block, so each output block is one run of grid steps"
    assert set(blk.tolist()) == {0, 1, 2}, "every block visited, even the unselected one"
    active = sorted((int(bk), int(tk)) for bk, tk, o in zip(blk, tok, on) if o)
    assert active == [(0, 0), (0, 1), (0, 3), (1, 1), (1, 2), (1, 3)]
