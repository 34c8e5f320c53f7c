"""Training metrics: model FLOPs (the one MFU definition), expert load imbalance, the writers.

Every stage writes `{stage_dir}/metrics.jsonl` (one JSON object per logged step, at least `step`
and `loss`), TensorBoard event files under `{stage_dir}/tb/`, and a console progress line.
Only process 0 writes (multi-host runs log the same global metrics on every host).
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from coder.model import Transformer

# ============================================================================ model FLOPs
# The one definition of model FLOPs (the training log's MFU, stage `compile`'s report for the
# training step and the engine programs, bench/). A token's model FLOPs:
#
#   training (forward + backward):  6 N + 3 A
#   inference (forward only):       2 N + A
#
# N = the matmul weights one token multiplies by (`active_matmul_params`):
#     trunk: every block's MLA projections (q_proj, or q_a_proj + q_b_proj; kv_a_proj, kv_b_proj,
#            o_proj), dense SwiGLU, router, shared experts, and the routed experts at
#            num_experts_per_tok / n_routed_experts of their weights;
#     the output head D x V (lm_head, or the embedding when tied);
#     each MTP module a token passes through: its eh_proj and block (as above) and its use of
#            the shared output head (D x V again);
#     not counted: the input embedding (a gather, no matmul), norm weights and other vectors.
#     NSA backend: its gate projection; its compressors (run once per compress_stride tokens) at
#            1 / compress_stride of their weights; its block position embedding is an addition.
# A = forward attention FLOPs of one token, summed over the layers it passes (trunk + those MTP
#     modules), `attention_flops_per_token`:
#     dense MLA: per head and (query, key) pair, QK^T over dq = qk_nope_head_dim +
#            qk_rope_head_dim features and AV over v_head_dim: 2 (dq + dv) FLOPs; a query
#            attends to T/2 keys on average in a causal row of T tokens (T^2/2 pairs; the exact
#            T(T+1)/2 adds the diagonal, dropped), or to `context` keys when decoding against a
#            cache of that many tokens. So 2 H (dq + dv) T/2 = H (dq + dv) T per layer; the
#            backward pass runs two matmuls per forward one (dP and dV for AV, dQ and dK for
#            QK^T): x3 for training (PaLM, Chowdhery et al. 2022, appendix B).
#     NSA: the absorbed form it runs (per head, QK^T over kv_lora_rank + qk_rope_head_dim,
#            AV over kv_lora_rank) for the keys of its three branches: compressed blocks
#            (causal T / (2 compress_stride)), selected blocks (select_topk x select_block)
#            and the window, each capped causally.
# Model FLOPs do not count recomputation (remat), padding of expert groups, the softmax and
# norms, or the optimizer; the attention term covers the whole row (packed documents are not
# discounted). A stage that freezes part of the model (mtp) still counts the whole
# forward + backward: its MFU is an upper bound.

_ROUTED = ("wg", "wu", "wd")  # routed experts [E, in, out]: a token uses top-k of E
_ADDED = ("pos", "gate_b")  # NSA's block position embedding and gate bias: added, no matmul
_STACKS = ("moe_stack",)  # stacked layers (model.scan_layers): one more leading axis
_COMPRESSORS = ("compress_k", "compress_v")  # NSA: run once per compress_stride tokens


def matmul_params(model_cfg, params=None) -> dict:
    """Matmul weights per token by part: {"trunk", "head", "mtp"} (floats; module comment above).

    trunk: the trunk's blocks; head: the output projection D x V (counted once; each MTP module
    uses it again); mtp: all MTP modules' own matmuls (eh_proj + block), without the head.
    params: the model's nnx.Param state (e.g. a custom model's); default the Transformer of
    `model_cfg`, from abstract shapes (nothing is allocated).
    """
    from flax import nnx

    if params is None:
        abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
        params = nnx.state(abstract, nnx.Param)
    top_k = model_cfg.num_experts_per_tok / model_cfg.n_routed_experts
    stride = int(model_cfg.nsa.compress_stride)
    out = dict(trunk=0.0, head=0.0, mtp=0.0)
    for path, v in nnx.to_flat_state(params):
        names = [str(p) for p in path]
        shape = tuple(v.get_value().shape)
        n = float(math.prod(shape))
        if names[0] in ("embed", "lm_head"):
            if names[0] == "lm_head" or model_cfg.tie_word_embeddings:
                out["head"] += n  # the embedding itself is a lookup
            continue
        per_layer_ndim = len(shape) - sum(1 for s in names if s in _STACKS)
        if per_layer_ndim < 2 or names[-1] in _ADDED:
            continue  # norm weights and other vectors, additive tables
        if names[-1] in _ROUTED:
            n *= top_k
        elif any(s in _COMPRESSORS for s in names):
            n /= stride
        out["mtp" if names[0] == "mtp" else "trunk"] += n
    return out


def active_matmul_params(model_cfg, *, mtp_modules: int | None = None, params=None) -> float:
    """N: matmul weights one token multiplies by through the trunk, the output head and
    `mtp_modules` MTP modules (default all of them; each uses the shared head again)."""
    p = matmul_params(model_cfg, params)
    n_mtp = int(model_cfg.num_mtp_layers)
    m = n_mtp if mtp_modules is None else int(mtp_modules)
    per_module = p["mtp"] / n_mtp if n_mtp else 0.0
    return p["trunk"] + p["head"] + m * (per_module + p["head"])


def _keys(seq_len: int, cap: float, context: int | None) -> float:
    """Keys a query attends to, at most `cap`: mean over a causal row of seq_len tokens (the
    continuous T/2 convention: cap - cap^2 / (2T) when cap < T), or min(context, cap)."""
    if context is not None:
        return float(min(context, cap))
    t = float(seq_len)
    return t / 2 if cap >= t else cap - cap * cap / (2 * t)


def attention_flops_per_token(model_cfg, seq_len: int, *, layers: int | None = None,
                              context: int | None = None) -> float:
    """A: forward attention FLOPs of one token over `layers` MLA layers (default the trunk + all
    MTP modules): 2 H (QK width + AV width) per key (module comment above).

    seq_len: the row the token sits in (causal: seq_len/2 keys on average); context: decoding,
    every query attends to a cache of this many tokens instead.
    """
    m = model_cfg
    layers = m.num_hidden_layers + m.num_mtp_layers if layers is None else layers
    h = m.num_attention_heads
    if m.attention_backend == "nsa":
        nsa = m.nsa
        width = 2 * m.kv_lora_rank + m.qk_rope_head_dim  # absorbed: QK over r + dr, AV over r
        stride = int(nsa.compress_stride)
        keys = (_keys(seq_len, math.inf, context) / stride
                + _keys(seq_len, int(nsa.select_topk) * int(nsa.select_block), context)
                + _keys(seq_len, int(nsa.window), context))
    else:
        width = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
        keys = _keys(seq_len, math.inf, context)
    return 2.0 * layers * h * width * keys


def model_flops_per_token(model_cfg, seq_len: int, *, training: bool = True,
                          mtp_modules: int | None = None, context: int | None = None,
                          params=None) -> float:
    """Model FLOPs of one token: 6 N + 3 A (training) or 2 N + A (`training=False`, forward only).

    N = active_matmul_params, A = attention_flops_per_token over the trunk and `mtp_modules` MTP
    modules (default all; an inference program passes the ones it runs); seq_len / context as
    in attention_flops_per_token; params: a custom model's Param state (matmul_params).
    MFU = tokens/s x this / peak FLOP/s.
    """
    m = int(model_cfg.num_mtp_layers) if mtp_modules is None else int(mtp_modules)
    n = active_matmul_params(model_cfg, mtp_modules=m, params=params)
    a = attention_flops_per_token(model_cfg, seq_len, layers=model_cfg.num_hidden_layers + m,
                                  context=context)
    return 6.0 * n + 3.0 * a if training else 2.0 * n + a


def measure_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """Aggregate matmul FLOP/s of all local devices (used for MFU when no peak is configured).

    One `[D*n, n] @ [n, n]` matmul sharded over the D devices along its rows, in the dtype the
    devices run fastest (bfloat16 on TPU/GPU, float32 on CPU); best of `repeats`.
    """
    devices = jax.local_devices()
    dtype = jnp.float32 if devices[0].platform == "cpu" else jnp.bfloat16
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    a = jax.device_put(jnp.ones((len(devices) * n, n), dtype), rows)
    b = jax.device_put(jnp.ones((n, n), dtype), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    mm = jax.jit(lambda x, y: x @ y, out_shardings=rows)
    mm(a, b).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * len(devices) * n**3 / best


def load_imbalance(router_load):
    """Expert load imbalance: max / mean routed load over experts, worst layer (a jax scalar;
    jit-safe). The trainer logs it from the micro-batch mean of aux["router_load"].

    router_load: `[moe_layers, n_routed_experts]`, each row the fraction of the layer's
    (token, expert) pairs per expert (coder.model.routing.load_fraction: sums to 1). 1.0 = balanced;
    the maximum is n_routed_experts / num_experts_per_tok (an expert can be in a token's top-k
    once: at most 1/k of the pairs): every token routed to the same k experts.
    """
    load = jnp.asarray(router_load, jnp.float32)
    return jnp.max(jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-12))


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch where torch is not loaded yet.

    tensorboardX imports torch whenever it is installed (the test extra installs it) only to
    accept torch tensors, which coder never logs; that import is ~1 s of CPU in every stage
    process (measured: 1.02 of a GRPO test run's 7.3 s). `sys.modules[name] = None` makes
    `import name` raise ImportError, the branch tensorboardX takes when torch is absent; the
    entry is removed right after, so a later `import torch` works as usual."""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None
        try:
            import tensorboardX  # noqa: F401  (the import is the point)
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter  # heavy: tensorboardX (a writer only)

    return SummaryWriter


