"""Native Sparse Attention (Yuan et al., 2025), plain jnp: the definition the kernels are tested against.

Everything here builds dense `[T, T]` masks: simple to read, quadratic in memory, for tests only.

Shapes: q `[B,T,H,Dk]`, k `[B,T,G,Dk]`, v `[B,T,G,Dv]`, with G key/value groups dividing H; head h
reads group `h // (H // G)` (GQA; MLA's absorbed form is G = 1). Compressed keys/values
`[B,Nc,G,D]` with `Nc = ceil(T / d)`: compressed block i summarises tokens `[i*d, i*d + l)`.

The three branches (paper eq. 5), each masked by causality and by documents (`segment_ids`):
- compressed: attention over compressed blocks that lie wholly inside the query's document and
  end at or before the query;
- selected: attention over the tokens of the n selection blocks (length l') with the highest
  importance, where importance is the compressed attention probability summed over the heads of a
  group and mapped onto selection blocks by token overlap (eq. 9-10, with overlap weights instead
  of the paper's index arithmetic, so any l, d, l' work); the document's first block and the two
  local blocks (the query's block and the one before it) are always selected;
- sliding window: attention over the last w tokens (the query included).
Output: `o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win`, gates `[B,T,H,3]` in [0, 1].

Selections are passed around in a *canonical* form, `sel [B,T,G,n]` int32: block indices sorted
ascending, padded at the end by repeating the last (largest) index; entry i is active iff i == 0
or `sel[i] != sel[i-1]`. Sorting lets kernels reuse a block across consecutive grid steps;
padding by repetition keeps every index valid for DMA.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # finite "minus infinity": masked rows stay NaN-free in forward and backward


@dataclasses.dataclass(frozen=True)
class NSAConfig:
    compress_block: int = 32  # l
    compress_stride: int = 16  # d
    select_block: int = 64  # l'
    select_topk: int = 16  # n, including the initial and the two local blocks
    window: int = 512  # w

    @classmethod
    def from_config(cls, nsa_cfg) -> "NSAConfig":
        """From `model_cfg.nsa` (configs/base.py); fails on inconsistent sizes."""
        cfg = cls(**{f.name: int(nsa_cfg[f.name]) for f in dataclasses.fields(cls)})
        if cfg.compress_block < cfg.compress_stride:
            raise ValueError("nsa.compress_block must be >= nsa.compress_stride (blocks must tile the sequence)")
        if cfg.select_topk < 3:
            raise ValueError("nsa.select_topk must be >= 3 (initial block + 2 local blocks)")
        return cfg


def num_compressed(t: int, cfg: NSAConfig) -> int:
    return -(-t // cfg.compress_stride)


def num_select_blocks(t: int, cfg: NSAConfig) -> int:
    return -(-t // cfg.select_block)


def _expand_groups(x, num_heads):
    """[B,S,G,D] -> [B,S,H,D]: head h reads group h // (H // G)."""
    return jnp.repeat(x, num_heads // x.shape[2], axis=2)


def _masked_attention(q, k, v, mask, scale):
    """q [B,T,H,Dk], k [B,S,H,Dk], v [B,S,H,Dv], mask [B,T,H,S] -> (out [B,T,H,Dv], probs [B,T,H,S]).

    Rows with no visible key output 0 (softmax over an empty set), not NaN.
    """
    s = jnp.einsum("bthd,bshd->bths", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = jnp.where(mask, s, NEG_INF)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)) * mask
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("bths,bshd->bthd", p, v.astype(jnp.float32)), p


def _same_doc_causal(segment_ids):
    """[B,T] -> [B,T(query),S(key)]: key s is in the query's document and not in its future."""
    t = segment_ids.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


def dense_attention(q, k, v, segment_ids, scale):
    """Full causal attention inside documents -> [B,T,H,Dv] float32."""
    h = q.shape[2]
    mask = jnp.broadcast_to(_same_doc_causal(segment_ids)[:, :, None, :], q.shape[:3] + (k.shape[1],))
    return _masked_attention(q, _expand_groups(k, h), _expand_groups(v, h), mask, scale)[0]


