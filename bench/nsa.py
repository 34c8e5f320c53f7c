"""NSA vs dense causal attention: XLA FLOPs, CPU time, and decode-time cache reads, side by side.

    python bench/nsa.py [--lengths 4096,16384,32768,65536] [--heads 4] [--dim 64] [--no-time]

Shapes (one layer, batch 1, MQA as in MLA's absorbed form: H query heads, one KV group):
q [1,T,H,dim], k [1,T,1,dim], v [1,T,1,dim]; NSA with the paper's sizes (l=32, d=16, l'=64, n=16,
w=512) via the full module (compression MLPs and gates included) on the blockwise XLA path
(impl="xla", 512 queries per loop step). XLA's cost analysis counts a rolled loop's body once,
so FLOPs come from the same layer compiled with its loops unrolled (16 chunks of T/16 queries,
which does the same arithmetic: see nsa_fwd), and CPU time from the rolled program. Dense baseline: causal flash-style attention in XLA, query chunks of 2048 that
each see only the keys up to their end (no work above the diagonal), so both sides are
blockwise. FLOPs come from XLA's cost analysis of the whole compiled program; its CPU time is
the sum over chunks each run as its own program (dense_chunks_timed: one chunk's scores in
memory at a time), NSA's one execution of the compiled layer (2 shared cores: compare ratios,
not absolutes).

Decode: cache bytes read per generated token for DeepSeek-V3's MLA cache (bf16 latent 512 +
RoPE key 64 per slot, K and V share the latent; compressed K 576 + V 512 per entry), from
coder.pallas.nsa.decode.bytes_per_token, which counts what decode_step reads (checked against
decode_step's program in tests/pallas/test_nsa_module.py).
"""
import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coder.pallas.nsa import decode
from coder.pallas.nsa.module import NSA
from coder.pallas.nsa.reference import NSAConfig
from configs.base import get_config

DENSE_CHUNK = 2048
NSA_CHUNK = 512  # queries per step of the NSA XLA loops


