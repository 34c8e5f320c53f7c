"""One accelerator check: kernels beside their XLA references, a ~1B MoE training step, the engine.

    python bench/accelerator.py            # one GPU (H100 / H200) or a TPU host: about 8 minutes
    JAX_PLATFORMS=cpu python bench/accelerator.py --dry-run     # CPU, tiny sizes (see below)

Five parts (run in the order attention, moe, train, engine, nsa unless --parts says otherwise),
each printed as a table with every measurement beside its reference, then one last
line `SUMMARY {json}` holding every row. Each part has a time budget (FULL["budgets"], about
460 s in all with start-up; --time-scale scales them): before each size it predicts that
size's cost from the previous one (the same compile time again, the run time scaled with the
size) and skips the rest, printing why, when the budget would be exceeded. An error in one size
or part is printed with its name and the rest still runs. Exit code 1 when a part failed or a
kernel disagreed with its reference, 0 otherwise (skipped sizes are not failures; a part whose
budget ran out before its first size is "skipped"); a watchdog ends a run still going at
FULL["deadline"] (540 s) with exit code 3 and the summary so far.

1. NSA (coder/pallas/nsa): the layer (coder.pallas.nsa.module.NSA: compression MLPs and gates
   included) on the kernels (impl "pallas_gpu" on GPU, "pallas_tpu" on TPU) beside the same
   layer and parameters on the blockwise XLA path (impl "xla"), forward + backward in one
   program: time of each; then, against a float32 truth (the XLA path on float32 copies of
   q, k, v and the gate input, untimed), max |kernel - truth| and max |bf16 xla - truth| of the
   output and of the gradients w.r.t. q, k, v and the layer's parameters, each relative to the
   largest |truth| entry ("close": each of the kernel's within REL_TOL or no larger than the bf16
   XLA path's: on an H100 the two bf16 paths' dk, dv differed by 3-8% at 8k-32k, growing with T,
   which a comparison of the two alone cannot lay on either). Shapes, batch 1 and one document
   per row, MLA's absorbed form with the
   widths of configs/deepseek_v3_671b.py: q [1,T,H,576], k [1,T,1,576] (latent 512 + RoPE
   key 64), v [1,T,1,512], gate input [1,T,7168], bf16 (parameters float32); H = 16 (V3's 128
   heads over 8-way tensor parallelism; the GPU selected-branch kernel pads a group's heads to
   64 wgmma rows); T = 8k, 16k, 32k, 64k; the paper's NSA sizes (configs/base.py model.nsa:
   l=32, d=16, l'=64, n=16, w=512).
2. MLA attention (coder/model/attention_kernels.py): `attention`, the dispatch the model's
   dense path calls (splash attention on TPU, the Pallas GPU flash kernel on GPU), beside
   `reference_attention` (XLA, [B,H,T,T] float32 scores), forward + backward: time, and the
   output's and dq, dk, dv's max relative difference. Shapes: q, k [1,T,16,192], v [1,T,16,128]
   bf16 (V3's MLA head widths, 16 heads as above), one document; T = 4k, 8k, 16k, 32k. Where
   the reference's float32 [H,T,T] tensors (~4 H T^2 x 4 bytes) would take over 70% of the
   device's memory it is skipped and the kernel timed alone. On a GPU each size also times
   cuDNN's flash attention with V zero-padded to 192 (the other way to run MLA there: it wants
   one head width and takes no segment ids) in a note: which of the two is faster.
3. MoE grouped matmul (coder/model/grouped_matmul.py): one expert matmul of part 4's model at
   part 4's batch, x [98304, 1024] (8 x 2048 tokens x top-6 routed pairs, sorted by expert) x
   w [64, 1024, 384] bf16, forward + backward (dx, dw): `jax.lax.ragged_dot` (`grouped_matmul`'s
   GPU form until 2026-11-28), the block-padded einsum (its GPU and CPU form) and megablox (its
   TPU form, on TPU and in the dry run): time, TFLOP/s over the routed FLOPs, and each form's
   error against the block form on float32 operands. XLA's generic ragged_dot expansion
   multiplies every row by every expert (G times the routed FLOPs) unless its experimental
   cuDNN fusion is on; part 4's step reached 1.9% MFU on an H100 while `grouped_matmul` took
   ragged_dot on GPU, and it now takes the block form there: this part measures that choice.
4. Training step: configs/base.py's get_config() with MODEL_1B, a DeepSeek-V3-shaped MoE of
   0.98B parameters (0.23B active; 12 layers, hidden 1024, V3's MLA head widths, 64 routed
   experts top-6 in 8 groups + 1 shared, one MTP module, vocab 32768), bf16 compute, float32
   AdamW, through coder.train.trainer.Trainer.train_step (the step every stage runs) on batches
   of 8 x 2048 random tokens per device. Tokens/s; model FLOP/s (coder.train.metrics.
   model_flops_per_token: 6 N + 3 A, the training log's MFU); MFU against the chip's published
   dense bf16 peak (TPU: coder.train.aot.hardware.CHIPS; GPU: GPU_PEAK_BF16 below), "n/a"
   naming the device kind when it is in neither table; and the same FLOP/s as a fraction of a
   bf16 matmul measured here (coder.train.metrics.measure_peak_flops).
5. Engine (coder/infer/engine.py): decode tokens/s of part 4's model (bf16 serving weights; a
   fresh one when part 4 did not run) at batch 1, 8 and 64: one 256-token prompt per group,
   128 new tokens per row (greedy at batch 1, sampled at T=1 above), 32 decode steps per host
   call; `generate` alone timed, not the prefill of `start_group`. Then MTP drafts at batch 1
   (speculative_k=1, greedy, same prompt) beside the plain batch-1 row: tokens/s, tokens per
   main-model step, acceptance, whether the greedy tokens equal plain decoding's, and the
   acceptance at which drafting breaks even (t_step(k=1) / t_step(k=0) - 1). The weights are
   barely trained: the acceptance says nothing about a trained MTP module, the step times are
   real.

--dry-run runs the same code on CPU at tiny sizes: the kernels in the Pallas interpreter
(--cpu-kernels: pallas_tpu by default, several times cheaper to interpret than pallas_gpu, whose
selected branch simulates one CTA per token), T = 64 / 128, configs/base.py's tiny model with
one trunk layer (dense) and its MTP module (an MoE block), two training steps, 8 new tokens per
engine row. Its timings only show that the code runs. Nearly all of its time is compiling
(some 20 programs; 90-120 s on 2 busy CPU cores).

Needs, besides jax (with its CUDA plugin on GPU, libtpu on TPU), flax, optax, orbax-checkpoint,
tensorstore and their own dependencies (numpy, ml_dtypes, absl-py, etils, PyYAML, ...), one
small pure-Python wheel, installable offline (`pip install --no-deps ml_collections-*.whl`):
  - ml_collections (coder.model.config and configs/*.py build every config with it; its own
    requirements, absl-py and PyYAML, come with optax, orbax and flax).
Nothing else of setup.py is imported on these paths (checked by running the dry run with
sentencepiece, grain, ray, tensorboardX, zstandard, cloudpickle, google-cloud-storage, torch,
requests and the rest blocked); tensorboardX is optional (coder.train.metrics.MetricsWriter
logs a warning without it). The repository root is put on sys.path here: a checkout runs as is.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# every part runs within the pool JAX's GPU allocator preallocates, the pool stage compile's GPU
# reports fit against (coder.train.aot.hardware: 75% of HBM); set here before JAX starts (a value
# already in the environment is kept) and printed in the header
MEM_FRACTION = os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# ~1B-parameter DeepSeek-V3-shaped MoE (model keys of configs/base.py; configs/moe_1b.py says what it is)
from configs.moe_1b import MODEL_1B  # noqa: E402  (the repository root is on sys.path from here)

# Published dense (no sparsity) bf16 tensor-core peaks per GPU, by jax Device.device_kind, from
# NVIDIA's data sheets (their "BF16 Tensor Core" figures are with 2:4 sparsity: halved here).
# H100 SXM5 1979 -> 989.5 TFLOP/s, H100 PCIe 1513 -> 756.5, H100 NVL 1671 -> 835.5,
# H200 SXM 1979 -> 989.5, H200 NVL 1671 -> 835.5; A100 (SXM and PCIe) 312 dense.
GPU_PEAK_BF16 = {
    "NVIDIA H100 80GB HBM3": 989.5e12,
    "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H200": 989.5e12,
    "NVIDIA H200 NVL": 835.5e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
}

# bf16 operands (the kernels round P and dS to bf16 before their matmuls, the XLA paths do not
# all do so): agreement is judged on ~2 significant digits of the largest entry, as the kernel
# tests do (1e-2 there, on shorter rows; gradients summed over 64k queries drift further)
REL_TOL = 2e-2

# Full-size settings and the tiny --dry-run ones: sizes per part and time budgets (seconds).
FULL = dict(
    nsa_lengths=(8192, 16384, 32768, 65536), nsa_heads=16, reps=3,
    attn_lengths=(4096, 8192, 16384, 32768), attn_heads=16,
    moe_shape=(8 * 2048 * 6, 1024, 384, 64),  # MODEL_1B's routed pairs of part 4's batch, its widths
    train_rows=8, train_seq=2048, train_steps=8,
    engine_batches=(1, 8, 64), engine_prompt=256, engine_new=128, engine_decode_steps=32,
    # ~460 s with start-up; every T of NSA compiles both programs anew (their shapes change)
    budgets=dict(nsa=150.0, attention=45.0, moe=20.0, train=120.0, engine=110.0), deadline=540.0,
)
DRY = dict(
    nsa_lengths=(64,), nsa_heads=2, reps=0,
    attn_lengths=(128,), attn_heads=2,
    moe_shape=(512, 64, 32, 8),
    train_rows=2, train_seq=128, train_steps=2,
    engine_batches=(1, 8), engine_prompt=16, engine_new=8, engine_decode_steps=4,
    budgets=dict(nsa=90.0, attention=40.0, moe=30.0, train=90.0, engine=90.0), deadline=400.0,
)


# ============================================================================ harness
class Budget:
    """A part's time budget: `skip_reason(size, predicted)` says why a size is not started."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()

    @property
    def spent(self) -> float:
        return time.perf_counter() - self.start

    def skip_reason(self, what: str, predicted: float) -> str | None:
        if self.spent + predicted <= self.seconds:
            return None
        return (f"skipped {what}: budget {self.seconds:.0f} s, {self.spent:.0f} s spent, "
                f"predicted {predicted:.0f} s")


