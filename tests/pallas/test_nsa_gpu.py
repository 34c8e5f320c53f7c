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
from tests.nsa_inputs import fast_compiles, make_inputs, normal, packed_segments  # noqa: F401

from coder.pallas.nsa import gpu, ops, reference, xla
from coder.pallas.nsa.reference import NSAConfig

CFG = NSAConfig(compress_block=32, compress_stride=16, select_block=64, select_topk=2, window=100)
SCALE = 0.125


def _inputs(t, h, g, docs, pad, seed=0, dk=64, dv=64):
    x = make_inputs(1, t, h, g, dk, dv, CFG, seed=seed)
    bf = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # kernel operands are bf16
    x = {n: bf(a) if n in ("q", "k", "v") else a for n, a in x.items()}
    seg = packed_segments(1, t, docs, pad, seed=seed)
    return x, seg, xla.doc_starts(seg)


@jax.jit
def _nsa_selection(x, seg):
    _, p = reference.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], seg, CFG, SCALE)
    return reference.select_blocks(reference.selection_scores(p, x["k"].shape[2], CFG), seg, CFG)


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
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(*args)


def _output_and_grads(f, args, w):
    """(f(*args), gradients of sum(f * w) w.r.t. every argument), as one jitted program."""
    def loss(*a):
        out = f(*a)
        return jnp.sum(out * w), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return out, grads


def _assert_close(got, want, rel=1e-2, err_msg=""):
    """bf16 operands (P, dS, dO rounded before the matmuls): ~3 significant digits of the largest entry."""
    np.testing.assert_allclose(got, want, atol=rel * float(jnp.max(jnp.abs(want))), err_msg=err_msg)


def _lowered(f, args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_kernels_lower_to_mosaic_gpu():
    """Each branch lowers to a Mosaic GPU kernel, and jax.grad of it to three (forward, dQ, dK/dV)
    with no XLA fallback."""
    x, seg, ds = _inputs(100, 4, 2, 2, 2)
    w = normal(x["q"].shape, 1)
    branches = _branches(ops.Kernel(backend="pallas_gpu"), _nsa_selection(x, seg), ds)
    for name, f in branches.items():
        assert "mosaic_gpu" in _lowered(f, (x["q"], x["k"], x["v"])), name
        text = _lowered(lambda *a, f=f: _grads(f, a, w), (x["q"], x["k"], x["v"]))
        assert text.count("stablehlo.custom_call @mosaic_gpu") == 3, name


@pytest.mark.slow
def test_layer_lowers_at_the_papers_sizes_with_the_default_kernel():
    """What a model would call: jax.grad of nsa_attention(impl=pallas_gpu), no Kernel given, at the
    paper's sizes (l=32, d=16, l'=64, n=16, w=512), one key group, T = 1000 not a multiple of any
    block: six Mosaic GPU kernels, for head width 128 and for MLA's absorbed widths (Dk = 576,
    Dv = 512) with 16 and with 128 heads sharing the group. Unsplit, the MLA widths need ~350 KiB of
    shared memory and Mosaic refuses them at lowering; the kernels split them (gpu.py, "Widths")."""
    cfg, t = NSAConfig(), 1000
    nc = reference.num_compressed(t, cfg)
    seg = jnp.ones((1, t), jnp.int32)
    layer = lambda *a: ops.nsa_attention(*a, seg, cfg=cfg, softmax_scale=SCALE, impl="pallas_gpu")
    grads = jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32)), argnums=tuple(range(6)))

    def lowered(h, dk, dv):
        shapes = [(1, t, h, dk), (1, t, 1, dk), (1, t, 1, dv), (1, nc, 1, dk), (1, nc, 1, dv), (1, t, h, 3)]
        return _lowered(grads, [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes])

    for h, dk, dv in [(16, 128, 128), (16, 576, 512), (128, 576, 512)]:
        assert lowered(h, dk, dv).count("stablehlo.custom_call @mosaic_gpu") == 6, (h, dk, dv)