def window_attention(q, k, v, segment_ids, window, scale):
    """Sliding window of `window` tokens (query included) inside documents -> [B,T,H,Dv]."""
    t = q.shape[1]
    near = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :]) < window
    mask = (_same_doc_causal(segment_ids) & near[None])[:, :, None, :]
    mask = jnp.broadcast_to(mask, q.shape[:3] + (t,))
    h = q.shape[2]
    return _masked_attention(q, _expand_groups(k, h), _expand_groups(v, h), mask, scale)[0]


def compressed_visibility(segment_ids, cfg: NSAConfig):
    """[B,T] -> [B,T,Nc] bool: compressed block i lies wholly in the query's document, ending <= t."""
    t = segment_ids.shape[1]
    starts = jnp.arange(num_compressed(t, cfg)) * cfg.compress_stride
    ends = starts + cfg.compress_block - 1
    in_range = ends < t
    seg_pad = jnp.pad(segment_ids, ((0, 0), (0, cfg.compress_block)), constant_values=-1)
    seg_start, seg_end = seg_pad[:, starts], seg_pad[:, ends]  # [B,Nc]
    qseg = segment_ids[:, :, None]
    return ((ends[None, None, :] <= jnp.arange(t)[None, :, None]) & in_range[None, None, :]
            & (seg_start[:, None, :] == qseg) & (seg_end[:, None, :] == qseg))


def compressed_attention(q, k_cmp, v_cmp, segment_ids, cfg: NSAConfig, scale):
    """-> (o_cmp [B,T,H,Dv], p_cmp [B,T,H,Nc]) where p_cmp are the attention probabilities."""
    h = q.shape[2]
    mask = jnp.broadcast_to(compressed_visibility(segment_ids, cfg)[:, :, None, :],
                            q.shape[:3] + (k_cmp.shape[1],))
    return _masked_attention(q, _expand_groups(k_cmp, h), _expand_groups(v_cmp, h), mask, scale)


def overlap_matrix(t: int, cfg: NSAConfig) -> np.ndarray:
    """[Nc, Ns] float32: fraction of compressed block i's tokens that fall in selection block j."""
    nc, ns = num_compressed(t, cfg), num_select_blocks(t, cfg)
    c0 = np.arange(nc)[:, None] * cfg.compress_stride
    s0 = np.arange(ns)[None, :] * cfg.select_block
    lo, hi = np.maximum(c0, s0), np.minimum(c0 + cfg.compress_block, s0 + cfg.select_block)
    return (np.maximum(hi - lo, 0) / cfg.compress_block).astype(np.float32)


def overlap_bands(t: int, cfg: NSAConfig):
    """overlap_matrix by columns, as (idx [Ns,K] int32, weight [Ns,K] float32): the K compressed
    blocks overlapping each selection block (weight 0 pads). The blockwise paths use this:
    a dense [Nc, Ns] product would cost T^3."""
    m = overlap_matrix(t, cfg)
    cols = [np.nonzero(m[:, j])[0] for j in range(m.shape[1])]
    k = max(1, max(len(c) for c in cols))
    idx = np.zeros((m.shape[1], k), np.int32)
    wt = np.zeros((m.shape[1], k), np.float32)
    for j, c in enumerate(cols):
        idx[j, :len(c)], wt[j, :len(c)] = c, m[c, j]
    return idx, wt


def banded_scores(p, idx, wt):
    """p [..., Nc] -> [..., Ns]: sum_k p[..., idx[s, k]] * wt[s, k] (columns >= Nc of idx weigh 0)."""
    nc = p.shape[-1]
    wt = jnp.where(jnp.asarray(idx) < nc, jnp.asarray(wt), 0.0)
    return jnp.sum(p[..., jnp.minimum(jnp.asarray(idx), nc - 1)] * wt, axis=-1)


