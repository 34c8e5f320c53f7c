"""Training metrics: FLOP accounting for MFU, expert load imbalance, and the writers.

Every stage writes `{stage_dir}/metrics.jsonl` (one JSON object per logged step, at least `step`
and `loss`), TensorBoard event files under `{stage_dir}/tb/`, and a console progress line.
Only process 0 writes (multi-host runs log the same global metrics on every host).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath


def flops_per_token(model_cfg, seq_len: int, active_params: int) -> float:
    """Training FLOPs per token: 6 N (forward + backward matmuls) plus causal attention.

    active_params: parameters touched per token (MoE: shared + top-k experts, not all experts).
    Attention per layer and token (forward): QK^T 2*T*d_qk*H and AV 2*T*d_v*H, halved by the
    causal mask; times 3 for forward + backward (the PaLM appendix B accounting).
    """
    d_qk = model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim
    d_v = model_cfg.v_head_dim
    attn = 3 * model_cfg.num_hidden_layers * model_cfg.num_attention_heads * seq_len * (d_qk + d_v)
    return 6.0 * active_params + attn


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


def load_imbalance(router_load) -> float:
    """max over experts / mean over experts of the routed load, worst layer. 1.0 = balanced.

    router_load: `[moe_layers, n_routed_experts]`, each row sums to 1.
    """
    load = np.asarray(router_load, np.float64)
    mean = load.mean(axis=-1, keepdims=True)
    return float(np.max(load.max(axis=-1, keepdims=True) / np.maximum(mean, 1e-12)))


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


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
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(os.path.join(stage_dir, "tb"))
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
        for key, fmt in (("loss", ".4f"), ("grad_norm", ".3f"), ("lr", ".2e"),
                         ("tokens_per_s", ".0f"), ("mfu", ".2%"), ("load_imbalance", ".2f"),
                         ("perplexity", ".2f")):
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
