"""NSA entry points: the branch kernels wrapped with `jax.custom_vjp`, and `nsa_attention`.

`nsa_attention(q, k, v, k_cmp, v_cmp, gates, segment_ids, cfg=, softmax_scale=, impl=)`:
  q `[B,T,H,Dk]`, k `[B,T,G,Dk]`, v `[B,T,G,Dv]`, k_cmp/v_cmp `[B,ceil(T/d),G,D]`,
  gates `[B,T,H,3]` (cmp, slc, win), segment_ids `[B,T]` -> `[B,T,H,Dv]` in v's dtype.
impl:
  "reference"  - reference.py (dense masks; tests only);
  "xla"        - xla.py, blockwise (training on CPU);
  "pallas_tpu" - Mosaic TPU kernels for the selected and window branches (tpu.py);
  "pallas_gpu" - Mosaic GPU kernels (gpu.py).
`nsa_local(..., offset, ...)`: one device's share of a sequence-parallel NSA (queries [offset,
offset + Tl) against the whole row's keys) with the TPU or GPU kernels: the selected kernels
take the offset as an operand, the window kernels run on the queries behind a halo of dummy ones.
In every impl the compressed branch and the block selection come from xla.compress_and_select:
compressed attention is a dense attention over only T/d keys that XLA already runs well, and
the selection (a top-k) is gradient-free.

`Kernel` carries the backend options; `interpret` is forwarded to `pl.pallas_call` (e.g.
`pltpu.InterpretParams()` to run the TPU kernels on CPU).
"""
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from coder.pallas.nsa import reference, xla
from coder.pallas.nsa.reference import NSAConfig


@dataclasses.dataclass(frozen=True)
class Kernel:
    backend: str = "pallas_tpu"  # "pallas_tpu" | "pallas_gpu"
    interpret: Any = None  # passed to pl.pallas_call; None = compile for the hardware
    token_tile: int = 8  # selected branch, TPU: tokens per query tile (output block)
    window_tile: int | None = None  # window branch: query/key tile length; None: 128 on TPU, and on
    #                                 GPU 64, the only tile its wgmma kernels take
    max_tokens: int = 8192  # selected branch, TPU: query tokens per kernel call (bounds the SMEM
    #                         holding the scalar-prefetched selections: 4 * G * n bytes per token)
    head_tile: int | None = None  # GPU: widest slice of a head dim one CTA computes (gpu.py, "Widths");
    #                               None: gpu.HEAD_TILE

    def module(self):
        if self.backend == "pallas_tpu":
            from coder.pallas.nsa import tpu
            return tpu
        if self.backend == "pallas_gpu":
            from coder.pallas.nsa import gpu
            return gpu
        raise ValueError(f"unknown NSA kernel backend {self.backend!r}; use pallas_tpu or pallas_gpu")

    def widths(self):
        """Keyword arguments that only the GPU kernels take."""
        return {"head_tile": self.head_tile} if self.backend == "pallas_gpu" and self.head_tile else {}


# ---------------------------------------------------------------- selected branch

# offset: the queries' first absolute index, an int32 array (traced in a shard_map), so a
# differentiable argument whose cotangent is None, like sel's and ds's
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _selected(q, k, v, sel, ds, offset, block, scale, kernel):
    return _selected_fwd(q, k, v, sel, ds, offset, block, scale, kernel)[0]


def _selected_fwd(q, k, v, sel, ds, offset, block, scale, kernel):
    o, lse = kernel.module().selected_fwd(q, k, v, sel, ds, block=block, scale=scale, token_tile=kernel.token_tile,
                                          token_offset=offset, interpret=kernel.interpret, **kernel.widths())
    return o, (q, k, v, sel, ds, offset, o, lse)


def _selected_bwd(block, scale, kernel, res, do):
    q, k, v, sel, ds, offset, o, lse = res
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    dq, dk, dv = kernel.module().selected_bwd(q, k, v, sel, ds, do, lse, delta, block=block, scale=scale,
                                              token_tile=kernel.token_tile, token_offset=offset,
                                              interpret=kernel.interpret, **kernel.widths())
    return dq, dk, dv, None, None, None


_selected.defvjp(_selected_fwd, _selected_bwd)


# ---------------------------------------------------------------- window branch

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _window(q, k, v, rows_ds, window, scale, kernel):
    return _window_fwd(q, k, v, rows_ds, window, scale, kernel)[0]


def _window_fwd(q, k, v, rows_ds, window, scale, kernel):
    o, lse = kernel.module().window_fwd(q, k, v, rows_ds, window=window, scale=scale,
                                        tile=kernel.window_tile, interpret=kernel.interpret, **kernel.widths())
    return o, (q, k, v, rows_ds, o, lse)