def test_head_dims_split_only_when_wide():
    """(output slice, contraction chunk) per head dim: 128 stays whole (the kernels as before the
    split); at 64 rows (<= 64 heads, and the dK/dV kernels' key rows) Dk = 576 -> 3 x 192 and
    Dv = 512 -> 2 x 256, streamed in 64-wide chunks; 128 heads halve the slices (register budget)."""
    split = lambda width, rows: gpu._split(width, rows, gpu.HEAD_TILE)
    assert split(128, 64) == (128, 128) and split(64, 64) == (64, 64) and split(128, 128) == (128, 128)
    assert split(576, 64) == (192, 64) and split(512, 64) == (256, 64)
    assert split(576, 128) == (64, 64) and split(512, 128) == (128, 64)
    assert gpu._split(192, 64, 64) == (64, 64) and gpu._split(128, 64, 64) == (64, 64)  # the interpret test's


def test_unsupported_names_what_the_kernels_cannot_take():
    """What the model checks before it picks these kernels for GPU (MLA._nsa_gpu). By shape: other
    selection blocks than 64, widths that are not multiples of 64, more than 256 heads per group
    (their padded wgmma rows hold no 64-wide float32 tile in one warpgroup's registers). By
    lowering (shared memory): DeepSeek-V3's absorbed layer (128 heads, Dk = 576, Dv = 512) and
    tests/model/test_nsa_model.py's gpu_cfg lower; 128 heads at Dk = Dv = 128 (whole 128-wide tiles) and
    64 heads at Dk = Dv = 256 (kept whole, not split) overflow shared memory."""
    assert "selection blocks of 32" in ops.gpu_unsupported(16, 576, 512, 32, lower=False)
    assert "dk=20, dv=16" in ops.gpu_unsupported(4, 20, 16, 64, lower=False)
    assert "257 query heads per key group" in ops.gpu_unsupported(257, 576, 512, 64, lower=False)
    assert ops.gpu_unsupported(128, 576, 512, 64) is None and ops.gpu_unsupported(2, 128, 64, 64) is None
    for hg, width in [(128, 128), (64, 256)]:
        assert "exceeds available shared memory" in ops.gpu_unsupported(hg, width, width, 64), (hg, width)


def test_selection_csr_inverts_the_selection():
    sel = jnp.array([[[[0, 0], [0, 1], [1, 1], [0, 1]]]], jnp.int32)  # [B=1,G=1,T=4,n=2]
    offsets, tokens = (np.asarray(a)[0, 0] for a in gpu.selection_csr(sel, num_blocks=3))
    lists = [tokens[offsets[j]:offsets[j + 1]].tolist() for j in range(3)]
    assert lists == [[0, 1, 3], [1, 2, 3], []], "each token once per distinct block, ascending; block 2 empty"
    assert offsets[-1] == 6, "the repeated (inactive) slots sort past the last block"


def _segments(t, ends):
    """[1,T] segment ids: documents 1, 2, ... ending (exclusive) at `ends`, padding (0) after."""
    seg = np.zeros((1, t), np.int32)
    for d, (lo, hi) in enumerate(zip((0,) + tuple(ends), ends)):
        seg[0, lo:hi] = d + 1
    return jnp.asarray(seg)


def _interpret_inputs(t, h, g, seg, seed, dk=64, dv=64):
    x = make_inputs(1, t, h, g, dk, dv, CFG, seed=seed)
    x = {n: x[n].astype(jnp.bfloat16).astype(jnp.float32) for n in ("q", "k", "v")}  # kernel operands are bf16
    return x, xla.doc_starts(seg)


