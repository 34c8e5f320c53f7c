"""Mosaic GPU NSA kernels: they lower for CUDA, and in GPU interpret mode they match the reference.

What this does not show (no GPU here): PTX compilation, real-hardware layouts of the two
annotations that interpret mode drops (see coder/pallas/nsa/gpu.py), and speed.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import (
    InterpretGPUParams,  # not yet exported by plgpu
)
from test_nsa_reference import make_inputs, packed_segments

from coder.pallas.nsa import ops, reference, xla
from coder.pallas.nsa.reference import NSAConfig

CFG = NSAConfig(compress_block=32, compress_stride=16, select_block=64, select_topk=2, window=100)


def _setup(t=100, h=2, seed=0):
    x = make_inputs(1, t, h, 1, 64, 64, CFG, seed=seed)
    bf = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # kernel operands are bf16
    x = {n: bf(a) if n in ("q", "k", "v") else a for n, a in x.items()}
    seg = packed_segments(1, t, 2, 2, seed=seed)
    _, p = reference.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], seg, CFG, 0.125)
    sel = reference.select_blocks(reference.selection_scores(p, 1, CFG), seg, CFG)
    return x, seg, sel, xla.doc_starts(seg)


def _branches(kernel, sel, ds):
    slc = lambda q, k, v: ops.selected_attention(q, k, v, sel, ds, block=64, scale=0.125, kernel=kernel)
    win = lambda q, k, v: ops.window_attention(q, k, v, ds, window=CFG.window, scale=0.125, kernel=kernel)
    return slc, win


def test_kernels_lower_to_mosaic_gpu():
    x, _, sel, ds = _setup()
    for f in _branches(ops.Kernel(backend="pallas_gpu", window_tile=64), sel, ds):
        text = jax.jit(f).trace(x["q"], x["k"], x["v"]).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.slow
def test_kernels_match_reference_in_gpu_interpret_mode():
    x, seg, sel, ds = _setup()
    kernel = ops.Kernel(backend="pallas_gpu", interpret=InterpretGPUParams(), window_tile=64)
    slc, win = _branches(kernel, sel, ds)
    args = (x["q"], x["k"], x["v"])
    # bf16 probabilities before the PV matmul: ~3 significant digits
    np.testing.assert_allclose(slc(*args), reference.selected_attention(*args, sel, seg, 64, 0.125), atol=1e-2)
    np.testing.assert_allclose(win(*args), reference.window_attention(*args, seg, CFG.window, 0.125), atol=1e-2)
    # the GPU backward (XLA, see gpu.py) through the custom_vjp: gradients w.r.t. q, k, v
    w = jax.random.normal(jax.random.key(1), x["q"].shape)
    g_ker = jax.grad(lambda *a: jnp.sum(win(*a) * w), argnums=(0, 1, 2))(*args)
    g_ref = jax.grad(lambda *a: jnp.sum(reference.window_attention(*a, seg, CFG.window, 0.125) * w),
                     argnums=(0, 1, 2))(*args)
    for a, b in zip(g_ker, g_ref):
        np.testing.assert_allclose(a, b, atol=2e-2)