def dense_causal(q, k, v, scale):
    """Blockwise causal attention: chunk i of queries against keys [0, (i+1)C). [B,T,H,D] -> same."""
    t = q.shape[1]
    c = min(DENSE_CHUNK, t)
    outs = []
    for i in range(-(-t // c)):
        lo, hi = i * c, min((i + 1) * c, t)

        @jax.checkpoint
        def chunk(qi, ki, vi, lo=lo, hi=hi):
            s = jnp.einsum("bthd,bsd->bhts", qi, ki[:, :, 0]) * scale
            mask = jnp.arange(lo, hi)[:, None] >= jnp.arange(hi)[None, :]
            p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
            return jnp.einsum("bhts,bsd->bthd", p, vi[:, :, 0])

        outs.append(chunk(q[:, lo:hi], k[:, :hi], v[:, :hi]))
    return jnp.concatenate(outs, axis=1)


def dense_chunks_timed(q, k, v, w, scale, backward: bool) -> float:
    """CPU seconds of dense_causal (with its gradient if `backward`) run one query chunk at a time.

    The same arithmetic as the whole program, but each chunk is its own executable run after
    the previous one finished, so memory holds one chunk's [H, C, T] scores (at 64k the whole
    program lets XLA keep several chunks live at once, more than this machine's RAM). Gradients:
    dq of a chunk is its own; dk/dv add up over chunks (the adds are not timed: O(T D))."""
    t = q.shape[1]
    c = min(DENSE_CHUNK, t)
    total = 0.0
    for i in range(-(-t // c)):
        lo, hi = i * c, min((i + 1) * c, t)

        def chunk(qi, ki, vi, wi, lo=lo, hi=hi):
            def f(qi, ki, vi):
                s = jnp.einsum("bthd,bsd->bhts", qi, ki[:, :, 0]) * scale
                mask = jnp.arange(lo, hi)[:, None] >= jnp.arange(hi)[None, :]
                p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
                return jnp.einsum("bhts,bsd->bthd", p, vi[:, :, 0])
            if not backward:
                return f(qi, ki, vi)
            return jax.grad(lambda *a: jnp.sum(f(*a) * wi), argnums=(0, 1, 2))(qi, ki, vi)

        args = (q[:, lo:hi], k[:, :hi], v[:, :hi], w[:, lo:hi])
        compiled = jax.jit(chunk).lower(*args).compile()
        jax.block_until_ready(args)
        total += _run(compiled, *args)
    return total


def _compile(f, *args):
    t0 = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return compiled, float(cost.get("flops", float("nan"))), time.perf_counter() - t0


def _run(compiled, *args):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - t0


def bench_length(t, heads, dim, timed):
    mc = get_config().model
    mc.param_dtype = "float32"
    nsa = NSA(mc, nnx.Rngs(0), key_dim=dim, value_dim=dim)
    graph, params = nnx.split(nsa)
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (1, t, heads, dim))
    k = jax.random.normal(ks[1], (1, t, 1, dim))
    v = jax.random.normal(ks[2], (1, t, 1, dim))
    x = jax.random.normal(ks[3], (1, t, mc.hidden_size))
    w = jax.random.normal(ks[4], (1, t, heads, dim))
    seg = jnp.ones((1, t), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    scale = dim ** -0.5

    def nsa_fwd(params, q, k, v, unroll=False):
        # the FLOPs program unrolls 16 chunks per loop; the chunking does not change the work
        # (selected: n*l' keys per query either way; compressed: same 8 causal query groups)
        chunk = t // 16 if unroll else NSA_CHUNK
        return nnx.merge(graph, params)(q, k, v, x, seg, pos, softmax_scale=scale, impl="xla",
                                        chunk=chunk, unroll=unroll)

    def nsa_fwd_bwd(params, q, k, v, unroll=False):
        loss = lambda *a: jnp.sum(nsa_fwd(*a, unroll=unroll) * w)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(params, q, k, v)

    def dense_fwd(q, k, v):
        return dense_causal(q, k, v, scale)

    def dense_fwd_bwd(q, k, v):
        return jax.grad(lambda *a: jnp.sum(dense_fwd(*a) * w), argnums=(0, 1, 2))(q, k, v)

    row = {"T": t}
    for name, f, args in (("nsa_fwd", nsa_fwd, (params, q, k, v)), ("nsa_fb", nsa_fwd_bwd, (params, q, k, v))):
        # FLOPs from the unrolled program (compiled, never run); time from the rolled one
        row[name + "_flops"] = _compile(functools.partial(f, unroll=True), *args)[1]
        compiled = _compile(f, *args)[0]
        row[name + "_s"] = _run(compiled, *args) if timed else float("nan")
        del compiled
    for name, f, backward in (("dense_fwd", dense_fwd, False), ("dense_fb", dense_fwd_bwd, True)):
        row[name + "_flops"] = _compile(f, q, k, v)[1]  # the whole program: compiled, not run
        row[name + "_s"] = dense_chunks_timed(q, k, v, w, scale, backward) if timed else float("nan")
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096,16384,32768,65536")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--no-time", action="store_true", help="FLOPs only (skip CPU execution)")
    args = ap.parse_args()
    lengths = [int(s) for s in args.lengths.split(",")]
    print(f"# shapes: batch 1, H={args.heads} query heads, 1 KV group (MQA), head dim {args.dim}, float32, "
          f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print("T       | FLOPs fwd: dense/nsa | FLOPs fwd+bwd: dense/nsa | CPU s fwd dense nsa ratio "
          "| CPU s fwd+bwd dense nsa ratio")
    for t in lengths:
        r = bench_length(t, args.heads, args.dim, not args.no_time)
        print(f"{t:7d} | {r['dense_fwd_flops']:.3g}/{r['nsa_fwd_flops']:.3g} = "
              f"{r['dense_fwd_flops'] / r['nsa_fwd_flops']:5.2f}x | "
              f"{r['dense_fb_flops']:.3g}/{r['nsa_fb_flops']:.3g} = {r['dense_fb_flops'] / r['nsa_fb_flops']:5.2f}x | "
              f"{r['dense_fwd_s']:.2f} {r['nsa_fwd_s']:.2f} {r['dense_fwd_s'] / r['nsa_fwd_s']:5.2f}x | "
              f"{r['dense_fb_s']:.2f} {r['nsa_fb_s']:.2f} {r['dense_fb_s'] / r['nsa_fb_s']:5.2f}x", flush=True)

    cfg = NSAConfig()
    print("\n# decode: cache bytes read per token, one layer, DeepSeek-V3 MLA cache (bf16)")
    print("context | nsa KiB | dense KiB | dense/nsa")
    for t in lengths:
        nsa_b, dense_b = decode.bytes_per_token(t - 1, cfg, key_bytes=576 * 2, value_bytes=0,
                                                cmp_bytes=(576 + 512) * 2, shared_kv=True)
        print(f"{t:7d} | {nsa_b / 1024:7.1f} | {dense_b / 1024:9.1f} | {dense_b / nsa_b:6.2f}x")


if __name__ == "__main__":
    main()
