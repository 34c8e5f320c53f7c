"""The dense backend's softmax attention: one function, three lowerings.

    o = attention(q, k, v, segment_ids, scale)
    q [B,T,H,dq], k [B,T,H,dq], v [B,T,H,dv] (MLA: dq = dn + dr = 192, dv = 128 for DeepSeek-V3),
    segment_ids [B,T] int32 -> o [B,T,H,dv] in q's dtype.

A query attends to the keys of its own segment at or before its index (causal self-attention of
packed documents). The lowering is the one of the platform the program is for
(`sharding.platform_dependent`, as for the NSA kernels and the MoE grouped matmul): the mesh's
devices decide while tracing where they are CPUs or TPUs (stage `compile` gets the TPU kernel
from a CPU host), and `jax.lax.platform_dependent` where the program is lowered on GPUs:

  * TPU: splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`): blockwise
    online softmax that never materialises the T x T scores and skips the blocks the causal
    mask removes; segment ids in the kernel; MLA's value width differs from the query's, which
    the kernel supports (`head_dim_v`). Under a mesh (coder.model.sharding.activate) it runs in
    a `shard_map`: heads over the `heads` mesh axes, queries over the `seq` axes (the kernel's
    mask information is split the same way, `make_splash_mha(head_shards, q_seq_shards)`),
    keys and values whole per device (XLA gathers them over the `seq` axes). Split queries are
    exchanged into zigzag order for the kernel (`zigzag_positions`), so every query shard does
    the same causal work, and back.
  * GPU: the Pallas (Triton) flash kernel of coder.pallas.flash_gpu, which masks by query
    position and segment ids and takes MLA's narrower values (the one JAX ships needs one width
    for q, k and v and masks by array index). Under a mesh it runs in a `shard_map` split as on
    TPU: heads over the `heads` axes, queries over the `seq` axes in zigzag order (each device's
    kernel call gets its queries' positions), keys and values whole per device (gathered by
    XLA), so sequence-parallel GPU meshes split the attention work as TPU meshes do.
  * Anything else (CPU): `reference_attention`, plain XLA with the `[B, H, T, T]` scores.

All three are equal up to float rounding (tests/model/test_attention_kernels.py, interpret mode).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coder.model import context_parallel, sharding
from coder.model.context_parallel import to_zigzag, zigzag_positions

# checkpoint name of the splash kernel's output and log-sum-exp (the residuals its backward
# needs): model.remat="save_attention" keeps them, so remat never reruns the forward kernel
RESIDUALS = "attention_residuals"
NEG_INF = -1e30  # finite, so fully masked rows (padding only) give no NaN
BLOCKS = (512, 256, 128)  # kernel block lengths tried, largest first (TPU tiles are 128 x 128)


def attention_mask(segment_ids, prefix_segment=None):
    """`[B, 1, T, T]` bool: query t sees key s iff s <= t (row order) and s is in t's segment or
    in t's shared prefix.

    segment_ids `[B,T]` int32 (0 = padding); prefix_segment `[B,T]` int32 or None: the segment
    whose keys a token also sees (0 = none). Shared-prefix packing (coder.rl.trajectory,
    grpo.shared_prefix) lays out one row as a prompt (segment p, prefix 0) followed by
    continuations (segments c1, c2, ..., prefix p) whose positions continue from the prompt's:
    each continuation attends to the prompt and to itself, never to another continuation, so
    every continuation token computes what it would in a row of its own (prompt + continuation).
    """
    t = segment_ids.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    visible = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_segment is not None:
        pre = prefix_segment[:, :, None]
        visible = visible | ((pre > 0) & (pre == segment_ids[:, None, :]))
    return (causal[None] & visible)[:, None]


def reference_attention(q, k, v, segment_ids, scale: float, prefix_segment=None):
    """Causal, segment-masked softmax attention in XLA (`attention_mask`). Shapes in the module
    docstring; prefix_segment `[B,T]` or None as in `attention_mask`.

    The scores `[B, H, T, T]` are float32 (the kernels accumulate in float32 too).
    """
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
    mask = attention_mask(segment_ids, prefix_segment)  # [B,1,T,S]
    probs = jax.nn.softmax(jnp.where(mask, scores * scale, NEG_INF), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v)


def block_len(*lengths: int) -> int:
    """The largest of BLOCKS dividing every length; ValueError if none does."""
    for b in BLOCKS:
        if all(n % b == 0 for n in lengths):
            return b
    raise ValueError(f"attention kernels need sequence lengths divisible by {BLOCKS[-1]} (per "
                     f"device), got {lengths}: change data.seq_len or the `seq` mesh axes")


# ----------------------------------------------------------------------------- TPU: splash
def splash_kernel(heads: int, seq: int, head_shards: int, q_seq_shards: int, interpret: bool):
    """A causal splash attention kernel for `heads` heads of `seq` tokens, its mask information
    split into head_shards x q_seq_shards parts (the devices' shares under a mesh)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
        splash_attention_mask as sm,
    )

    bq = block_len(seq // q_seq_shards)
    bkv = block_len(seq)
    # one backward kernel for dq, dk and dv: Q K^T is recomputed once, not in a dq and a dkv pass
    blocks = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                           block_kv_dkv=bkv, block_kv_dkv_compute=bkv, use_fused_bwd_kernel=True)
    causal = _corner_causal_mask_type()((seq, seq))
    if q_seq_shards > 1:
        # the queries arrive in zigzag order (`zigzag_positions`): the kernel's mask compares
        # each query's original position (its q_sequence entry) with the key's
        causal.q_sequence = zigzag_positions(seq, q_seq_shards)
    mask = sm.MultiHeadMask([causal for _ in range(heads)])
    # built per trace (its mask arrays become the trace's constants; a kernel cached across
    # traces would carry one trace's arrays into another)
    return sk.make_splash_mha(mask, block_sizes=blocks, head_shards=head_shards,
                              q_seq_shards=q_seq_shards, interpret=interpret,
                              residual_checkpoint_name=RESIDUALS)