def predict(last: dict | None, growth: float) -> float:
    """Cost of the next size from the last one's: its compile time again plus its run time x
    growth (the run time scales with the size, the compile time barely does)."""
    if last is None:
        return 0.0
    return last["compile"] + last["run"] * growth


class Table:
    """Fixed-width rows printed as they are measured (a watchdog exit keeps what was printed)."""

    def __init__(self, columns: list[tuple[str, int]]):
        self.columns = columns
        print(" | ".join(f"{name:>{w}}" for name, w in columns), flush=True)

    def row(self, *values):
        cells = []
        for (_, w), v in zip(self.columns, values):
            cells.append(f"{v:>{w}.4g}" if isinstance(v, float) else f"{v!s:>{w}}")
        print(" | ".join(cells), flush=True)

    def note(self, text: str):
        print(f"  {text}", flush=True)


def block(tree):
    return jax.block_until_ready(tree)


def compile_and_time(fn, args, reps: int) -> tuple:
    """(outputs of the first run, compile seconds, best run seconds, seconds of all runs).

    The first run (autotuning, allocation) is not timed; `reps` runs follow it, or one when the
    first took over a second (64k-token rows: the budget goes further). reps = 0: the first
    run is timed (a dry run, saving an interpreted run)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = block(compiled(*args))
    first = time.perf_counter() - t0
    times = [] if reps else [first]
    for _ in range(reps if first < 1.0 else 1 if reps else 0):
        t0 = time.perf_counter()
        block(compiled(*args))
        times.append(time.perf_counter() - t0)
    return out, compile_s, min(times), first + sum(times[int(not reps):])


def normal_arrays(seed: int, *specs) -> tuple:
    """Standard-normal arrays of the given (shape, dtype) specs, made by one program on the
    device (eager jax.random calls compile one program per shape; numpy would be slow at 64k)."""
    @jax.jit
    def make(key):
        keys = jax.random.split(key, len(specs))
        return tuple(jax.random.normal(k, shape, dtype) for k, (shape, dtype) in zip(keys, specs))
    return make(jax.random.key(seed))


def timing(reps: int) -> str:
    return (f"best of {reps} runs after a warm-up (1 when a run takes over 1 s)" if reps
            else "the first run timed")


@jax.jit
def rel_diffs(pairs):
    """[(got, want), ...] (pytrees) -> [len] float32: for each pair, max |got - want| over its
    leaves relative to max |want| over the same leaves. One program on the device: the
    compared arrays never travel to the host."""
    out = []
    for got, want in pairs:
        f32 = lambda a: a.astype(jnp.float32)
        diff = jnp.max(jnp.stack([jnp.max(jnp.abs(f32(a) - f32(b)))
                                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]))
        scale = jnp.max(jnp.stack([jnp.max(jnp.abs(f32(b))) for b in jax.tree.leaves(want)]))
        out.append(diff / jnp.maximum(scale, 1e-30))
    return jnp.stack(out)


def device_memory() -> int | None:
    """Bytes the first device may allocate (None where the backend does not say)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    return stats.get("bytes_limit")