@pytest.mark.slow
def test_branches_match_reference_in_gpu_interpret_mode():
    """Both branches, forward and gradients w.r.t. q, k, v: T = 100 ragged (2 selection blocks and
    window tiles of 64, the last partial; the last query tile has fewer key tiles ahead), 3
    documents (the first reaching into block 1) and 2 padding tokens, GQA (2 groups of 2 heads).
    The groups select differently (the selected branch is the costly one in interpret mode: one
    CTA per token), and each selection repeats blocks (inactive slots):
    - group 0: random, the query's own block plus up to one earlier block of its document;
    - group 1: the document's first block and the query's own, so block 0's dK/dV sums the heads
      of every token of document 1 (88 tokens; those of block 0 select it twice, [0, 0], the second
      slot inactive). Dropping the share of the tokens of block 1, or doubling the share of the
      tokens of block 0, would move it by far more than the tolerance (checked below). Each
      output block has one writer (its CTA), so what can go wrong is the accumulation, not a race
      between CTAs."""
    t, h, g = 100, 4, 2
    seg = _segments(t, (88, 95, 98))
    x, ds = _interpret_inputs(t, h, g, seg, seed=3)
    rand = _random_selection(ds, 1, n=2, seed=3)
    own, first = jnp.arange(t, dtype=jnp.int32) // 64, ds // 64
    shared = jnp.stack([first, jnp.broadcast_to(own, first.shape)], -1)[:, :, None]  # [1,T,1,2]
    sel = jnp.concatenate([rand, shared], axis=2)
    assert not np.array_equal(sel[:, :, 0], sel[:, :, 1]), "groups must select differently"
    kernel = ops.Kernel(backend="pallas_gpu", interpret=InterpretGPUParams())
    args = (x["q"], x["k"], x["v"])
    w = normal(x["q"].shape, 1)
    refs = _references(sel, seg)
    for branch, f_ker in _branches(kernel, sel, ds).items():
        (o_ker, g_ker), (o_ref, g_ref) = _output_and_grads(f_ker, args, w), _output_and_grads(refs[branch], args, w)
        _assert_close(o_ker, o_ref, err_msg=f"{branch} output")
        for name, a, b in zip("qkv", g_ker, g_ref):
            _assert_close(a, b, err_msg=f"{branch} d{name}")
        if branch == "selected":  # the test can see a wrong share of group 1's block 0 in dK / dV
            late = _grads(refs[branch], args, w.at[:, :64].set(0.0))  # the share of the tokens of block 1
            for name, b, c in zip("kv", g_ref[1:], late[1:]):
                tol = 1e-2 * float(jnp.max(jnp.abs(b)))
                for share in (c[:, :64, 1], b[:, :64, 1] - c[:, :64, 1]):
                    assert float(jnp.max(jnp.abs(share))) > 10 * tol, f"d{name}: could not see a wrong share"


@pytest.mark.slow
def test_queries_at_a_traced_offset_match_the_reference_in_gpu_interpret_mode():
    """Sequence parallelism's kernel path on GPU (ops.nsa_local, what one device of the model's
    shard_map runs): the queries [72, 112) of a 128-token row, at a traced offset against the
    whole row's keys, equal the reference's rows 72-111, forward and the gradients w.r.t. their
    q and gates and the whole row's k, v and compressed k/v. The offset sits inside selection
    block 1 (the selected kernels read it from a one-element array; their dK/dV kernel writes
    both key blocks), the window (100) reaches past the row's start (the halo of dummy queries
    in front, zero keys before position 0), 3 documents and a padding token cross the piece."""
    t, h, g, lo, n = 128, 2, 1, 72, 40
    seg = _segments(t, (50, 90, 127))
    x = make_inputs(1, t, h, g, 64, 64, CFG, seed=9)
    x = {k_: a.astype(jnp.bfloat16).astype(jnp.float32) if k_ in ("q", "k", "v") else a for k_, a in x.items()}
    kernel = ops.Kernel(backend="pallas_gpu", interpret=InterpretGPUParams())
    local = jax.jit(lambda q, k, v, kc, vc, gates, offset: ops.nsa_local(
        q, k, v, kc, vc, gates, seg, offset, cfg=CFG, softmax_scale=SCALE, kernel=kernel))
    w = normal((1, n, h, 64), 9)
    names = ("q", "k", "v", "k_cmp", "v_cmp", "gates")
    piece = lambda *a: local(a[0][:, lo:lo + n], *a[1:5], a[5][:, lo:lo + n], jnp.int32(lo))
    rows = lambda *a: reference.nsa(*a, seg, CFG, SCALE)[:, lo:lo + n]
    (o_ker, g_ker), (o_ref, g_ref) = (_output_and_grads(piece, [x[k_] for k_ in names], w),
                                      _output_and_grads(rows, [x[k_] for k_ in names], w))
    _assert_close(o_ker, o_ref, err_msg="output")
    for name, a, b in zip(names, g_ker, g_ref):
        _assert_close(a, b, err_msg=f"d{name}")