@functools.cache
def _corner_causal_mask_type():
    """splash's CausalMask, each block's mask answered from its corners when the block is all
    visible or all masked.

    `make_splash_mha` turns the mask into per-block information in numpy while a program is
    traced, evaluating `mask[q_block, kv_block]` and its any() / all() for every block pair of
    every query shard, forward and backward: O(seq^2) element work, 15 s at 32k and ~9 min at
    256k (64 heads, q_seq_shards 8, block 512) per process, most of the longctx and GRPO plans'
    lowering. A causal block is all visible when its smallest query position is at or after its
    last key, and all masked when its largest is before its first key: such blocks come back as
    `_UniformBlock`s (any()/all() in O(1): numpy reduces a zero-stride view element by element);
    the diagonal blocks are computed as splash computes them. The kernel itself is unchanged
    (the same `mask_function` and `q_sequence`); equal mask information:
    tests/model/test_attention_kernels.py."""
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    class _UniformBlock(np.ndarray):
        def any(self, *args, **kwargs):
            if args or kwargs:
                return np.asarray(self).any(*args, **kwargs)
            return bool(self.size) and bool(self.flat[0])

        def all(self, *args, **kwargs):
            if args or kwargs:
                return np.asarray(self).all(*args, **kwargs)
            return not self.size or bool(self.flat[0])

    class CornerCausalMask(sm.CausalMask):
        def __getitem__(self, idx):
            if len(idx) == 2 and all(isinstance(s, slice) for s in idx):
                (q0, q1, qs), (k0, k1, ks) = idx[0].indices(self.shape[0]), idx[1].indices(self.shape[1])
                if qs == 1 and ks == 1 and q1 > q0 and k1 > k0:
                    rows = self.q_sequence[q0:q1]
                    if int(rows.min()) + self.offset >= k1 - 1:
                        return np.broadcast_to(np.True_, (q1 - q0, k1 - k0)).view(_UniformBlock)
                    if int(rows.max()) + self.offset < k0:
                        return np.broadcast_to(np.False_, (q1 - q0, k1 - k0)).view(_UniformBlock)
            return super().__getitem__(idx)

    return CornerCausalMask