def selection_scores(p_cmp, num_groups, cfg: NSAConfig):
    """p_cmp [B,T,H,Nc] -> importance [B,T,G,Ns]: summed over a group's heads, mapped by overlap."""
    b, t, h, nc = p_cmp.shape
    p_group = p_cmp.reshape(b, t, num_groups, h // num_groups, nc).sum(axis=3)
    return jnp.einsum("btgc,cs->btgs", p_group, jnp.asarray(overlap_matrix(t, cfg)))


def canonical_topk(scores, forced, candidate, current_block, n):
    """Top-n blocks in canonical form (sorted, padded by repeating the largest active index).

    scores [..., Ns] float, forced / candidate [..., Ns] bool, current_block [...] int: the query's
    own block, always forced and the largest candidate. -> [..., n] int32.
    """
    ns = scores.shape[-1]
    s = jnp.where(forced, jnp.inf, jnp.where(candidate, scores, -jnp.inf))
    val, idx = jax.lax.top_k(s, min(n, ns))
    big = jnp.int32(2**30)
    idx = jnp.where(val > -jnp.inf, idx.astype(jnp.int32), big)
    if n > ns:
        idx = jnp.concatenate([idx, jnp.full(idx.shape[:-1] + (n - ns,), big, jnp.int32)], axis=-1)
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx == big, current_block[..., None].astype(jnp.int32), idx)


def select_blocks(scores, segment_ids, cfg: NSAConfig):
    """importance [B,T,G,Ns] -> canonical selection [B,T,G,n] int32 (no gradient: a discrete choice)."""
    b, t = segment_ids.shape
    ns = num_select_blocks(t, cfg)
    tok = jnp.arange(ns * cfg.select_block)
    seg_pad = jnp.pad(segment_ids, ((0, 0), (0, ns * cfg.select_block - t)), constant_values=-1)
    visible = ((tok[None, None, :] <= jnp.arange(t)[None, :, None])
               & (seg_pad[:, None, :] == segment_ids[:, :, None]))  # [B,T,S]
    candidate = visible.reshape(b, t, ns, cfg.select_block).any(-1)  # [B,T,Ns]
    blk = jnp.arange(ns)[None, None, :]
    cur = (jnp.arange(t) // cfg.select_block)[None, :, None]
    first = jnp.argmax(candidate, axis=-1)[..., None]  # the document's initial block
    forced = candidate & ((blk == cur) | (blk == cur - 1) | (blk == first))
    cur_block = jnp.broadcast_to(cur[..., 0], (b, t))
    bcast = lambda x: jnp.broadcast_to(x[:, :, None, :], scores.shape)
    return canonical_topk(jax.lax.stop_gradient(scores), bcast(forced), bcast(candidate),
                          jnp.broadcast_to(cur_block[:, :, None], scores.shape[:3]), cfg.select_topk)


def selected_attention(q, k, v, sel, segment_ids, select_block, scale):
    """Attention over the tokens of the selected blocks -> [B,T,H,Dv]; sel [B,T,G,n] canonical."""
    t, h = q.shape[1], q.shape[2]
    ns = -(-t // select_block)
    chosen = jax.nn.one_hot(sel, ns, dtype=jnp.int32).sum(axis=-2) > 0  # [B,T,G,Ns]
    tok_chosen = jnp.repeat(chosen, select_block, axis=-1)[..., :t]  # [B,T,G,S]
    mask = _same_doc_causal(segment_ids)[:, :, None, :] & tok_chosen
    mask = _expand_groups(mask, h)
    return _masked_attention(q, _expand_groups(k, h), _expand_groups(v, h), mask, scale)[0]


def nsa(q, k, v, k_cmp, v_cmp, gates, segment_ids, cfg: NSAConfig, scale):
    """Full NSA output [B,T,H,Dv] float32 (paper eq. 5). gates [B,T,H,3] = (cmp, slc, win)."""
    o_cmp, p_cmp = compressed_attention(q, k_cmp, v_cmp, segment_ids, cfg, scale)
    sel = select_blocks(selection_scores(p_cmp, k.shape[2], cfg), segment_ids, cfg)
    o_slc = selected_attention(q, k, v, sel, segment_ids, cfg.select_block, scale)
    o_win = window_attention(q, k, v, segment_ids, cfg.window, scale)
    g = gates.astype(jnp.float32)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
