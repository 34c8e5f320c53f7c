"""Engine / learner agreement: for the same weights and the same sampled tokens, the log-probs
the engine recorded (the behaviour policy's, coder/infer/engine.py) against the learner's
recomputation (coder.rl.grpo.learner_forward, the loss's own forward), per precision pairing,
without and with router replay. One run, one markdown table (coder.rl.agreement's metrics):

    max / mean |diff|   of learner - engine log-probs over the sampled tokens
    KL k3               mean k3 estimate of KL(engine || learner) on those tokens
    routing (pairs)     routed (token, MoE layer) pairs whose top-k set the learner's router
                        chooses differently from the engine's (prompt tokens included)
    routing (tokens)    routed tokens with such a pair in some MoE layer

Pairings (engine / learner): f32 / f32 (model.dtype float32, rl.engine_dtype float32);
bf16 / f32 (rl.engine_dtype bfloat16: bf16 weights and KV cache, the learner in float32, as
tests/rl/test_router_replay.py); bf16 / bf16 (model.dtype bfloat16: both compute in bf16 from
the same float32 master weights); int8 / fp8 / int4e over f32 (the engine's matmul weights in
int8 or float8_e4m3fn with a scale per output channel, or its routed experts in INT4 with a
scale per 32 inputs, coder/infer/quantize.py; its other weights and KV cache bf16). The
"weights" column is what the engine holds on its device. Each pairing samples its own tokens with its engine (T = 1)
and the learner recomputes exactly those. A second table splits f32 / f32 by where the engine
computed the token's distribution: the prompt's prefill (the first sampled token) or a decode
step (the others). A third (--sources) takes the float32 difference apart op by op on one row:
what a bitwise mode would have to make equal.

    JAX_PLATFORMS=cpu python bench/agreement.py [--groups 4 --group_size 4 --prompt 32
                                                 --new_tokens 48 --expert_scale 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coder.infer.engine import Engine, SamplingParams
from coder.model import Transformer
from coder.model.moe import moe_layers
from coder.rl import grpo, trajectory
from coder.rl.agreement import agreement
from configs.base import model_config

# name -> (engine weights' dtype, learner compute dtype, the engine's rl.engine_quantization)
PAIRINGS = {"f32/f32": ("float32", "float32", ""), "bf16/f32": ("bfloat16", "float32", ""),
            "bf16/bf16": ("bfloat16", "bfloat16", ""), "int8/f32": ("bfloat16", "float32", "int8"),
            "fp8/f32": ("bfloat16", "float32", "fp8"), "int4e/f32": ("bfloat16", "float32", "int4_experts")}


def tiny_config(args):
    cfg = model_config()
    cfg.update(dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                    moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers, num_mtp_layers=0,
                    n_routed_experts=args.experts, n_group=1, topk_group=1, num_experts_per_tok=2,
                    first_k_dense_replace=1, max_position_embeddings=args.prompt + args.new_tokens + 1,
                    initializer_range=0.1))  # spread logits (bench/engine.py)
    cfg.rope_scaling.original_max_position_embeddings = cfg.max_position_embeddings
    return cfg


def master_state(cfg, args):
    """The float32 master weights every pairing starts from; `expert_scale` scales the routed
    experts' down projections so a flipped expert choice moves the logits (at init the experts'
    share of the residual stream is small: tests/rl/test_router_replay.py)."""
    model = Transformer(cfg, rngs=nnx.Rngs(args.seed))
    for moe in moe_layers(model):
        moe.wd[...] = moe.wd[...] * args.expert_scale
    return nnx.state(model)


def sample(model, cfg, engine_dtype, quantization, args, prompts):
    """Rows sampled by an engine over `model`'s weights in `engine_dtype` (quantized as
    `quantization` says) -> the GRPO batch of them (coder.rl.trajectory.to_batch: behaviour
    log-probs and the engine's expert ids of every fed token, prompt included), the engine's
    seconds and the bytes its weights take."""
    n = args.group_size
    engine = Engine(model, cfg, max_len=args.prompt + args.new_tokens + 1, max_slots=len(prompts) * n,
                    decode_steps=args.decode_steps, dtype=engine_dtype, quantization=quantization)
    weight_bytes = engine.weights.bytes_per_device
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens)
    t0 = time.perf_counter()
    groups = [engine.start_group(p, n) for p in prompts]
    # every group at once: the rows share decode batches as an actor's do
    results = [None] * len(groups)

    def run(i):
        results[i] = engine.generate(groups[i], params, jax.random.fold_in(jax.random.key(args.seed), i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rollouts = []
    for g, (group, gens) in enumerate(zip(groups, results)):
        for row, gen in enumerate(gens):
            w = trajectory.ContextWindow()
            w.add_context(prompts[g])
            w.add_sampled(gen)
            w.set_routing(group.expert_ids(row))
            rollouts.append(trajectory.Rollout(task_id=f"{g}", generations=[w]))
        group.close()
    seconds = time.perf_counter() - t0
    engine.close()
    return trajectory.to_batch(rollouts, args.prompt + args.new_tokens), seconds, weight_bytes


def learner_logp(model, batch, temperature, replay):
    """The learner's log-probs of the batch's tokens and its own routing (the loss's forward)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(s, b):
        logits, aux = grpo.learner_forward(nnx.merge(graphdef, s), b, replay)
        logp, _, valid = grpo.target_logp(logits, b["tokens"], b["segment_ids"], temperature)
        return logp, valid, aux["router_ids"]

    return run(state, {k: jnp.asarray(v) for k, v in batch.items()})


def sources(cfg, master, args) -> list[tuple[str, float]]:
    """Where float32 engine and learner part, one op family at a time, on one row of `args.prompt
    + args.new_tokens` tokens (what a bitwise mode would have to make equal): max |diff| of the
    log-softmax of the logits, each pair differing in that one respect."""
    from coder.model import expert_ffn, init_cache

    pcfg = cfg.copy_and_resolve_references()
    pcfg.dtype = "float32"
    model = Transformer(pcfg, rngs=nnx.Rngs(args.seed))
    nnx.update(model, master)
    graphdef, state = nnx.split(model)
    n = args.prompt + args.new_tokens
    r = np.random.default_rng(args.seed)
    tok = r.integers(5, cfg.vocab_size, (4, n)).astype(np.int32)
    pos, seg = np.broadcast_to(np.arange(n, dtype=np.int32), (4, n)), np.ones((4, n), np.int32)
    full = jax.jit(lambda s, t, p, g: jax.nn.log_softmax(nnx.merge(graphdef, s)(t, p, g, mtp=False)[0], -1))

    @jax.jit
    def cached(s, t, p, g, c):
        logits, aux = nnx.merge(graphdef, s)(t, p, g, cache=c, mtp=False)
        return jax.nn.log_softmax(logits, -1), aux["cache"]

    alone = np.asarray(full(state, tok[:1], pos[:1], seg[:1]))
    batched = np.asarray(full(state, tok, pos, seg))[:1]
    cap = 1 << (n - 1).bit_length()
    chunk, _ = cached(state, tok[:1], pos[:1], seg[:1], init_cache(pcfg, 1, cap, jnp.float32))
    chunk = np.asarray(chunk)
    wide, _ = cached(state, tok[:1], pos[:1], seg[:1], init_cache(pcfg, 1, 2 * cap, jnp.float32))
    p = args.prompt
    lp, c = cached(state, tok[:1, :p], pos[:1, :p], seg[:1, :p], init_cache(pcfg, 1, cap, jnp.float32))
    steps = [np.asarray(lp)]
    for i in range(p, n):
        lp, c = cached(state, tok[:1, i:i + 1], pos[:1, i:i + 1], seg[:1, i:i + 1], c)
        steps.append(np.asarray(lp))
    decoded = np.concatenate(steps, 1)
    x = r.normal(size=(n, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([r.choice(cfg.n_routed_experts, 2, replace=False) for _ in range(n)]).astype(np.int32)
    gates = r.random((n, 2)).astype(np.float32)
    moe = moe_layers(model)[0]
    w = (moe.wg[...], moe.wu[...], moe.wd[...])
    dense = np.asarray(jax.jit(expert_ffn.dense_ffn)(x, ids, gates, *w))
    grouped = np.asarray(jax.jit(expert_ffn.sorted_ffn)(x, ids, gates, *w))
    gap = lambda a, b: float(np.abs(a - b).max())  # noqa: E731
    return [
        ("full forward: the row alone vs in a batch of 4 (XLA:CPU row reductions, e.g. RMSNorm)", gap(alone, batched)),
        ("cached forward of the whole row in one chunk (absorbed MLA) vs full forward (expanded MLA)",
         gap(chunk, alone)),
        (f"prefill {p} + {n - p} decode steps vs one cached chunk (the engine's schedule)", gap(decoded, chunk)),
        (f"one cached chunk: cache capacity {cap} vs {2 * cap} (masked keys)", gap(np.asarray(wide), chunk)),
        ("MoE layer output: every expert on every token (dense_ffn) vs sorted grouped matmuls", gap(dense, grouped)),
    ]


def fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4, help="prompts")
    ap.add_argument("--group_size", type=int, default=4, help="rows sampled per prompt")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new_tokens", type=int, default=48)
    ap.add_argument("--decode_steps", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--expert_scale", type=float, default=1.0)
    ap.add_argument("--pairings", default=",".join(PAIRINGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sources", action=argparse.BooleanOptionalAction, default=True,
                    help="also the table of where f32 engine and learner part, op by op")
    args = ap.parse_args(argv)

    cfg = tiny_config(args)
    master = master_state(cfg, args)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(5, cfg.vocab_size, args.prompt).tolist() for _ in range(args.groups)]
    print(f"model: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({cfg.num_hidden_layers - 1} MoE, "
          f"{cfg.n_routed_experts} experts, top {cfg.num_experts_per_tok}), vocab {cfg.vocab_size}, expert scale "
          f"{args.expert_scale}; {args.groups} x {args.group_size} rows, {args.prompt}-token prompts, "
          f"{args.new_tokens} sampled tokens each at T = {args.temperature}; {jax.default_backend()}\n")
    head = ("| engine / learner | weights | router replay | tokens | max \\|diff\\| | mean \\|diff\\| | KL k3 | "
            "routing (pairs) | routing (tokens) |")
    lines = [head, "|---" * 9 + "|"]
    split = None
    for name in args.pairings.split(","):
        engine_dtype, learner_dtype, quantization = PAIRINGS[name]
        pcfg = cfg.copy_and_resolve_references()
        pcfg.dtype = learner_dtype  # the compute dtype of both the learner and (bf16/bf16) the engine
        model = Transformer(pcfg, rngs=nnx.Rngs(args.seed))
        nnx.update(model, master)
        batch, seconds, weight_bytes = sample(model, pcfg, engine_dtype, quantization, args, prompts)
        for replay in (False, True):
            logp, valid, own = learner_logp(model, batch, args.temperature, replay)
            mask = batch["loss_mask"] * np.asarray(valid)
            m = {k: float(v) for k, v in agreement(batch["behaviour_logp"], logp, mask, batch["expert_ids"],
                                                   own).items()}
            lines.append(f"| {name} | {weight_bytes / 2 ** 20:.2f} MiB | {'yes' if replay else 'no'} | "
                         f"{int(mask.sum())} | {fmt(m['abs_diff_max'])} | {fmt(m['abs_diff_mean'])} | {fmt(m['kl_k3'])} | {m['routing_mismatch']:.4f} | "
                         f"{m['routing_mismatch_tokens']:.4f} |")
            if name == "f32/f32" and not replay:
                first = np.zeros_like(mask)
                first[np.arange(mask.shape[0]), np.argmax(mask > 0, axis=1)] = 1
                first *= mask
                split = [(where, agreement(batch["behaviour_logp"], logp, w)) for where, w in
                         (("prefill (first sampled token)", first), ("decode (the others)", mask - first))]
                split = [(where, int(w.sum()), m) for (where, m), w in zip(split, (first, mask - first))]
        print(f"[{name}] sampled in {seconds:.1f} s", file=sys.stderr)
    print("\n".join(lines))
    if split:
        print("\nf32 / f32 by where the engine computed the distribution (no replay):\n")
        print("| engine program | tokens | max \\|diff\\| | mean \\|diff\\| | exact |")
        print("|---|---|---|---|---|")
        for where, n, m in split:
            exact = float(m["abs_diff_max"]) == 0
            print(f"| {where} | {n} | {fmt(float(m['abs_diff_max']))} | {fmt(float(m['abs_diff_mean']))} | "
                  f"{'yes' if exact else 'no'} |")
    if args.sources:
        print("\nf32, one row: where the engine's and the learner's computations part (max |diff| of "
              "log-softmax; MoE: of the layer output):\n")
        print("| the two sides differ only in | max \\|diff\\| |")
        print("|---|---|")
        for what, d in sources(cfg, master, args):
            print(f"| {what} | {fmt(d)} |")


if __name__ == "__main__":
    main()