def _window_bwd(window, scale, kernel, res, do):
    q, k, v, rows_ds, o, lse = res
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    dq, dk, dv = kernel.module().window_bwd(q, k, v, rows_ds, do, lse, delta, window=window, scale=scale,
                                            tile=kernel.window_tile, interpret=kernel.interpret,
                                            **kernel.widths())
    return dq, dk, dv, None


_window.defvjp(_window_fwd, _window_bwd)


# ---------------------------------------------------------------- layouts

def _pad_len(t, *multiples):
    m = functools.reduce(math.lcm, multiples)
    return -(-t // m) * m


def _queries_to_kernel_layout(q, g, tp):
    """[B,T,H,Dk] -> [B,G,Tp,Hg,Dk], zero rows past T."""
    b, t, h, dk = q.shape
    q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    return q.reshape(b, tp, g, h // g, dk).transpose(0, 2, 1, 3, 4)


def _keys_to_kernel_layout(x, sp):
    """[B,S,G,D] -> [B,G,Sp,D], zero rows past S."""
    return jnp.pad(x, ((0, 0), (0, sp - x.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3)


def _to_kernel_layout(q, k, v, doc_start, tp):
    """[B,T,H,D] / [B,T,G,D] -> q [B,G,Tp,Hg,Dk], k [B,G,Tp,Dk], v [B,G,Tp,Dv], doc_start [B,Tp]."""
    b, t = doc_start.shape
    qk = _queries_to_kernel_layout(q, k.shape[2], tp)
    kk, vk = _keys_to_kernel_layout(k, tp), _keys_to_kernel_layout(v, tp)
    # padded queries see only themselves: no NaN, and they never touch real keys' gradients
    ds = jnp.concatenate([doc_start, jnp.broadcast_to(jnp.arange(t, tp, dtype=jnp.int32), (b, tp - t))], 1)
    return qk, kk, vk, ds


def _from_kernel_layout(o, t):
    """[B,G,Tp,Hg,Dv] -> [B,T,H,Dv]."""
    b, g, tp, hg, dv = o.shape
    return o.transpose(0, 2, 1, 3, 4).reshape(b, tp, g * hg, dv)[:, :t]


def selected_attention(q, k, v, sel, doc_start, *, block, scale, kernel: Kernel, offset=None):
    """Kernel-backed selected branch: q [B,T,H,Dk], k/v [B,S,G,D], sel [B,T,G,n] -> [B,T,H,Dv].

    S = T; or, with `offset` (an int32 scalar, traced where a device holds a shard of the row's
    queries), the queries are [offset, offset + T) and k, v the whole row's keys."""
    b, t = q.shape[:2]
    g = k.shape[2]
    if offset is None:
        tp = _pad_len(t, block, kernel.token_tile)
        qk, kk, vk, ds = _to_kernel_layout(q, k, v, doc_start, tp)
        cur = jnp.arange(t, tp, dtype=jnp.int32) // block  # padded rows select only their own block
        offset = 0
    else:
        tp, sp = _pad_len(t, kernel.token_tile), _pad_len(k.shape[1], block)
        qk, kk, vk = _queries_to_kernel_layout(q, g, tp), _keys_to_kernel_layout(k, sp), _keys_to_kernel_layout(v, sp)
        # padded rows see block 0 from its start (their own block may lie past the row's keys):
        # never an empty softmax, and their zero output gradient adds nothing to dK / dV
        ds = jnp.concatenate([doc_start, jnp.zeros((b, tp - t), jnp.int32)], 1)
        cur = jnp.zeros((tp - t,), jnp.int32)
    sel_pad = jnp.broadcast_to(cur[None, :, None, None], (sel.shape[0], tp - t) + sel.shape[2:])
    selk = jnp.concatenate([sel.astype(jnp.int32), sel_pad], axis=1).transpose(0, 2, 1, 3)
    step = tp
    if kernel.backend == "pallas_tpu":
        step = max(kernel.token_tile, kernel.max_tokens // kernel.token_tile * kernel.token_tile)
    outs = [_selected(qk[:, :, lo:lo + step], kk, vk, selk[:, :, lo:lo + step], ds[:, lo:lo + step],
                      jnp.asarray(offset + lo, jnp.int32), block, scale, kernel) for lo in range(0, tp, step)]
    return _from_kernel_layout(jnp.concatenate(outs, axis=2), t)


def window_attention(q, k, v, doc_start, *, window, scale, kernel: Kernel, offset=None):
    """Kernel-backed sliding window: q [B,T,H,Dk], k/v [B,S,G,D] -> [B,T,H,Dv]. S = T, or
    (`offset`, traced or not) the queries are [offset, offset + T) of the row k, v hold whole
    (`_window_at_offset`)."""
    if offset is not None:
        return _window_at_offset(q, k, v, doc_start, offset, window=window, scale=scale, kernel=kernel)
    b, t, h, dk = q.shape
    g = k.shape[2]
    if kernel.backend == "pallas_tpu":  # the GPU kernel's tile is fixed by wgmma
        kernel = dataclasses.replace(kernel, window_tile=min(kernel.window_tile or 128, _pad_len(t, 8)))
    elif kernel.window_tile is None:
        kernel = dataclasses.replace(kernel, window_tile=64)
    tile = kernel.window_tile
    tp = _pad_len(t, tile)
    qk, kk, vk, ds = _to_kernel_layout(q, k, v, doc_start, tp)
    hg = h // g
    rows_ds = jnp.repeat(ds, hg, axis=1)[..., None]  # [B,Tp*Hg,1]
    o = _window(qk.reshape(b, g, tp * hg, dk), kk, vk, rows_ds, window, scale, kernel)
    return _from_kernel_layout(o.reshape(b, g, tp, hg, -1), t)


def _window_at_offset(q, k, v, doc_start, offset, *, window, scale, kernel: Kernel):
    """The window branch of the queries [offset, offset + T) against the row's keys k, v
    [B,S,G,D], by the unchanged whole-row kernels on a local row of L = halo + T tokens: the
    keys [offset - halo, offset + T) (zeros before the row's start, outside every document),
    and before the T queries `halo` >= window - 1 dummy ones (zeros, each attending only its own
    slot; their outputs are dropped, so their gradient adds nothing to dK / dV). A query's
    document start moves into the local row, clipped at its first slot, which its window
    cannot see past anyway."""
    b, t, h, dk = q.shape
    halo = _pad_len(max(window - 1, 1), 8)
    local = lambda x: jax.lax.dynamic_slice_in_dim(jnp.pad(x, ((0, 0), (halo, 0), (0, 0), (0, 0))),
                                                   offset, halo + t, axis=1)
    q_local = jnp.concatenate([jnp.zeros((b, halo, h, dk), q.dtype), q], axis=1)
    ds = jnp.concatenate([jnp.broadcast_to(jnp.arange(halo, dtype=jnp.int32), (b, halo)),
                          jnp.maximum(doc_start - (offset - halo), 0).astype(jnp.int32)], axis=1)
    o = window_attention(q_local, local(k), local(v), ds, window=window, scale=scale, kernel=kernel)
    return o[:, halo:]


# ---------------------------------------------------------------- the whole layer

@functools.cache
def gpu_unsupported(hg, dk, dv, block, head_tile=None, lower=True):
    """Why the Mosaic GPU kernels (coder/pallas/nsa/gpu.py) cannot take a layer, or None: `hg` query heads per key group, head widths
    dk / dv, selection blocks of `block` tokens (the window tile is always ROWS). Checked at trace
    time (coder/model/attention.py picks the XLA path instead) rather than left to a kernel's
    ValueError or to Mosaic refusing a kernel when the whole program is lowered:
    - 64-token blocks and 64-multiple widths (`gpu._check`);
    - a slice of each width that fits the heads' padded wgmma rows in one warpgroup's registers
      (`gpu._split`: at most gpu._ACC_ELEMS / 64 = 256 rows);
    - lower: shared memory. What the six kernels allocate depends on the rows and on how `_split`
      cuts the widths, not monotonically (at 64 rows Dk = Dv = 256 stays whole and overflows
      where 576 / 512, split, fits; 192 rows take 576 / 512 but not 128 / 128), so rather than
      model Mosaic's allocation they are lowered for CUDA once per shape (jax.grad of both
      branches on one block of tokens: shared memory does not depend on T, n or w) and Mosaic's
      refusal is the reason. A few seconds, once per process and shape."""
    from coder.pallas.nsa import gpu

    head_tile = gpu.HEAD_TILE if head_tile is None else head_tile
    ROWS = gpu.ROWS
    if block != ROWS:
        return f"selection blocks of {block} tokens (the kernels take {ROWS})"
    if dk % 64 or dv % 64:
        return f"head widths dk={dk}, dv={dv} (the kernels take multiples of 64)"
    rows = -(-hg // ROWS) * ROWS
    for width in (dk, dv):
        try:
            gpu._split(width, rows, head_tile)
        except ValueError as e:
            return f"{hg} query heads per key group ({rows} wgmma rows): {e}"
    if lower:
        try:
            _lower_gpu_kernels(hg, dk, dv, block, head_tile)
        except ValueError as e:  # Mosaic GPU's refusal ("... exceeds available shared memory ...")
            return f"{hg} query heads per key group, dk={dk}, dv={dv}: Mosaic GPU refuses the kernels: {e}"
    return None


def _lower_gpu_kernels(hg, dk, dv, block, head_tile):
    """Lowers forward and backward of both branches for CUDA at these widths (`gpu_unsupported`)."""
    from coder.pallas.nsa import ops

    kernel = ops.Kernel(backend="pallas_gpu", head_tile=head_tile)

    def loss(q, k, v):  # may run while a model is traced: every array is made in here
        ds, sel = jnp.zeros((1, block), jnp.int32), jnp.zeros((1, block, 1, 1), jnp.int32)
        o_slc = selected_attention(q, k, v, sel, ds, block=block, scale=1.0, kernel=kernel)
        o_win = window_attention(q, k, v, ds, window=block, scale=1.0, kernel=kernel)
        return jnp.sum(o_slc.astype(jnp.float32)) + jnp.sum(o_win.astype(jnp.float32))

    shapes = [(1, block, hg, dk), (1, block, 1, dk), (1, block, 1, dv)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",))


IMPLS = ("reference", "xla", "pallas_tpu", "pallas_gpu")


def nsa_attention(q, k, v, k_cmp, v_cmp, gates, segment_ids, *, cfg: NSAConfig, softmax_scale: float,
                  impl: str = "xla", kernel: Kernel | None = None, chunk: int = 128, unroll: bool = False):
    """NSA over a packed batch -> [B,T,H,Dv] in v's dtype. See the module docstring.

    chunk: queries per step of the XLA loops; unroll: unroll them (exact XLA cost analysis)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown NSA impl {impl!r}; choose one of {IMPLS}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv groups {k.shape[2]}")
    if impl == "reference":
        out = reference.nsa(q, k, v, k_cmp, v_cmp, gates, segment_ids, cfg, softmax_scale)
        return out.astype(v.dtype)
    if impl == "xla":
        return xla.nsa(q, k, v, k_cmp, v_cmp, gates, segment_ids, cfg, softmax_scale, chunk,
                       unroll).astype(v.dtype)
    kernel = kernel or Kernel(backend=impl)
    if kernel.backend != impl:
        raise ValueError(f"impl={impl!r} but kernel.backend={kernel.backend!r}")
    ds = xla.doc_starts(segment_ids)
    o_cmp, sel = xla.compress_and_select(q, k_cmp, v_cmp, ds, cfg, softmax_scale, chunk, unroll)
    o_slc = selected_attention(q, k, v, sel, ds, block=cfg.select_block, scale=softmax_scale, kernel=kernel)
    o_win = window_attention(q, k, v, ds, window=cfg.window, scale=softmax_scale, kernel=kernel)
    return xla.combine(gates, o_cmp, o_slc.astype(jnp.float32), o_win.astype(jnp.float32)).astype(v.dtype)


def nsa_local(q, k, v, k_cmp, v_cmp, gates, segment_ids, offset, *, cfg: NSAConfig, softmax_scale: float,
              kernel: Kernel, chunk: int = 128):
    """One device's part of a sequence-parallel NSA with the kernels (xla.nsa_local's
    arguments and layout): q [B,Tl,H,Dk] and gates [B,Tl,H,3] of the queries [offset, offset +
    Tl) (offset an int32 scalar, traced in a shard_map); k [B,T,G,Dk], v [B,T,G,Dv], k_cmp/v_cmp
    [B,Nc,G,D] and segment_ids [B,T] of the whole rows -> [B,Tl,H,Dv] in v's dtype. The
    compressed branch and the selection are XLA's at the offset, as in `nsa_attention`."""
    t_local = q.shape[1]
    ds = jax.lax.dynamic_slice_in_dim(xla.doc_starts(segment_ids), offset, t_local, axis=1)
    o_cmp, sel = xla.compress_and_select(q, k_cmp, v_cmp, ds, cfg, softmax_scale, chunk, offset=offset,
                                         total=k.shape[1])
    o_slc = selected_attention(q, k, v, sel, ds, block=cfg.select_block, scale=softmax_scale, kernel=kernel,
                               offset=offset)
    o_win = window_attention(q, k, v, ds, window=cfg.window, scale=softmax_scale, kernel=kernel, offset=offset)
    return xla.combine(gates, o_cmp, o_slc.astype(jnp.float32), o_win.astype(jnp.float32)).astype(v.dtype)
