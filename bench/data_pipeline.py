"""Input pipeline tokens/s against the tokens/s a ~100M-parameter training step consumes.

    python bench/data_pipeline.py [--steps 3] [--batches 300] [--workers 0]

Both sides run in this one process on the same machine, at the same batch shape
(config.data.batch_size x seq_len): the pipeline reads the bundled stdlib corpus, tokenizes it
with the corpus tokenizer (trained and cached on first use) and packs rows; the step is a jitted
`nnx.value_and_grad` of the next-token loss of `coder.model.Transformer` (with its MTP head
run, as in training) at a ~100M-total-parameter DeepSeek-V3-style config. The ratio
pipeline / step says how many times faster the input side is than what one host's training
step eats; it must stay well above 1.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coder.data import pretrain
from coder.data import tokenizer as tk
from coder.train import metrics
from configs import base


def model_config_100m():
    """~95M total / ~56M active parameters (count printed below)."""
    m = base.model_config()
    m.update(
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            intermediate_size=2048,
            moe_intermediate_size=256,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            vocab_size=4096,
            dtype="float32",  # CPUs have no fast bfloat16 matmul
        )
    )
    return m


def pipeline_tokens_per_s(cfg, tokenizer, batches: int) -> tuple[float, float]:
    """(non-padding tokens/s, seconds per batch) over `batches` batches after a warm-up batch."""
    it = pretrain.make_pretrain_iterator(cfg, tokenizer, "train")
    next(it)
    tokens, start = 0, time.perf_counter()
    for _ in range(batches):
        tokens += int((next(it)["segment_ids"] > 0).sum())
    elapsed = time.perf_counter() - start
    it.close()
    return tokens / elapsed, elapsed / batches


def step_tokens_per_s(cfg, model_cfg, steps: int) -> tuple[float, float, int]:
    """(tokens/s, seconds per step, active params) of a jitted value_and_grad step (compile
    excluded)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from coder.model import Transformer, count_params

    counts = count_params(model_cfg)
    print(f"model: {counts['total'] / 1e6:.1f}M total, {counts['active'] / 1e6:.1f}M active params "
          f"(+{counts['mtp'] / 1e6:.1f}M MTP), devices: {jax.devices()}")
    model = Transformer(model_cfg, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        logits, aux = model(batch["tokens"], batch["positions"], batch["segment_ids"])
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        target = batch["tokens"][:, 1:]
        nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        weight = batch["loss_mask"][:, 1:] * (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])
        loss = jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)
        # Keep the MTP head in the graph, as the training loss does.
        return loss + 0.0 * jnp.mean(aux["mtp_logits"]) if "mtp_logits" in aux else loss

    @nnx.jit
    def step(model, batch):
        return nnx.value_and_grad(loss_fn)(model, batch)

    rng = np.random.default_rng(0)
    shape = (cfg.data.batch_size, cfg.data.seq_len)
    batch = {
        "tokens": jnp.asarray(rng.integers(4, model_cfg.vocab_size, shape), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape),
        "segment_ids": jnp.ones(shape, jnp.int32),
        "loss_mask": jnp.ones(shape, jnp.float32),
    }
    t0 = time.perf_counter()
    jax.block_until_ready(step(model, batch))
    print(f"step compile + first run: {time.perf_counter() - t0:.1f} s")
    start = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(step(model, batch))
    elapsed = time.perf_counter() - start
    return steps * shape[0] * shape[1] / elapsed, elapsed / steps, counts["active"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed training steps")
    parser.add_argument("--batches", type=int, default=300, help="timed pipeline batches")
    parser.add_argument("--workers", type=int, default=0, help="config.data.num_workers")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args()

    cfg = base.get_config()
    cfg.data.seq_len, cfg.data.batch_size = args.seq_len, args.batch_size
    cfg.data.num_workers = args.workers
    t0 = time.perf_counter()
    tokenizer = tk.load_or_train(cfg)
    print(f"tokenizer: vocab {tokenizer.vocab_size}, ready in {time.perf_counter() - t0:.1f} s")
    model_cfg = model_config_100m()
    model_cfg.vocab_size = tokenizer.padded_vocab_size
    model_cfg.max_position_embeddings = args.seq_len
    model_cfg.rope_scaling.original_max_position_embeddings = args.seq_len

    data_tps, data_spb = pipeline_tokens_per_s(cfg, tokenizer, args.batches)
    print(f"pipeline: {data_tps:,.0f} tokens/s ({data_spb * 1e3:.2f} ms per "
          f"{args.batch_size}x{args.seq_len} batch, workers={args.workers})")
    step_tps, step_spb, _ = step_tokens_per_s(cfg, model_cfg, args.steps)
    print(f"train step: {step_tps:,.0f} tokens/s ({step_spb:.2f} s per step)")
    # The same comparison for faster accelerators: a trained token costs its model FLOPs
    # (coder.train.metrics: 6 N + 3 A), so the pipeline keeps up with any step below this compute
    # rate per process.
    fpt = metrics.model_flops_per_token(model_cfg, args.seq_len)
    print(f"pipeline feeds up to {data_tps * fpt / 1e12:,.1f} TFLOP/s of training compute "
          f"({fpt / 1e6:.1f} MFLOP model FLOPs per token) per loading process")
    print(f"ratio pipeline / step: {data_tps / step_tps:,.1f}x "
          f"({'pipeline is not the bottleneck' if data_tps > step_tps else 'PIPELINE IS THE BOTTLENECK'})")


if __name__ == "__main__":
    main()