def interpret_params(backend: str):
    """The Pallas interpreter of `backend`'s kernels, to run them on CPU (--dry-run)."""
    if backend == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    try:  # not exported by plgpu in jax 0.10 (tests/pallas/test_nsa_gpu.py imports it the same way)
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
    return InterpretGPUParams()


class Context:
    """What every part reads: the settings, the platform and which kernels it runs."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.s = dict(DRY if self.dry else FULL)
        dev = jax.devices()[0]
        self.platform, self.kind = dev.platform, dev.device_kind
        if self.platform == "cpu":
            self.kernel_backend = args.cpu_kernels
            self.interpret = interpret_params(self.kernel_backend)
        else:
            self.kernel_backend = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(self.platform)
            self.interpret = None
        self.workdir = tempfile.mkdtemp(prefix="coder-accel-bench-")
        self.model = None  # (model config, nnx model): the weights part 4 trained, served by part 5


def record_comparison(table, table_rows: list, t: int, times, compiles, rels, names, baseline=None) -> bool:
    """One size of a kernel-vs-XLA part, printed and kept for the summary: `times` and `compiles`
    (kernel, xla) in seconds, `rels` the kernel's relative differences named `names`. Without
    `baseline` they are against the XLA path and close means each is within REL_TOL. With it
    (the bf16 XLA path's differences from the same float32 truth) close means each is within
    REL_TOL or no larger than the XLA path's own: the kernel is at least as exact as the path
    it replaces, whose bf16 sums drift with T too."""
    (tk, tx), (ck, cx) = times, compiles
    if baseline is None:
        close = all(r <= REL_TOL for r in rels)
        cells = list(rels)
    else:
        close = all(r <= max(REL_TOL, b) for r, b in zip(rels, baseline, strict=True))
        cells = [f"{r:.3g}/{b:.3g}" for r, b in zip(rels, baseline, strict=True)]
    table.row(t, tk * 1e3, tx * 1e3, tx / tk, f"{ck:.1f}/{cx:.1f}", *cells, "yes" if close else "NO")
    row = dict(T=t, kernel_ms=tk * 1e3, xla_ms=tx * 1e3, speedup=tx / tk, compile_kernel_s=ck, compile_xla_s=cx,
               **{f"rel_{n}": r for n, r in zip(names, rels, strict=True)}, close=close)
    if baseline is not None:
        row.update({f"rel_xla_{n}": b for n, b in zip(names, baseline, strict=True)})
    table_rows.append(row)
    return close


def record_error(table, table_rows: list, e: Exception, **which) -> bool:
    """A size (or form) that raised, named by `which` (T=8192, form="block"), printed and kept
    for the summary. Returns False (the part failed)."""
    error = f"{type(e).__name__}: {str(e)[:500]}"
    table.note(", ".join(f"{k}={v}" for k, v in which.items()) + f": ERROR {error}")
    table_rows.append(dict(**which, error=error))
    return False


# ============================================================================ 1. NSA
def part_nsa(ctx: Context, budget: Budget, table_rows: list) -> bool:
    from coder.pallas.nsa.module import NSA
    from coder.pallas.nsa.ops import Kernel
    from configs.deepseek_v3_671b import get_config as v3_config

    s = ctx.s
    mc = v3_config().model
    mc.num_attention_heads = s["nsa_heads"]
    if ctx.dry:  # tiny widths and NSA sizes: same layer, interpret-mode kernels
        mc.update(dict(kv_lora_rank=64, qk_rope_head_dim=64, hidden_size=64))
        mc.nsa.update(dict(select_topk=3, window=64))
    nsa = NSA(mc, nnx.Rngs(0))
    graph, params = nnx.split(nsa)
    dk, dv, h = nsa.key_dim, nsa.value_dim, nsa.num_heads
    kernel = Kernel(backend=ctx.kernel_backend, interpret=ctx.interpret)
    print(f"NSA layer, {ctx.kernel_backend}{' (interpret)' if ctx.interpret else ''} vs impl=xla; "
          f"batch 1, H={h}, Dk={dk}, Dv={dv}, bf16 q/k/v, {nsa.cfg}; fwd+bwd in one program, "
          f"{timing(s['reps'])}; rel k/x = max|diff| / max|truth| of the kernel / of the bf16 XLA path, "
          f"truth = the XLA path on the same inputs in float32")
    table = Table([("T", 6), ("kernel ms", 10), ("xla ms", 10), ("xla/kernel", 10), ("compile s k/x", 13),
                   ("rel out k/x", 15), ("rel dq k/x", 15), ("rel dk k/x", 15), ("rel dv k/x", 15),
                   ("rel dparams k/x", 17), ("close", 5)])
    ok, last, last_t = True, None, None
    for t in s["nsa_lengths"]:
        reason = budget.skip_reason(f"T={t} and longer", predict(last, t / last_t if last_t else 1.0))
        if reason:
            table.note(reason)
            break
        try:
            # q, k, v, the gate input x [1,T,D] and the loss weights w (loss = sum(out * w)),
            # made on the device by one program
            args = normal_arrays(t, ((1, t, h, dk), jnp.bfloat16), ((1, t, 1, dk), jnp.bfloat16),
                                 ((1, t, 1, dv), jnp.bfloat16), ((1, t, mc.hidden_size), jnp.bfloat16),
                                 ((1, t, h, dv), jnp.float32))

            def fwd_bwd(params, q, k, v, x, w, impl):
                seg = jnp.ones(q.shape[:2], jnp.int32)  # one document
                pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])

                def loss(params, q, k, v):
                    out = nnx.merge(graph, params)(q, k, v, x, seg, pos, impl=impl,
                                                   kernel=kernel if impl != "xla" else None)
                    return jnp.sum(out.astype(jnp.float32) * w), out
                (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(params, q, k, v)
                return out, grads

            args = (params, *args)
            res_k, ck, tk, rk = compile_and_time(functools.partial(fwd_bwd, impl=ctx.kernel_backend), args,
                                                 s["reps"])
            res_x, cx, tx, rx = compile_and_time(functools.partial(fwd_bwd, impl="xla"), args, s["reps"])
            # the truth both are judged by: the XLA path with q, k, v, x in float32 (untimed)
            wide = jax.tree.map(lambda a: a.astype(jnp.float32), args)
            res_f, cf, _, rf = compile_and_time(functools.partial(fwd_bwd, impl="xla"), wide, 0)
            del wide

            def pairs(res, truth):  # (output, dq, dk, dv, dparams) beside the truth's
                (o, (gp, gq, gk, gv)), (o_f, (gp_f, gq_f, gk_f, gv_f)) = res, truth
                return [(o, o_f), (gq, gq_f), (gk, gk_f), (gv, gv_f), (gp, gp_f)]
            rels = [float(r) for r in rel_diffs(pairs(res_k, res_f))]
            base = [float(r) for r in rel_diffs(pairs(res_x, res_f))]
            ok &= record_comparison(table, table_rows, t, (tk, tx), (ck, cx), rels,
                                    ("out", "dq", "dk", "dv", "dparams"), baseline=base)
            last, last_t = dict(compile=ck + cx + cf, run=rk + rx + rf), t
            del res_k, res_x, res_f, args
        except Exception as e:  # noqa: BLE001 - a size failing (out of memory, ...) leaves the others to run
            ok = record_error(table, table_rows, e, T=t)
            last, last_t = None, None
        gc.collect()
    return ok


# ============================================================================ 2. MLA attention
def part_attention(ctx: Context, budget: Budget, table_rows: list) -> bool:
    from coder.model import attention_kernels as ak
    from configs.deepseek_v3_671b import get_config as v3_config

    s = ctx.s
    mc = v3_config().model
    dn, dr, dv, h = mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim, s["attn_heads"]
    if ctx.dry:
        dn, dr, dv = 16, 8, 16
    dq = dn + dr
    scale = dq ** -0.5
    if ctx.interpret is None:
        kernel_fn, name = ak.attention, f"attention_kernels.attention ({ctx.platform} dispatch)"
    else:  # what the dispatch picks on that platform, in the Pallas interpreter
        local = ak.splash_attention if ctx.kernel_backend == "pallas_tpu" else ak.gpu_flash_attention
        padded = ak._padded(functools.partial(local, scale=scale, interpret=True))  # as the dispatch wraps it

        def kernel_fn(q, k, v, segment_ids, scale):
            return padded(q, k, v, segment_ids)

        name = f"{local.__name__} (interpret)"
    mem = device_memory()
    print(f"MLA attention: {name} vs reference_attention (XLA); batch 1, H={h}, dq={dq}, dv={dv}, bf16, "
          f"one document; fwd+bwd, {timing(s['reps'])}; rel = max|diff| / max|xla|")
    table = Table([("T", 6), ("kernel ms", 10), ("xla ms", 10), ("xla/kernel", 10), ("compile s k/x", 13),
                   ("rel out", 9), ("rel dq", 9), ("rel dk", 9), ("rel dv", 9), ("close", 5)])
    ok, last, last_t = True, None, None
    for t in s["attn_lengths"]:
        # causal attention: the run time grows with T^2
        reason = budget.skip_reason(f"T={t} and longer", predict(last, (t / last_t) ** 2 if last_t else 1.0))
        if reason:
            table.note(reason)
            break
        try:
            args = normal_arrays(t, ((1, t, h, dq), jnp.bfloat16), ((1, t, h, dq), jnp.bfloat16),
                                 ((1, t, h, dv), jnp.bfloat16), ((1, t, h, dv), jnp.float32))  # q, k, v, w

            def fwd_bwd(q, k, v, w, f):
                seg = jnp.ones(q.shape[:2], jnp.int32)  # one document

                def loss(q, k, v):
                    out = f(q, k, v, seg, scale=scale)
                    return jnp.sum(out.astype(jnp.float32) * w), out
                (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
                return out, grads

            res_k, ck, tk, rk = compile_and_time(functools.partial(fwd_bwd, f=kernel_fn), args, s["reps"])
            ref_bytes = 4 * h * t * t * 4  # scores, probabilities and their gradients, float32
            if mem is not None and ref_bytes > 0.7 * mem:
                table.row(t, tk * 1e3, "-", "-", f"{ck:.1f}/-", "-", "-", "-", "-", "-")
                table.note(f"T={t}: reference skipped, its [H,T,T] float32 tensors need ~{ref_bytes / 2**30:.0f} GiB "
                           f"of {mem / 2**30:.0f} GiB")
                table_rows.append(dict(T=t, kernel_ms=tk * 1e3, compile_kernel_s=ck, reference="skipped: memory"))
                last, last_t = dict(compile=ck, run=rk), t
                continue
            res_x, cx, tx, rx = compile_and_time(functools.partial(fwd_bwd, f=ak.reference_attention), args,
                                                 s["reps"])
            (o_k, g_k), (o_x, g_x) = res_k, res_x
            rels = [float(r) for r in rel_diffs([(o_k, o_x)] + list(zip(g_k, g_x)))]
            ok &= record_comparison(table, table_rows, t, (tk, tx), (ck, cx), rels, ("out", "dq", "dk", "dv"))
            last, last_t = dict(compile=ck + cx, run=rk + rx), t
            if ctx.platform == "gpu" and ctx.interpret is None:
                # the other way to flash-attend MLA on GPUs: cuDNN, which wants one width for q, k
                # and v (V zero-padded to dq) and has no segment ids (fine here: one document)
                def cudnn(q, k, v, seg, scale):
                    vp = jnp.pad(v, [(0, 0)] * 3 + [(0, dq - dv)])
                    out = jax.nn.dot_product_attention(q, k, vp, is_causal=True, scale=scale, implementation="cudnn")
                    return out[..., :dv]
                try:
                    _, cc, tc, _ = compile_and_time(functools.partial(fwd_bwd, f=cudnn), args, s["reps"])
                    table.note(f"T={t}: cuDNN (V padded to {dq}) {tc * 1e3:.2f} ms fwd+bwd, the kernel {tk * 1e3:.2f} ms "
                               f"(kernel/cuDNN {tk / tc:.2f}; compile {cc:.1f} s)")
                    table_rows[-1]["cudnn_padded_v_ms"] = tc * 1e3
                except Exception as e:  # noqa: BLE001 - a note: cuDNN is the comparison, not the path
                    table.note(f"T={t}: cuDNN failed: {type(e).__name__}: {str(e)[:200]}")
            del res_k, res_x, args
        except Exception as e:  # noqa: BLE001 - reported in the table and the summary
            ok = record_error(table, table_rows, e, T=t)
            last, last_t = None, None
        gc.collect()
    return ok


# ============================================================================ 3. MoE grouped matmul
def part_moe(ctx: Context, budget: Budget, table_rows: list) -> bool:
    from coder.model import grouped_matmul as gm

    s = ctx.s
    m, k, n, g = s["moe_shape"]
    forms = {"ragged_dot": jax.lax.ragged_dot, "block": gm.block_grouped_matmul}
    if ctx.platform == "tpu" or ctx.kernel_backend == "pallas_tpu":
        forms["megablox"] = functools.partial(gm.megablox_grouped_matmul, interpret=ctx.interpret is not None)
    print(f"MoE grouped matmul: x [{m},{k}] (routed pairs sorted by expert) x w [{g},{k},{n}] bf16, uneven "
          f"groups (a Gaussian's quantiles); fwd+bwd (dx, dw) in one program, {timing(s['reps'])}; "
          f"TFLOP/s counts the routed pairs' FLOPs only (3 x 2 M K N); rel = max|diff| / max|truth| "
          f"of out, dx, dw, truth = block on float32 operands; grouped_matmul takes block on GPU and "
          f"CPU, megablox on TPU")
    table = Table([("form", 10), ("ms", 9), ("TFLOP/s", 9), ("compile s", 9), ("rel out", 9), ("rel dx", 9),
                   ("rel dw", 9)])
    x, w, wgt, ids = normal_arrays(m, ((m, k), jnp.bfloat16), ((g, k, n), jnp.bfloat16), ((m, n), jnp.float32),
                                   ((m,), jnp.float32))
    # a Gaussian's quantiles: uneven groups, not the equal split a balanced router gives
    sizes = jnp.bincount(jnp.floor((ids - ids.min()) / (ids.max() - ids.min() + 1e-6) * g).astype(jnp.int32),
                         length=g)

    def fwd_bwd(x, w, f):
        def loss(x, w):
            out = f(x, w, sizes)
            return jnp.sum(out.astype(jnp.float32) * wgt), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        return out, grads

    flops = 3 * 2 * m * k * n
    truth, _, _, _ = compile_and_time(functools.partial(fwd_bwd, f=gm.block_grouped_matmul),
                                      (x.astype(jnp.float32), w.astype(jnp.float32)), 0)
    ok, last = True, None
    for name, f in forms.items():
        reason = budget.skip_reason(f"{name} and the rest", predict(last, 1.0))
        if reason:
            table.note(reason)
            break
        try:
            res, c, t, r = compile_and_time(functools.partial(fwd_bwd, f=f), (x, w), s["reps"])
            (o, (dx, dw)), (o_f, (dx_f, dw_f)) = res, truth
            rels = [float(v) for v in rel_diffs([(o, o_f), (dx, dx_f), (dw, dw_f)])]
            close = all(v <= REL_TOL for v in rels)
            table.row(name, t * 1e3, flops / t / 1e12, c, *rels)
            table_rows.append(dict(form=name, ms=t * 1e3, tflops=flops / t / 1e12, compile_s=c,
                                   **{f"rel_{q}": v for q, v in zip(("out", "dx", "dw"), rels)}, close=close))
            ok &= close
            last = dict(compile=c, run=r)
            del res
        except Exception as e:  # noqa: BLE001 - one form failing leaves the others to run
            ok = record_error(table, table_rows, e, form=name)
        gc.collect()
    return ok


# ============================================================================ 4. training step
def model_cfg(ctx: Context, **overrides):
    """The ~1B MoE (MODEL_1B) on an accelerator, configs/base.py's tiny model in a dry run."""
    from configs.base import model_config

    m = model_config()
    # dry run: one dense trunk layer and the MTP module, whose block is an MoE layer: the fewest
    # layers that keep every path (compiling is most of a dry run's time)
    m.update(dict(num_hidden_layers=1) if ctx.dry else MODEL_1B)
    m.update(overrides)
    return m


def peak_flops(ctx: Context) -> tuple[float | None, str]:
    """(published dense bf16 peak FLOP/s of one device, its source), or (None, why not)."""
    from coder.train.aot.hardware import CHIPS

    for chip in CHIPS.values():
        if chip.device_kind == ctx.kind:
            return chip.peak_bf16_flops, f"TPU {chip.name} (coder.train.aot.hardware)"
    if ctx.kind in GPU_PEAK_BF16:
        return GPU_PEAK_BF16[ctx.kind], "NVIDIA data sheet (GPU_PEAK_BF16)"
    return None, f"device kind {ctx.kind!r} is not in the chip tables"


def random_batch(rows: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """One packed-batch dict (docs/contracts.md), every row one document: tokens, positions,
    segment_ids int32 [rows, seq], loss_mask float32 [rows, seq]."""
    rng = np.random.default_rng(seed)
    return dict(tokens=rng.integers(1, vocab, (rows, seq), dtype=np.int32),
                positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
                segment_ids=np.ones((rows, seq), np.int32),
                loss_mask=np.ones((rows, seq), np.float32))


# device kind -> the committed compiled report of part train's step (configs/moe_1b.py, 8 x 2048:
# docs/scale/configs.py "moe_1b,h100"), whose serial bound is printed beside the measured step
COMPILED_TRAIN = {"NVIDIA H100 80GB HBM3": "moe_1b_h100", "NVIDIA H200": "moe_1b_h200", "NVIDIA B200": "moe_1b_b200"}


def compiled_estimate(kind: str, rows: int, seq: int) -> dict | None:
    """The committed report's serial bound (at peak, and at the H100's measured rates where it
    has them) for part train's step on this device kind, None without one or for another batch."""
    name = COMPILED_TRAIN.get(kind)
    path = ROOT / "docs" / "scale" / str(name) / "report.json"
    if name is None or not path.exists():
        return None
    with open(path) as f:
        r = json.load(f)
    if [r["setup"]["batch"], r["setup"]["seq_len"]] != [rows, seq]:
        return None
    measured = r.get("roofline_measured", {})
    return dict(report=f"docs/scale/{name}", serial_ms=r["roofline"]["step_time_serial_s"] * 1e3,
                lower_ms=r["roofline"]["step_time_lower_s"] * 1e3,
                measured_rates_serial_ms=measured.get("step_time_serial_s", 0.0) * 1e3 or None)


def part_train(ctx: Context, budget: Budget, table_rows: list) -> bool:
    from coder.model import count_params
    from coder.train import metrics
    from coder.train.balancing import router_balancing
    from coder.train.losses import lm_loss_fn
    from coder.train.trainer import Trainer
    from configs.base import get_config

    s = ctx.s
    c = get_config()
    c.model = model_cfg(ctx)
    c.workdir = ctx.workdir
    rows = s["train_rows"] * jax.device_count()  # the batch splits over every device (mesh data=-1)
    seq = s["train_seq"]
    c.data.seq_len, c.data.batch_size = seq, rows
    n = count_params(c.model)
    peak, source = peak_flops(ctx)
    print(f"training step: coder.train.trainer.Trainer.train_step, AdamW, {c.model.dtype} compute / "
          f"{c.model.param_dtype} params; {n['total'] / 1e9:.3f}B params ({n['active'] / 1e9:.3f}B active, "
          f"+{n['mtp'] / 1e6:.0f}M MTP), {c.model.num_hidden_layers} trunk layer(s), {c.model.n_routed_experts} "
          f"experts top-{c.model.num_experts_per_tok}; batch {rows} x {seq}; {jax.device_count()} {ctx.kind} device(s)")
    print(f"peak: {source}" + (f", {peak / 1e12:.1f} TFLOP/s per device" if peak else " -> MFU n/a"))
    t0 = time.perf_counter()
    trainer = Trainer(c, os.path.join(ctx.workdir, "train"), lm_loss_fn(c.train), stage="bench",
                      post_update=router_balancing(c.model))
    setup_s = time.perf_counter() - t0  # model and optimizer state initialised on the device
    try:
        batch = random_batch(rows, seq, c.model.vocab_size)
        t0 = time.perf_counter()
        first = trainer.train_step(batch)  # compiles
        block(first)
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        block(trainer.train_step(batch))  # one step alone: sizes the timed loop to the budget
        one = time.perf_counter() - t0
        steps = max(1, min(s["train_steps"], int((budget.seconds - budget.spent) * 0.5 / max(one, 1e-9))))
        t0 = time.perf_counter()
        for _ in range(steps):
            last = trainer.train_step(batch)
        block(last)
        step_s = (time.perf_counter() - t0) / steps
        skipped = int(trainer.nonfinite_total)
        ctx.model = (c.model, trainer.model)  # its params only: the optimizer state goes with the trainer
    finally:
        trainer.close()
        del trainer
        gc.collect()
    tokens_s = rows * seq / step_s
    flops_tok = metrics.model_flops_per_token(c.model, seq)
    achieved = tokens_s * flops_tok  # model FLOP/s of all devices
    n_dev = jax.device_count()
    matmul = metrics.measure_peak_flops(256 if ctx.dry else 8192)  # all local devices together
    mfu = achieved / (peak * n_dev) if peak else None
    table = Table([("setup s", 7), ("1st step s", 10), ("step ms", 9), ("tokens/s", 10), ("model TFLOP/s", 13),
                   ("peak TFLOP/s", 12), ("MFU", 7), ("matmul TFLOP/s", 14), ("of matmul", 9),
                   ("loss first", 10), ("loss last", 10), ("steps", 5)])
    table.row(setup_s, first_s, step_s * 1e3, tokens_s, achieved / 1e12, f"{peak * n_dev / 1e12:.1f}" if peak else "n/a",
              f"{mfu:.1%}" if mfu is not None else "n/a", matmul / 1e12, f"{achieved / matmul:.1%}",
              float(first["loss"]), float(last["loss"]), steps)
    table.note(f"setup: Trainer(...) (model + optimizer init); 1st step: compile + run; step: mean of {steps} "
               f"after it; model FLOPs/token {flops_tok / 1e9:.3f} G (6 N + 3 A at T={seq}); matmul: bf16 on "
               f"accelerators, f32 on CPU (coder.train.metrics.measure_peak_flops)")
    estimate = compiled_estimate(ctx.kind, rows, seq)
    if estimate:
        at_rates = estimate["measured_rates_serial_ms"]
        table.note(f"compiled estimate ({estimate['report']}): serial bound {estimate['serial_ms']:.0f} ms at peak "
                   f"rates (perfect overlap {estimate['lower_ms']:.0f} ms)"
                   + (f", {at_rates:.0f} ms at the H100's measured rates" if at_rates else "")
                   + f"; measured {step_s * 1e3:.0f} ms")
    finite = skipped == 0 and math.isfinite(float(last["loss"]))
    if not finite:
        table.note(f"non-finite loss or gradient: {skipped} step(s) skipped")
    table_rows.append(dict(params=n["total"], active=n["active"], batch=[rows, seq], setup_s=setup_s, first_step_s=first_s,
                           compiled_estimate=estimate,
                           step_ms=step_s * 1e3, tokens_per_s=tokens_s, model_tflops=achieved / 1e12,
                           peak_tflops=peak * n_dev / 1e12 if peak else None, peak_source=source, mfu=mfu,
                           matmul_tflops=matmul / 1e12, of_matmul=achieved / matmul,
                           loss_first=float(first["loss"]), loss_last=float(last["loss"]), timed_steps=steps,
                           skipped_steps=skipped))
    return finite


# ============================================================================ 5. engine
def timed_decode(engine, prompt: list, rows: int, params, reps: int) -> dict:
    """`rows` rows of `prompt` decoded by `engine`: one warm-up generate (it compiles), then
    `reps` timed ones, each after its own start_group (the prefill is not timed).

    -> tokens/s and seconds per decode step of the fastest call; per call: host calls, decode
    steps, tokens per row per step, slot occupancy, draft acceptance (speculative engines);
    compiles during the timed calls (0: the timing is clean); the first row's tokens."""
    t0 = time.perf_counter()
    group = engine.start_group(prompt, rows)
    engine.generate(group, params, jax.random.key(0))
    group.close()
    warm = time.perf_counter() - t0
    before = engine.stats()
    best, emitted, recompiles, first_row = math.inf, 0, 0, None
    for r in range(reps):
        group = engine.start_group(prompt, rows)  # may compile a prefill for the pool the warm-up grew
        compiled = engine.num_compilations
        t0 = time.perf_counter()
        gens = engine.generate(group, params, jax.random.key(1 + r))
        dt = time.perf_counter() - t0
        recompiles += engine.num_compilations - compiled
        group.close()
        if dt < best:
            best, emitted = dt, sum(len(g.tokens) for g in gens)
        first_row = list(gens[0].tokens)
    after = engine.stats()
    per_call = {k: (after[k] - before[k]) / reps for k in after if k in before and k not in ("occupancy",
                                                                                            "rows_per_step")}
    steps = max(per_call["decode_steps"], 1)
    return dict(tokens_per_s=emitted / best, step_s=best / steps, warm_s=warm, host_calls=per_call["decode_calls"],
                steps=per_call["decode_steps"], tokens_per_step=emitted / rows / steps,
                occupancy=per_call["row_steps"] / max(per_call["slot_steps"], 1),
                accept=per_call["accepted"] / per_call["drafted"] if per_call.get("drafted") else None,
                recompiles=recompiles, first_row=first_row)


def part_engine(ctx: Context, budget: Budget, table_rows: list) -> bool:
    from coder.infer.engine import Engine, SamplingParams

    s = ctx.s
    if ctx.model is not None:
        (cfg, model), source = ctx.model, "part 4's model after its steps"
        ctx.model = None
    else:  # part 4 did not run (or failed): the same config, initialised by one jitted program
        from coder.train.state import build_model
        from configs.base import get_config

        c = get_config()
        c.model = cfg = model_cfg(ctx)
        model, source = build_model(c), "freshly initialised"
    prompt_len, new, steps = s["engine_prompt"], s["engine_new"], s["engine_decode_steps"]
    reps = max(1, s["reps"])  # the warm-up generate compiles: at least one more is timed
    prompt = np.random.default_rng(0).integers(5, cfg.vocab_size, prompt_len).tolist()

    def engine(rows, k=0):
        # bf16 serving weights (Engine casts every floating leaf), as a trainer hands them over;
        # one length bucket holding the whole row: the cache is never resized, so the warm-up
        # compiles every program the timed calls run (prompts are prefilled padded to it)
        max_len = prompt_len + new + 8
        return Engine(model, cfg, max_len=max_len, batch_buckets=(rows,), len_buckets=(max_len,), max_slots=rows,
                      decode_steps=steps, speculative_k=k, dtype="bfloat16")

    print(f"engine decode: coder.infer.engine.Engine, {source}, bf16 weights, {cfg.num_hidden_layers} trunk layer(s), "
          f"hidden {cfg.hidden_size}; one {prompt_len}-token prompt, {new} new tokens per row (greedy at batch 1, "
          f"sampled at T=1 above), {steps} decode steps per host call; generate() alone timed (not the "
          f"prefill of start_group), best of {reps} after a warm-up")
    table = Table([("batch", 5), ("tokens/s", 10), ("ms/step", 8), ("warm-up s", 9), ("host calls", 10),
                   ("occupancy", 9), ("compiles in timed", 17)])
    ok, last, last_b, plain1 = True, None, None, None
    for b in s["engine_batches"]:
        reason = budget.skip_reason(f"batch {b} and larger", predict(last, b / last_b if last_b else 1.0))
        if reason:
            table.note(reason)
            break
        eng = engine(b)
        try:
            params = SamplingParams(temperature=0.0 if b == 1 else 1.0, max_new_tokens=new)
            r = timed_decode(eng, prompt, b, params, reps)
            table.row(b, r["tokens_per_s"], r["step_s"] * 1e3, r["warm_s"], r["host_calls"], r["occupancy"],
                      r["recompiles"])
            table_rows.append(dict(kind="decode", batch=b, **{k: v for k, v in r.items() if k != "first_row"}))
            last, last_b = dict(compile=r["warm_s"], run=reps * b * new / r["tokens_per_s"]), b
            plain1 = r if b == 1 else plain1
        except Exception as e:  # noqa: BLE001 - reported in the table and the summary
            ok = False
            table.note(f"batch {b}: ERROR {type(e).__name__}: {str(e)[:500]}")
            table_rows.append(dict(kind="decode", batch=b, error=f"{type(e).__name__}: {str(e)[:500]}"))
        finally:
            eng.close()
        gc.collect()
    if cfg.num_mtp_layers < 1 or plain1 is None:
        table.note("MTP drafts skipped: " + ("the model has no MTP module" if plain1 is not None
                                              else "no batch-1 plain decode to compare with"))
        return ok

    # MTP drafts (speculative_k = 1: the MTP module drafts one token, the main model verifies it
    # with the next one in a 2-token step) beside the plain batch-1 decode above, same prompt
    reason = budget.skip_reason("MTP speculative decoding", 1.5 * (plain1["warm_s"] + reps * new * plain1["step_s"]))
    if reason:
        table.note(reason)
        return ok
    print("MTP speculative decoding: Engine(speculative_k=1), batch 1, greedy, the same prompt, beside the plain "
          "batch-1 decode; untrained weights: the acceptance is not a trained module's, the step time is real")
    spec = Table([("k", 3), ("tokens/s", 10), ("x plain", 8), ("tok/step", 8), ("ms/step", 8), ("accept", 7),
                  ("greedy==plain", 13), ("break-even accept", 17), ("compiles in timed", 17)])
    spec.row(0, plain1["tokens_per_s"], 1.0, plain1["tokens_per_step"], plain1["step_s"] * 1e3, "-", "-", "-",
             plain1["recompiles"])
    eng = engine(1, k=1)
    try:
        r = timed_decode(eng, prompt, 1, SamplingParams(temperature=0.0, max_new_tokens=new), reps)
        same = r["first_row"] == plain1["first_row"]
        # drafting pays off when (1 + acceptance) / t_spec > 1 / t_plain
        breakeven = r["step_s"] / plain1["step_s"] - 1.0
        spec.row(1, r["tokens_per_s"], r["tokens_per_s"] / plain1["tokens_per_s"], r["tokens_per_step"],
                 r["step_s"] * 1e3, r["accept"], str(same), breakeven, r["recompiles"])
        spec.note("greedy==plain is informational: bf16 rounding of a 2-token verify step can flip near-tied argmaxes")
        table_rows.append(dict(kind="mtp", k=1, x_plain=r["tokens_per_s"] / plain1["tokens_per_s"], greedy_equal=same,
                               breakeven_accept=breakeven, **{k: v for k, v in r.items() if k != "first_row"}))
    except Exception as e:  # noqa: BLE001 - reported in the table and the summary
        ok = False
        spec.note(f"ERROR {type(e).__name__}: {str(e)[:500]}")
        table_rows.append(dict(kind="mtp", error=f"{type(e).__name__}: {str(e)[:500]}"))
    finally:
        eng.close()
    return ok


# ============================================================================ main
# NSA runs last by default: its budget is the largest, and on an H100 its kernels sat at XLA's
# speed (docs/accelerator.md), so its longer sizes are what a tight deadline should cut first
DEFAULT_ORDER = ("attention", "moe", "train", "engine", "nsa")
PARTS = (("nsa", part_nsa), ("attention", part_attention), ("moe", part_moe), ("train", part_train),
         ("engine", part_engine))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, kernels in interpret mode")
    ap.add_argument("--cpu-kernels", default="pallas_tpu", choices=("pallas_tpu", "pallas_gpu"),
                    help="whose kernels the dry run interprets")
    ap.add_argument("--parts", default=",".join(DEFAULT_ORDER), help="comma-separated parts, run in the order given")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiplies every part's budget and the deadline")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if jax.devices()[0].platform == "cpu" and not args.dry_run:
        print("no accelerator (jax.devices() is CPU): run on a GPU / TPU host, or pass --dry-run", flush=True)
        return 2
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(chosen) - {p for p, _ in PARTS})
    if unknown:
        print(f"unknown parts {unknown}; choose from {[p for p, _ in PARTS]}", flush=True)
        return 2
    ctx = Context(args)
    summary = dict(device=ctx.kind, platform=ctx.platform, devices=jax.device_count(), jax=jax.__version__,
                   dry_run=ctx.dry, kernels=ctx.kernel_backend, parts={})
    state = {"part": None}

    def emit(code: int):
        summary["wall_s"] = round(time.perf_counter() - t_start, 1)
        summary["exit_code"] = code
        print("SUMMARY " + json.dumps(summary, default=str), flush=True)

    deadline = ctx.s["deadline"] * args.time_scale

    def watchdog():
        # a hung compile cannot be interrupted from Python: report what ran and leave
        name = state["part"]
        print(f"\n[watchdog] {deadline:.0f} s passed during part {name!r}: stopping", flush=True)
        if name is not None:
            summary["parts"].setdefault(name, {})["status"] = "timeout"
        emit(3)
        shutil.rmtree(ctx.workdir, ignore_errors=True)
        os._exit(3)

    timer = threading.Timer(deadline, watchdog)
    timer.daemon = True
    timer.start()
    print(f"# accelerator check: {ctx.kind} ({ctx.platform}) x {jax.device_count()}, jax {jax.__version__}, "
          f"kernels {ctx.kernel_backend}{' in interpret mode' if ctx.interpret else ''}"
          f"{', DRY RUN (timings meaningless)' if ctx.dry else ''}; memory pool "
          f"XLA_PYTHON_CLIENT_MEM_FRACTION={MEM_FRACTION}", flush=True)
    summary["mem_fraction"] = MEM_FRACTION
    failed = []
    for name in chosen:  # in the order given: what matters most first when the deadline is near
        fn = dict(PARTS)[name]
        state["part"] = name
        budget = Budget(ctx.s["budgets"][name] * args.time_scale)
        rows: list = []
        record = summary["parts"][name] = dict(status="running", rows=rows)
        print(f"\n## part {name} (budget {budget.seconds:.0f} s)", flush=True)
        cpu0 = time.process_time()
        try:
            good = fn(ctx, budget, rows)
            # a part whose budget ran out before its first size measured nothing, and says so
            record["status"] = "failed" if not good else "ok" if rows else "skipped"
        except Exception as e:  # noqa: BLE001 - reported; the next part still runs
            traceback.print_exc()
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
            record.update(status="failed", error=f"{type(e).__name__}: {str(e)[:1000]}")
        record["wall_s"] = round(budget.spent, 1)
        record["cpu_s"] = round(time.process_time() - cpu0, 1)  # host CPU of all threads
        if record["status"] == "failed":
            failed.append(name)
        print(f"[{name}] {record['status']} in {budget.spent:.1f} s (host cpu {record['cpu_s']:.1f} s)", flush=True)
        jax.clear_caches()  # the part's compiled programs go (and its arrays, below) before the next
        gc.collect()
    timer.cancel()
    shutil.rmtree(ctx.workdir, ignore_errors=True)  # the trainer's (empty) stage directory
    code = 1 if failed else 0
    print(f"\n# done in {time.perf_counter() - t_start:.0f} s; "
          + (f"FAILED: {', '.join(failed)}" if failed else "every part ok"), flush=True)
    emit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
