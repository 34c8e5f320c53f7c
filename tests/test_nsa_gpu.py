"""Mosaic GPU NSA kernels: they lower for CUDA, and in GPU interpret mode they match the reference.

Forward and backward are kernels (coder/pallas/nsa/gpu.py). What this does not show (no GPU here):
PTX compilation, real-hardware layouts of the two annotations that interpret mode drops (see
gpu.py), and speed.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import (
    InterpretGPUParams,  # not yet exported by plgpu
)
from test_nsa_reference import make_inputs, packed_segments

from coder.pallas.nsa import gpu, ops, reference, xla
from coder.pallas.nsa.reference import NSAConfig

CFG = NSAConfig(compress_block=32, compress_stride=16, select_block=64, select_topk=2, window=100)
SCALE = 0.125


def _inputs(t, h, g, docs, pad, seed=0):
    x = make_inputs(1, t, h, g, 64, 64, CFG, seed=seed)
    bf = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # kernel operands are bf16
    x = {n: bf(a) if n in ("q", "k", "v") else a for n, a in x.items()}
    seg = packed_segments(1, t, docs, pad, seed=seed)
    return x, seg, xla.doc_starts(seg)


def _nsa_selection(x, seg, g):
    _, p = reference.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], seg, CFG, SCALE)
    return reference.select_blocks(reference.selection_scores(p, g, CFG), seg, CFG)


def _random_selection(ds, g, n, seed):
    """Random canonical selections [B,T,G,n], different per group: the query's own block plus up to
    n-1 random blocks of its document before it, sorted, padded by repeating the last block."""
    rng = np.random.default_rng(seed)
    ds = np.asarray(ds)
    out = np.zeros(ds.shape + (g, n), np.int32)
    for b, t in np.ndindex(ds.shape):
        cur, first = t // 64, ds[b, t] // 64
        for gi in range(g):
            k = rng.integers(0, min(n - 1, cur - first) + 1)
            blocks = sorted(rng.choice(np.arange(first, cur), k, replace=False).tolist()) + [cur]
            out[b, t, gi] = blocks + [cur] * (n - len(blocks))
    return jnp.asarray(out)


def _branches(kernel, sel, ds):
    slc = lambda q, k, v: ops.selected_attention(q, k, v, sel, ds, block=64, scale=SCALE, kernel=kernel)
    win = lambda q, k, v: ops.window_attention(q, k, v, ds, window=CFG.window, scale=SCALE, kernel=kernel)
    return {"selected": slc, "window": win}


def _references(sel, seg):
    return {"selected": lambda q, k, v: reference.selected_attention(q, k, v, sel, seg, 64, SCALE),
            "window": lambda q, k, v: reference.window_attention(q, k, v, seg, CFG.window, SCALE)}


def _grads(f, args, w):
    return jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(*args)


def _output_and_grads(f, args, w):
    def loss(*a):
        out = f(*a)
        return jnp.sum(out * w), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*args)
    return out, grads


def _assert_close(got, want, rel=1e-2, err_msg=""):
    """bf16 operands (P, dS, dO rounded before the matmuls): ~3 significant digits of the largest entry."""
    np.testing.assert_allclose(got, want, atol=rel * float(jnp.max(jnp.abs(want))), err_msg=err_msg)


def _lowered(f, args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_kernels_lower_to_mosaic_gpu():
    x, seg, ds = _inputs(100, 2, 1, 2, 2)
    for f in _branches(ops.Kernel(backend="pallas_gpu", window_tile=64), _nsa_selection(x, seg, 1), ds).values():
        assert "mosaic_gpu" in _lowered(f, (x["q"], x["k"], x["v"]))


def test_backward_kernels_lower_to_mosaic_gpu():
    """jax.grad of each branch is three Mosaic GPU kernels (forward, dQ, dK/dV) and no XLA fallback."""
    x, seg, ds = _inputs(100, 4, 2, 2, 2)
    w = jax.random.normal(jax.random.key(1), x["q"].shape)
    branches = _branches(ops.Kernel(backend="pallas_gpu", window_tile=64), _nsa_selection(x, seg, 2), ds)
    for name, f in branches.items():
        text = _lowered(lambda *a, f=f: _grads(f, a, w), (x["q"], x["k"], x["v"]))
        assert text.count("stablehlo.custom_call @mosaic_gpu") == 3, name


def test_selection_csr_inverts_the_selection():
    sel = jnp.array([[[[0, 0], [0, 1], [1, 1], [0, 1]]]], jnp.int32)  # [B=1,G=1,T=4,n=2]
    offsets, tokens = (np.asarray(a)[0, 0] for a in gpu.selection_csr(sel, num_blocks=3))
    lists = [tokens[offsets[j]:offsets[j + 1]].tolist() for j in range(3)]
    assert lists == [[0, 1, 3], [1, 2, 3], []], "each token once per distinct block, ascending; block 2 empty"
    assert offsets[-1] == 6, "the repeated (inactive) slots sort past the last block"


@pytest.mark.slow
@pytest.mark.parametrize("branch,t", [("selected", 100), ("window", 200)])
def test_branch_matches_reference_in_gpu_interpret_mode(branch, t):
    """Forward and gradients w.r.t. q, k, v: ragged lengths (2 and 4 tiles of 64, the last partial;
    the window (100) then reaches two key tiles back and the last query tiles have fewer key tiles
    ahead), 3 documents and 2 padding tokens, GQA (2 groups of 2 heads), selections that differ per
    group and repeat blocks (the selected branch is the costly one in interpret mode: one CTA per token)."""
    h, g = 4, 2
    x, seg, ds = _inputs(t, h, g, docs=3, pad=2, seed=3)
    sel = _random_selection(ds, g, n=2, seed=3)
    kernel = ops.Kernel(backend="pallas_gpu", interpret=InterpretGPUParams(), window_tile=64)
    f_ker, f_ref = _branches(kernel, sel, ds)[branch], _references(sel, seg)[branch]
    args = (x["q"], x["k"], x["v"])
    w = jax.random.normal(jax.random.key(1), x["q"].shape)
    (o_ker, g_ker), (o_ref, g_ref) = _output_and_grads(f_ker, args, w), _output_and_grads(f_ref, args, w)
    _assert_close(o_ker, o_ref, err_msg="output")
    for name, a, b in zip("qkv", g_ker, g_ref):
        _assert_close(a, b, err_msg=f"d{name}")


@pytest.mark.slow
def test_selected_dkv_sums_every_token_of_a_shared_block():
    """Every token selects block 0 and its own block, so block 0's dK/dV sums the heads of all 128
    tokens; the tokens of block 0 select it twice ([0, 0], the second slot inactive). Dropping the
    share of the tokens of block 1, or doubling the share of the tokens of block 0, would move it by
    far more than the tolerance (checked below). Each output block has one writer (its CTA), so what
    can go wrong is the accumulation, not a race between CTAs."""
    t, h, g = 128, 2, 1
    x, seg, ds = _inputs(t, h, g, docs=1, pad=0, seed=4)
    cur = jnp.arange(t, dtype=jnp.int32) // 64
    sel = jnp.stack([jnp.zeros_like(cur), cur], -1)[None, :, None, :]  # [1,T,1,2]: [0,0] or [0,1]
    kernel = ops.Kernel(backend="pallas_gpu", interpret=InterpretGPUParams(), window_tile=64)
    f_ker, f_ref = _branches(kernel, sel, ds)["selected"], _references(sel, seg)["selected"]
    args = (x["q"], x["k"], x["v"])
    w = jax.random.normal(jax.random.key(2), x["q"].shape)
    g_ker, g_ref = _grads(f_ker, args, w), _grads(f_ref, args, w)
    late = _grads(f_ref, args, w.at[:, :64].set(0.0))  # the share of the tokens of block 1
    for name, a, b, c in zip("qkv", g_ker, g_ref, late):
        _assert_close(a, b, err_msg=f"d{name}")
        if name != "q":
            tol = 1e-2 * float(jnp.max(jnp.abs(b)))
            for share in (c[:, :64], b[:, :64] - c[:, :64]):
                assert float(jnp.max(jnp.abs(share))) > 10 * tol, "the test could not see a wrong share"
