"""Forward+backward throughput of the model on this machine, next to a dense matmul.

Prints, for the quickstart model (configs/base.py model defaults) and a ~100M-parameter MoE:
tokens/s of a jitted fwd+bwd step, the step's FLOPs from XLA's cost analysis, the achieved
FLOP/s, and that as a fraction of a dense f32 matmul's FLOP/s measured in the same run; and the
step's model FLOPs (coder.train.metrics.model_flops_per_token, the training log's MFU) per second
as the same fraction.

    python bench/model_step.py [--steps 5]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from coder.model import Transformer, count_params  # noqa: E402
from coder.train import metrics  # noqa: E402


def moe_100m():
    from configs.base import model_config

    m = model_config()
    m.update(dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=512,
                  num_hidden_layers=8, num_attention_heads=8, kv_lora_rank=128, qk_nope_head_dim=64,
                  qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=2,
                  n_group=4, topk_group=2, num_mtp_layers=1))
    return m


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def _time(fn, args, steps):
    jax.block_until_ready(fn(*args))  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def matmul_flops_per_s(n=2048, steps=5, dtype=jnp.float32):
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    return 2 * n ** 3 / _time(f, (a, b), steps)


def model_step(cfg, batch, seq, steps):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tok = jax.random.randint(jax.random.key(0), (batch, seq), 1, cfg.vocab_size, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    seg = jnp.ones((batch, seq), jnp.int32)

    def loss(state, tok, pos, seg):
        logits, aux = nnx.merge(graphdef, state)(tok, pos, seg)
        lp = jax.nn.log_softmax(logits[:, :-1])
        ce = -jnp.take_along_axis(lp, tok[:, 1:, None], -1).mean()
        mtp = jax.nn.log_softmax(aux["mtp_logits"][:, :, :-2]) if "mtp_logits" in aux else None
        if mtp is not None:
            ce = ce - 0.3 * jnp.take_along_axis(mtp[0], tok[:, 2:, None], -1).mean()
        return ce

    step = jax.jit(jax.value_and_grad(loss))
    compiled = step.lower(state, tok, pos, seg).compile()
    sec = _time(compiled, (state, tok, pos, seg), steps)
    return dict(params=count_params(cfg), tokens_per_s=batch * seq / sec, step_s=sec,
                flops=_flops(compiled))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from configs.base import model_config

    print(f"backend={jax.default_backend()} devices={jax.device_count()}")
    peak32 = matmul_flops_per_s(steps=args.steps)
    peak16 = matmul_flops_per_s(steps=args.steps, dtype=jnp.bfloat16)
    print(f"dense matmul 2048^3 at start: f32 {peak32 / 1e9:.1f} GFLOP/s, bf16 {peak16 / 1e9:.1f} GFLOP/s")
    for name, cfg, b, t in (("quickstart", model_config(), 8, 256), ("moe_100m", moe_100m(), 4, 256)):
        r = model_step(cfg, b, t, args.steps)
        # the machine may be shared: re-measure the matmul right after the model, keep the mean
        peak32 = (peak32 + matmul_flops_per_s(steps=args.steps)) / 2
        peak16 = (peak16 + matmul_flops_per_s(steps=args.steps, dtype=jnp.bfloat16)) / 2
        achieved = r["flops"] / r["step_s"]
        # model FLOPs of the step (coder.train.metrics: 6 N + 3 A per token, the training log's MFU)
        useful = metrics.model_flops_per_token(cfg, t) * b * t
        print(f"{name}: params total={r['params']['total'] / 1e6:.1f}M active={r['params']['active'] / 1e6:.1f}M "
              f"matmul f32 {peak32 / 1e9:.1f} bf16 {peak16 / 1e9:.1f} GFLOP/s; batch={b}x{t} step={r['step_s'] * 1e3:.0f}ms tokens/s={r['tokens_per_s']:.0f} "
              f"XLA flops/step={r['flops'] / 1e9:.2f}G achieved={achieved / 1e9:.1f} GFLOP/s "
              f"= {achieved / peak32:.2f} of f32 matmul, {achieved / peak16:.2f} of bf16 matmul; "
              f"model FLOPs/step={useful / 1e9:.2f}G -> {useful / r['step_s'] / peak32:.2f} of f32 matmul")


if __name__ == "__main__":
    main()