def visited_fraction(tq: int, seq: int) -> float:
    """The fraction of its (query, key) block pairs the busiest device's splash kernel computes
    for `tq` of `seq` queries (seq / tq query shards, zigzag order when split): causal block
    skipping visits, for each block of queries, the key blocks up to its last position."""
    import numpy as np

    n = seq // tq
    bq, bkv = block_len(tq), block_len(seq)
    pos = zigzag_positions(seq, n) if n > 1 else np.arange(seq)
    last = pos.reshape(n, tq // bq, bq).max(-1)  # [shard, query block]
    visited = ((last // bkv) + 1).sum(-1)  # key blocks per shard
    return float(visited.max() * bq * bkv) / (tq * seq)


def _splash_local(kernel, q, k, v, seg_q, seg_kv, scale: float):
    """One device's splash call: q `[B,Tl,Hl,dq]`, k `[B,T,Hl,dq]`, v `[B,T,Hl,dv]`, seg_q
    `[B,Tl]`, seg_kv `[B,T]` -> `[B,Tl,Hl,dv]` (the kernel works on `[heads, seq, dim]`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    heads_major = lambda a: jnp.swapaxes(a, 1, 2)
    qs = heads_major(q * jnp.asarray(scale, q.dtype))  # the kernel applies no softmax scale

    def one(q1, k1, v1, sq, skv):
        return kernel(q1, k1, v1, segment_ids=SegmentIds(q=sq, kv=skv))

    o = jax.vmap(one)(qs, heads_major(k), heads_major(v), seg_q, seg_kv)
    return heads_major(o)


def splash_attention(q, k, v, segment_ids, scale: float, *, interpret: bool = False):
    """`reference_attention` by the TPU splash kernel (module docstring); `interpret=True` runs
    the kernel in the Pallas interpreter (any backend: the tests)."""
    b, t, h, _ = q.shape
    ctx = sharding.current()
    if ctx is None:
        kernel = splash_kernel(h, t, 1, 1, interpret)
        return _splash_local(kernel, q, k, v, segment_ids, segment_ids, scale)
    mesh, rules = ctx
    bs, ss, hs = _specs(mesh, rules, b, t, h)
    kernel = splash_kernel(h, t, _size(mesh, hs), _size(mesh, ss), interpret)
    kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(hs, ss)))
    q_spec, kv_spec = P(bs, ss, hs, None), P(bs, None, hs, None)
    n = _size(mesh, ss)

    def local(kernel, q, k, v, seg_q, seg_kv):
        if n == 1:
            return _splash_local(kernel, q, k, v, seg_q, seg_kv, scale)
        o = _splash_local(kernel, to_zigzag(q, ss, n), k, v, to_zigzag(seg_q, ss, n), seg_kv, scale)
        return to_zigzag(o, ss, n, inverse=True)

    fn = jax.shard_map(local, mesh=mesh,
                       in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, P(bs, ss), P(bs, None)),
                       out_specs=q_spec, check_vma=False)
    return fn(kernel, q, k, v, segment_ids, segment_ids)


# ----------------------------------------------------------------------------- GPU: Triton flash
def gpu_flash_attention(q, k, v, segment_ids, scale: float, *, interpret: bool = False, prefix_segment=None):
    """`reference_attention` by the Pallas GPU (Triton) flash kernel of coder.pallas.flash_gpu
    (module docstring), shared-prefix rows included (`prefix_segment`, as `attention_mask`);
    `interpret=True` runs it in the Pallas interpreter (the tests)."""
    from coder.pallas import flash_gpu

    b, t, h, _ = q.shape
    tiles = flash_gpu.Tiles(interpret=interpret)
    prefix = jnp.zeros_like(segment_ids) if prefix_segment is None else prefix_segment
    ctx = sharding.current()
    if ctx is None:
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return flash_gpu.flash_attention(q, k, v, pos, segment_ids, segment_ids, scale, tiles, q_prefix=prefix)
    mesh, rules = ctx
    bs, ss, hs = _specs(mesh, rules, b, t, h)
    n = _size(mesh, ss)
    q_spec, kv_spec = P(bs, ss, hs, None), P(bs, None, hs, None)
    # each query shard's positions in zigzag order (the order to_zigzag gives its queries)
    table = jnp.asarray(zigzag_positions(t, n).reshape(n, t // n), jnp.int32) if n > 1 else None

    def local(q, k, v, seg_q, seg_kv, pre_q):
        if n == 1:
            pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg_q.shape)
            return flash_gpu.flash_attention(q, k, v, pos, seg_q, seg_kv, scale, tiles, q_prefix=pre_q)
        pos = jnp.broadcast_to(table[jax.lax.axis_index(ss)], seg_q.shape)
        zig = lambda a: to_zigzag(a, ss, n)
        o = flash_gpu.flash_attention(zig(q), k, v, pos, zig(seg_q), seg_kv, scale, tiles, q_prefix=zig(pre_q))
        return to_zigzag(o, ss, n, inverse=True)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(bs, ss), P(bs, None), P(bs, ss)),
                       out_specs=q_spec, check_vma=False)
    return fn(q, k, v, segment_ids, segment_ids, prefix)


# ----------------------------------------------------------------------------- ring
# model.context_parallel="ring" (coder.model.context_parallel): nothing gathered, the keys and
# values passed around the `seq` axes; each backend gives the ring its block kernels
RING_KERNELS = ("splash", "flash", "reference")


def splash_blocks(heads: int, length: int, scale: float, interpret: bool = False) -> context_parallel.Blocks:
    """The ring's blocks by splash (TPU): a causal and a whole-block kernel for `heads` heads of
    `length`-token query and key blocks. The forward returns splash's log-sum-exp
    (save_residuals); the backward runs splash's own backward kernels with the row's final
    output and log-sum-exp as their residuals (`_splash_attention_bwd`: its delta = sum(dO * O)
    and P = exp(S - L) are then the row's)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
        splash_attention_mask as sm,
    )

    b = block_len(length)
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, use_fused_bwd_kernel=True)
    masks = {True: _corner_causal_mask_type()((length, length)), False: sm.FullMask((length, length))}

    def kernel_of(causal):
        # made where it is called: its mask information becomes that trace's values (the ring's
        # backward is traced apart from its forward); splash caches the mask processing itself
        return sk.make_splash_mha(sm.MultiHeadMask([masks[causal]] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, save_residuals=True, interpret=interpret)

    heads_major = lambda a: jnp.swapaxes(a, 1, 2)
    scaled = lambda q: q * jnp.asarray(scale, q.dtype)  # the kernel applies no softmax scale

    def collapse(info):  # as splash's own call does to a mask's partial blocks
        if info is None or info.partial_mask_blocks is None:
            return info
        return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(
            -1, *info.partial_mask_blocks.shape[-2:]))

    def fwd(causal, q, k, v, q_seg, kv_seg):
        kernel = kernel_of(causal)

        def one(q1, k1, v1, sq, skv):
            o, (lse,) = kernel(q1, k1, v1, segment_ids=sk.SegmentIds(q=sq, kv=skv))
            return o, lse

        with jax.named_scope("ring_causal_block" if causal else context_parallel.FULL_BLOCK_SCOPE):
            o, lse = jax.vmap(one)(heads_major(scaled(q)), heads_major(k), heads_major(v), q_seg, kv_seg)
        return heads_major(o), lse

    def bwd(causal, q, k, v, q_seg, kv_seg, o, lse, do):
        kernel = kernel_of(causal)
        kw = kernel.kwargs

        def one(q1, k1, v1, sq, skv, o1, lse1, do1):
            res = (q1, k1, v1, sk.SegmentIds(q=sq, kv=skv), None, o1, lse1, collapse(kernel.dq_mask_info),
                   collapse(kernel.dkv_mask_info))
            grads = sk._splash_attention_bwd(False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None,
                                             kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"],
                                             res, do1)
            return grads[3:6]

        with jax.named_scope("ring_causal_block" if causal else context_parallel.FULL_BLOCK_SCOPE):
            dq, dk, dv = jax.vmap(one)(heads_major(scaled(q)), heads_major(k), heads_major(v), q_seg, kv_seg,
                                       heads_major(o.astype(q.dtype)), lse, heads_major(do.astype(q.dtype)))
        return heads_major(dq) * scale, heads_major(dk), heads_major(dv)

    return context_parallel.Blocks(fwd, bwd)


def flash_blocks(scale: float, interpret: bool = False) -> context_parallel.Blocks:
    """The ring's blocks by the Triton flash kernels (GPU, coder.pallas.flash_gpu), which mask by
    query position against key index: a causal block's queries at 0..Tq-1, a whole block's all
    at its last key."""
    from coder.pallas import flash_gpu

    tiles = flash_gpu.Tiles(interpret=interpret)

    def positions(causal, q, k):
        b, tq = q.shape[:2]
        pos = jnp.arange(tq, dtype=jnp.int32) if causal else jnp.full((tq,), k.shape[1] - 1, jnp.int32)
        return jnp.broadcast_to(pos, (b, tq))

    def fwd(causal, q, k, v, q_seg, kv_seg):
        with jax.named_scope("ring_causal_block" if causal else context_parallel.FULL_BLOCK_SCOPE):
            return flash_gpu.flash_forward(q, k, v, positions(causal, q, k), q_seg, kv_seg, scale, tiles)

    def bwd(causal, q, k, v, q_seg, kv_seg, o, lse, do):
        with jax.named_scope("ring_causal_block" if causal else context_parallel.FULL_BLOCK_SCOPE):
            return flash_gpu.flash_backward(q, k, v, positions(causal, q, k), q_seg, kv_seg, o.astype(q.dtype), lse,
                                            do.astype(q.dtype), scale, tiles)

    return context_parallel.Blocks(fwd, bwd)


def ring_split(t: int, unit: int = 1):
    """(mesh, batch axes, seq axes, head axes, n) of the active mesh for a ring over rows of `t`
    tokens (the rules' axes: whether they divide a batch's rows or heads is the caller's), or None when no mesh is active or its `seq` axes do not split the row (n = 1).
    Raises when they split it into shards whose half-chunks are not whole `unit`s."""
    ctx = sharding.current()
    if ctx is None:
        return None
    mesh, rules = ctx
    ss = sharding.logical_to_spec(("seq",), rules)[0]
    n = _size(mesh, ss)
    if n == 1:
        return None
    if t % (2 * n * unit):
        raise ValueError(f"model.context_parallel='ring': rows of {t} tokens over {n} sequence shards are not "
                         f"2 x {n} half-chunks of whole {unit}-token blocks: change data.seq_len or the "
                         "`seq` mesh axes")
    bs, _, hs = sharding.logical_to_spec(("batch", "seq", "heads"), rules)
    return mesh, bs, ss, hs, n


def ring_attention(q, k, v, segment_ids, scale: float, *, kernel: str = "reference", interpret: bool = False):
    """`reference_attention` with each row split over the active mesh's `seq` axes, as a ring
    (coder.model.context_parallel): no device holds more than its share of the keys and values
    and one visiting block. kernel: "splash" (TPU), "flash" (GPU), "reference" (XLA's blocks);
    `interpret` runs a kernel in the Pallas interpreter (tests). Without a sequence split, the
    whole-row path of that kernel."""
    if kernel not in RING_KERNELS:
        raise ValueError(f"ring attention kernel {kernel!r}: choose one of {RING_KERNELS}")
    b, t, h, _ = q.shape
    split = ring_split(t, unit=1 if kernel == "reference" else BLOCKS[-1])
    if split is None:
        whole = {"splash": splash_attention, "flash": gpu_flash_attention}.get(kernel)
        if whole is None:
            return reference_attention(q, k, v, segment_ids, scale)
        return whole(q, k, v, segment_ids, scale, interpret=interpret)
    mesh, bs, ss, hs, n = split
    bs = bs if bs is not None and b % _size(mesh, bs) == 0 else None
    hs = hs if hs is not None and h % _size(mesh, hs) == 0 else None
    heads, half = h // _size(mesh, hs), t // n // 2

    def local(q, k, v, seg):
        blocks = {"splash": lambda: splash_blocks(heads, half, scale, interpret),
                  "flash": lambda: flash_blocks(scale, interpret),
                  "reference": lambda: context_parallel.reference_blocks(scale)}[kernel]()
        return context_parallel.ring_attention(q, k, v, seg, blocks, ss, n)

    spec = P(bs, ss, hs, None)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(bs, ss)), out_specs=spec, check_vma=False)
    return fn(q, k, v, segment_ids)