@pytest.mark.slow
def test_full_layer_batch2_short_mla_layout_matches_reference():
    """nsa_attention(impl=pallas_gpu) == reference, forward and gradients w.r.t. q, k, v, the compressed
    keys/values and the gates: 2 rows, each with its own 2 documents and a padding token (the kernels
    index rows by batch), T = 40 shorter than one selection block and one window tile (both padded),
    MLA's absorbed layout (one key group for 2 heads, padded to 64 wgmma rows; Dk = 128 != Dv = 64)."""
    b, t, h, g, dk, dv = 2, 40, 2, 1, 128, 64
    x = make_inputs(b, t, h, g, dk, dv, CFG, seed=6)
    bf = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
    x = {n: bf(a) if n in ("q", "k", "v") else a for n, a in x.items()}
    seg = packed_segments(b, t, 2, 1, seed=6)
    assert not np.array_equal(xla.doc_starts(seg)[0], xla.doc_starts(seg)[1]), "rows must differ in layout"
    kernel = ops.Kernel(backend="pallas_gpu", interpret=InterpretGPUParams())
    run = lambda impl, kern=None: lambda *a: ops.nsa_attention(*a, seg, cfg=CFG, softmax_scale=SCALE, impl=impl,
                                                                kernel=kern)
    names = ("q", "k", "v", "k_cmp", "v_cmp", "gates")
    args, w = [x[n] for n in names], normal((b, t, h, dv), 6)
    (o_ker, g_ker), (o_ref, g_ref) = (_output_and_grads(run("pallas_gpu", kernel), args, w),
                                      _output_and_grads(run("reference"), args, w))
    _assert_close(o_ker, o_ref, err_msg="output")
    for name, a, c in zip(names, g_ker, g_ref):
        _assert_close(a, c, err_msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("branch,t,dk,dv,head_tile", [("selected", 20, 192, 128, 64), ("window", 130, 192, 128, 64),
                                                      ("window", 40, 576, 512, None)])
def test_wide_heads_match_reference_in_gpu_interpret_mode(branch, t, dk, dv, head_tile):
    """The head-width split (gpu.py, "Widths") in interpret mode, forward and gradients w.r.t. q, k, v,
    in MLA's layout (one key group for 2 heads, Dk != Dv), ragged T, 2 documents and a padding token.
    - MLA's widths (Dk = 576, Dv = 512) as the model gets them (default head_tile): Dk in 9 chunks
      and 3 dQ / dK slices, Dv in 8 chunks and 2 output / dV slices; window branch only, one
      tile (the selected branch costs a CTA per token and slice: ~200 s in interpret mode at
      these widths; several key tiles per window are the 192 / 128 case's).
    - Widths scaled down with head_tile = 64 forcing the same kind of split: Dk = 192 in 3 chunks
      and 3 dQ / dK slices, Dv = 128 in 2 chunks and 2 output / dV slices, so the forward has 2
      CTAs per query tile, dQ 3, and dK/dV 5 per key tile (3 dK + 2 dV programs). The selected
      branch gets one block, selected once (n = 1); the window branch three key tiles, up to 2 in
      each window."""
    h, g = 2, 1
    x, seg, ds = _inputs(t, h, g, docs=2, pad=1, seed=7, dk=dk, dv=dv)
    sel = _random_selection(ds, g, n=1, seed=7)
    kernel = ops.Kernel(backend="pallas_gpu", interpret=InterpretGPUParams(), head_tile=head_tile)
    f_ker, f_ref = _branches(kernel, sel, ds)[branch], _references(sel, seg)[branch]
    args = (x["q"], x["k"], x["v"])
    w = normal((1, t, h, dv), 7)
    (o_ker, g_ker), (o_ref, g_ref) = _output_and_grads(f_ker, args, w), _output_and_grads(f_ref, args, w)
    _assert_close(o_ker, o_ref, err_msg="output")
    for name, a, b in zip("qkv", g_ker, g_ref):
        _assert_close(a, b, err_msg=f"d{name}")