class MetricsWriter:
    """metrics.jsonl + TensorBoard + console line, on process 0 only."""

    def __init__(self, stage_dir: str, stage: str, *, tensorboard: bool = True,
                 resume_step: int | None = None):
        """resume_step: the step a stage resumed from; records past it (logged after that
        checkpoint by the interrupted run, and about to be logged again) are dropped."""
        self.stage = stage
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(stage_dir, "metrics.jsonl")
        # Object stores (gs://) cannot append: remote files are rewritten whole on each write.
        self._remote = "://" in stage_dir
        self._lines: list[str] = []
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        p = epath.Path(self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            self._lines = p.read_text().splitlines(keepends=True)
            if resume_step is not None:
                kept = [ln for ln in self._lines if json.loads(ln).get("step", 0) <= resume_step]
                if len(kept) < len(self._lines):
                    self._lines = kept
                    p.write_text("".join(kept))
        if not self._remote:
            self._file = open(self.path, "a")  # noqa: SIM115 (kept open for the stage)
        if tensorboard:
            try:
                self._tb = _summary_writer_class()(os.path.join(stage_dir, "tb"))
            except Exception as e:  # e.g. gs:// without google-cloud-storage installed
                logging.warning("TensorBoard events disabled for %s: %s", stage_dir, e)

    def write(self, step: int, metrics: dict, *, total_steps: int | None = None, eta_s=None):
        """Append one record (floats / ints only) and print the progress line."""
        record = {"step": int(step)}
        for k, v in metrics.items():
            v = float(v) if not isinstance(v, (int, str)) else v
            record[k] = v
        if not self.enabled:
            return record
        line = json.dumps(record) + "\n"
        if self._remote:
            self._lines.append(line)
            epath.Path(self.path).write_text("".join(self._lines))
        else:
            self._file.write(line)
            self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"{self.stage}/{k}", v, step)
        parts = [f"[{self.stage}] step {step}" + (f"/{total_steps}" if total_steps else "")]
        for key, fmt in (("loss", ".4f"), ("reward", ".3f"), ("pass_rate", ".3f"), ("grad_norm", ".3f"), ("lr", ".2e"),
                         ("tokens_per_s", ".0f"), ("mfu", ".2%"), ("load_imbalance", ".2f"),
                         ("perplexity", ".2f"), ("heldout_loss", ".4f")):
            if key in record and isinstance(record[key], float):
                parts.append(f"{key} {record[key]:{fmt}}")
        if eta_s is not None:
            parts.append(f"eta {_fmt_duration(eta_s)}")
        print("  ".join(parts), flush=True)
        return record

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