# ----------------------------------------------------------------------------- dispatch
def attention(q, k, v, segment_ids, scale: float, prefix_segment=None, context_parallel_mode: str = "gather"):
    """Causal segment-masked attention by the kernel of the platform the program is lowered for
    (module docstring). Shapes: q `[B,T,H,dq]`, k `[B,T,H,dq]`, v `[B,T,H,dv]` -> `[B,T,H,dv]`.

    With `prefix_segment` (shared-prefix rows, `attention_mask`) it is the GPU flash kernel on
    GPUs (its mask takes the prefix term) and the XLA reference elsewhere: splash compares
    segment ids for equality only, so on TPU the `[B,H,T,T]` scores are materialised.

    context_parallel_mode (model.context_parallel, coder.model.context_parallel.MODES): how a
    row split over the mesh's `seq` axes meets its keys: "gather" them whole on every device,
    or pass them around a "ring" (`ring_attention`: splash blocks on TPU, flash on GPU, XLA's
    elsewhere)."""
    ref = functools.partial(reference_attention, scale=scale)
    if context_parallel.check_mode(context_parallel_mode) == "ring" and (
            n := sequence_shards()) > 1:
        if prefix_segment is not None:
            raise ValueError("model.context_parallel='ring' has no shared-prefix mask (grpo.shared_prefix): "
                             "use context_parallel='gather' for shared-prefix rows")
        ring = lambda kernel: functools.partial(ring_attention, scale=scale, kernel=kernel)
        unit = 2 * n * BLOCKS[-1]  # two half-chunks of whole kernel blocks a shard
        return sharding.platform_dependent(
            q, k, v, segment_ids, tpu=_padded(ring("splash"), unit), cuda=_padded(ring("flash"), unit),
            default=_padded(ring("reference"), 2 * n))
    if prefix_segment is not None:
        return sharding.platform_dependent(
            q, k, v, segment_ids, prefix_segment,
            cuda=_padded(lambda q, k, v, s, p: gpu_flash_attention(q, k, v, s, scale=scale, prefix_segment=p)),
            default=lambda q, k, v, s, p: ref(q, k, v, s, prefix_segment=p))
    return sharding.platform_dependent(
        q, k, v, segment_ids,
        tpu=_padded(functools.partial(splash_attention, scale=scale)),
        cuda=_padded(functools.partial(gpu_flash_attention, scale=scale)),
        rocm=ref, default=ref)


