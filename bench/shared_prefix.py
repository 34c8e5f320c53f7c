"""GRPO learner throughput with and without shared-prefix packing (grpo.shared_prefix_len).

One group of G rollouts: one prompt of P tokens (no loss) and G sampled completions of C tokens
each. Unshared (today's default, `coder.rl.trajectory.to_batch`): G rows of P + C tokens, the
prompt computed G times. Shared (`shared_prefix_rows` + `to_shared_batch`): one row holding the
prompt once and the G continuations (C + 1 tokens each: a continuation starts with the last
prompt token, whose logits predict its first sampled token). Rows are padded to a multiple of
128 tokens (the kernels' block), not to a power of two, so neither layout pays for padding the
other does not.

Measured: a jitted forward + backward of the GRPO loss (`coder.rl.grpo.grpo_loss_fn`, the
learner's loss) over the model's parameters, both layouts in one process, timed in alternation
(median of `--repeats` rounds), and their losses compared (equal up to float rounding).
Learner tokens/s = the group's rollout tokens G x (P + C) / step time, the same numerator for
both: the ratio is the speed-up. The shared layout's attention is the flash kernel on GPU
(coder/pallas/flash_gpu.py takes the prefix mask) and XLA on TPU and CPU (splash has no prefix
mask); the unshared one uses the platform's kernel on TPU / GPU (XLA on CPU).

    python bench/shared_prefix.py            # CPU-sized: quickstart model, P=1024, C=128, G=8
    python bench/shared_prefix.py --model 100m --prompt 512 --completion 64   # ~100M MoE (CPU memory)
    python bench/shared_prefix.py --full     # the issue's: P=8192, C=1024, G=8, ~100M MoE (accelerator)

Where the step is attention-bound (the quickstart model: hidden 128) the speed-up is below the
ratio of tokens computed: the shared row's XLA attention computes, and then masks, the scores
between continuations ([B,H,T,T] over the whole packed row); where the linear layers dominate
(wide models) it approaches the token ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from coder.model import Transformer, count_params  # noqa: E402
from coder.rl import grpo, trajectory  # noqa: E402


def model_config(name: str):
    from configs import quickstart
    from configs.base import model_config as base_model

    if name == "quickstart":
        m = quickstart.get_config().model
        m.max_position_embeddings = 1 << 14
        m.rope_scaling.original_max_position_embeddings = 1 << 14
        m.num_mtp_layers = 0
        return m
    m = base_model()  # bench/model_step.py's ~100M MoE
    m.update(dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=512,
                  num_hidden_layers=8, num_attention_heads=8, kv_lora_rank=128, qk_nope_head_dim=64,
                  qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=2,
                  n_group=4, topk_group=2, num_mtp_layers=0, max_position_embeddings=1 << 15))
    m.rope_scaling.original_max_position_embeddings = 1 << 15
    return m


def group(prompt_len: int, completion_len: int, g: int, vocab: int) -> list:
    """G rollouts of one prompt, each with its own sampled completion and advantage."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, vocab, prompt_len)
    out = []
    for i in range(g):
        w = trajectory.ContextWindow()
        w.add_context(prompt)
        w.add_sampled(types.SimpleNamespace(tokens=rng.integers(1, vocab, completion_len),
                                            logprobs=rng.normal(-3.0, 0.5, completion_len), policy_version=0))
        out.append(trajectory.Rollout(task_id="bench", generations=[w], advantage=float(rng.normal())))
    return out


def _round(n: int, m: int = 128) -> int:
    return -(-n // m) * m


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true",
                    help="the issue's sizes: P=8192, C=1024, the 100m model (accelerator)")
    ap.add_argument("--model", choices=("quickstart", "100m"), default="quickstart",
                    help="quickstart (hidden 128, 2 layers) or bench/model_step.py's ~100M MoE")
    ap.add_argument("--prompt", type=int, default=0, help="prompt tokens (default 1024; --full 8192)")
    ap.add_argument("--completion", type=int, default=0,
                    help="tokens per completion (default 128; --full 1024)")
    ap.add_argument("--group", type=int, default=8, help="rollouts per group (G)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per layout (median)")
    args = ap.parse_args()
    p = args.prompt or (8192 if args.full else 1024)
    c = args.completion or (1024 if args.full else 128)
    g = args.group
    cfg = model_config("100m" if args.full else args.model)
    if cfg.num_hidden_layers > 2:
        cfg.remat = "full"  # 8 layers' activations of 9k (CPU: 4.6k) tokens: recompute, do not keep
    if jax.default_backend() == "cpu":
        cfg.dtype = "float32"  # CPUs have no fast bfloat16 matmul (as configs/quickstart.py)
    rollouts = group(p, c, g, cfg.vocab_size)
    unshared = trajectory.to_batch(rollouts, _round(p + c))
    plan = trajectory.shared_prefix_rows([rollouts], _round(p + g * (c + 1)))
    shared = trajectory.to_shared_batch(plan, _round(p + g * (c + 1)))

    model = Transformer(cfg, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = grpo.grpo_loss_fn(clip_low=0.2, clip_high=0.28, kl_coef=0.001, normalizer=float(g * c),
                                temperature=1.0, tis_cap=2.0)

    def prepare(b):
        b = {k: jnp.asarray(v) for k, v in b.items() if k != "policy_version"}
        b["ref_logp"] = b["behaviour_logp"]  # the reference forward is not what is measured
        return b

    @jax.jit
    def step(params, batch):
        return jax.value_and_grad(lambda q: loss_fn(nnx.merge(graphdef, q, rest), batch, None)[0])(params)

    batches = {"unshared": prepare(unshared), "shared": prepare(shared)}
    times, losses = {k: [] for k in batches}, {}
    for name, b in batches.items():
        losses[name] = float(jax.block_until_ready(step(params, b))[0])  # compile + warm-up
    for _ in range(args.repeats):
        for name, b in batches.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, b))
            times[name].append(time.perf_counter() - t0)

    rollout_tokens = g * (p + c)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); model: "
          f"{count_params(cfg)['total'] / 1e6:.2f}M params, hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, dtype {cfg.dtype}")
    sizes = "the issue's sizes" if args.full else "scaled down from the issue's 8192 + 8 x 1024 for a CPU"
    print(f"group: G={g} rollouts, prompt {p} tokens, completions {c} tokens ({sizes}); "
          f"learner tokens/s = G x (P + C) = {rollout_tokens} rollout tokens / fwd+bwd step time "
          f"(median of {args.repeats})")
    for name, b in batches.items():
        rows, t = b["tokens"].shape
        sec = statistics.median(times[name])
        print(f"  {name:9s} batch [{rows} x {t}] ({rows * t} tokens computed): {sec * 1e3:9.1f} ms/step, "
              f"{rollout_tokens / sec:10.0f} learner tokens/s, loss {losses[name]:+.6f}")
    ratio = statistics.median(times["unshared"]) / statistics.median(times["shared"])
    print(f"speed-up shared / unshared: {ratio:.2f}x (goal >= 3x at the issue's sizes)")
    rtol = 1e-4 if cfg.dtype == "float32" else 2e-2  # bfloat16: the two layouts round differently
    if not np.isclose(losses["shared"], losses["unshared"], rtol=rtol, atol=1e-6):
        raise SystemExit(f"the two layouts' losses differ: {losses}")


if __name__ == "__main__":
    main()