def sequence_shards() -> int:
    ctx = sharding.current()
    return 1 if ctx is None else _size(ctx[0], sharding.logical_to_spec(("seq",), ctx[1])[0])


def _padded(kernel, multiple: int = BLOCKS[-1]):
    """`kernel(q, k, v, *rows)` on rows padded to a multiple of `multiple` tokens (`rows`: the
    [B,T] segment ids, and prefix segments where given; padding is segment 0, the padding's own,
    which no real token attends to, with no prefix), its output cut back to the input's length."""
    def run(q, k, v, *rows):
        t = q.shape[1]
        pad = -t % multiple
        if not pad:
            return kernel(q, k, v, *rows)
        widen = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return kernel(widen(q), widen(k), widen(v), *map(widen, rows))[:, :t]
    return run


def _specs(mesh, rules, b: int, t: int, h: int):
    """Mesh axes (or None) splitting the batch, the sequence and the heads, each kept only
    when it divides its dimension (and leaves whole kernel blocks for the sequence)."""
    spec = sharding.logical_to_spec(("batch", "seq", "heads"), rules)

    def keep(axes, n, blocks=False):
        if axes is None:
            return None
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
        size = _size(mesh, axes_t)
        if n % size or (blocks and (n // size) % BLOCKS[-1]):
            return None
        return axes

    return keep(spec[0], b), keep(spec[1], t, blocks=True), keep(spec[2], h)


def _size(mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(math.prod(mesh.shape[a] for a in axes))

