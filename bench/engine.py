"""Engine throughput, measured side by side in one run (CPU, float32, the base tiny config).

1. Decode tokens/s (after compilation) at batch 1, 8 and 32 (--batches) of
     a. coder's Engine (MLA latent KV cache, continuous batching, --decode_steps steps per host
        call in one lax.while_loop),
     b. Hugging Face transformers' DeepseekV3ForCausalLM.generate (its own KV cache) on the same
        weights, exported with coder.model.hf_export.save_hf,
   greedy at batch 1 (and whether the two agree on the tokens), sampled at T = 1 above; and the
   same model without a cache (every step recomputes the whole sequence) at batch 1.
2. Prefill of a shared-prefix group (G rows, one P-token prompt): the engine prefills the prompt
   once and copies its cache to the other slots, against G groups of one row each.
3. (--rollouts) rollouts/s of the toy tasks through the real sandbox, B x G at once against
   group by group (bench/rollouts.py).

    JAX_PLATFORMS=cpu python bench/engine.py [--new_tokens 128 --prompt 128 --batches 1,8,32
                                              --group 8 --group_prompt 2048 --rollouts]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from flax import nnx

from coder.infer.engine import Engine, SamplingParams
from coder.infer.reference import NoCacheDecoder
from coder.model import Transformer
from configs.base import model_config


def timed(fn, repeats: int = 1):
    """(result of the last call, best wall time of `repeats` calls): the CPU may be shared."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


REPEATS = 3  # best of 3 for every timing


def block(x):
    jax.block_until_ready(jax.tree.leaves(x))
    return x


def hf_decode(cfg, model, prompt, new_tokens, batch):
    """tokens/s of transformers' generate (KV cache; greedy at batch 1, sampled at T = 1 above)
    on the same weights, its first row's tokens, and the torch thread count that gave it (1 or 2:
    the better one; on a CPU shared with other jobs torch's 2-thread pool can be 20x slower)."""
    import torch
    import transformers
    from transformers import DeepseekV3ForCausalLM

    from coder.model import hf_export

    transformers.logging.set_verbosity_error()  # the MTP layers are extra tensors HF ignores
    with tempfile.TemporaryDirectory() as d:
        hf_export.save_hf(cfg, model, d)
        hf = DeepseekV3ForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt] * batch)
    sample = dict(do_sample=False) if batch == 1 else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

    def gen(n):
        with torch.no_grad():
            return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, use_cache=True, pad_token_id=0, **sample)

    best = (0.0, None, 0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        gen(4)  # warm up
        _, t1 = timed(lambda: gen(1), REPEATS)
        out, tn = timed(lambda: gen(new_tokens), REPEATS)
        # decode time only: subtract a generate of one token (prefill + first token)
        tps = batch * (new_tokens - 1) / (tn - t1)
        if tps > best[0]:
            best = (tps, out[0, len(prompt):].tolist(), threads)
    return best


def agree(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--decode_steps", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--group_prompt", type=int, default=2048)
    ap.add_argument("--skip_hf", action="store_true")
    ap.add_argument("--skip_group", action="store_true")
    ap.add_argument("--rollouts", action="store_true", help="also run bench/rollouts.py's comparison")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    cfg = model_config()
    cfg.dtype = "float32"
    cfg.max_position_embeddings = max(4096, args.group_prompt * 2)
    cfg.initializer_range = 0.1  # spread logits so greedy paths are not decided by float ties
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, cfg.vocab_size, args.prompt).tolist()
    n = args.new_tokens
    print(f"config: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, vocab {cfg.vocab_size}, "
          f"experts {cfg.n_routed_experts} (top {cfg.num_experts_per_tok}), float32, "
          f"{jax.device_count()} {jax.default_backend()} device(s); prompt {args.prompt}, {n} new tokens, "
          f"{args.decode_steps} decode steps per host call")

    # ---------------------------------------------------------------- decode
    max_len = args.prompt + n + 1
    greedy = SamplingParams(temperature=0.0, max_new_tokens=n)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=n)
    engine_tps, first_row = {}, {}
    for b in batches:
        engine = Engine(model, cfg, max_len=max_len, batch_buckets=(b,), max_slots=b, decode_steps=args.decode_steps)
        params = greedy if b == 1 else sampled  # rows of a batch sample different continuations
        group = engine.start_group(prompt, b)
        engine.generate(group, params, jax.random.key(0))  # compile
        group.close()
        dt = float("inf")
        for _ in range(REPEATS):  # time the decode only, not the prefill of start_group
            group = engine.start_group(prompt, b)
            gens, t = timed(lambda g=group, p=params: engine.generate(g, p, jax.random.key(1)))
            group.close()
            dt = min(dt, t)
        engine_tps[b], first_row[b] = sum(len(g.tokens) for g in gens) / dt, gens[0].tokens
        stats = engine.stats()
        print(f"engine, batch {b:<3d}: {engine_tps[b]:9.1f} tok/s  ({stats['decode_calls']} host calls for "
              f"{stats['decode_steps']} steps, occupancy {stats['occupancy']:.2f})")
        engine.close()

    if 1 in batches:
        ref = NoCacheDecoder(model, max_len=max_len)
        ref.generate(prompt, greedy, jax.random.key(0))  # compile every length bucket
        out, dt = timed(lambda: ref.generate(prompt, greedy, jax.random.key(1)), REPEATS)
        nocache_tps = len(out.tokens) / dt
        print(f"no cache (recompute), batch 1: {nocache_tps:9.1f} tok/s -> cache speed-up "
              f"{engine_tps[1] / nocache_tps:.2f}x; greedy tokens agree on {agree(first_row[1], out.tokens)}/{n}")

    if not args.skip_hf:
        for b in batches:
            hf_tps, hf_tokens, threads = hf_decode(cfg, model, prompt, n, b)
            agreement = f"; greedy tokens agree on {agree(first_row[b], hf_tokens)}/{n}" if b == 1 else ""
            print(f"HF transformers generate, batch {b:<3d}: {hf_tps:9.1f} tok/s ({threads} torch thread(s)) "
                  f"-> engine/HF {engine_tps[b] / hf_tps:.2f}x{agreement}")

    # ---------------------------------------------------------------- shared-prefix prefill
    if not args.skip_group:
        g, p = args.group, args.group_prompt
        long_engine = Engine(model, cfg, max_len=p + 64, batch_buckets=(1, g), len_buckets=(p, p + 64), max_slots=g)
        long_prompt = rng.integers(5, cfg.vocab_size, p).tolist()

        def shared():
            group = long_engine.start_group(long_prompt, g)
            caches = block(group.cache)
            group.close()
            return caches

        def per_row():
            groups = [long_engine.start_group(long_prompt, 1) for _ in range(g)]
            caches = [block(x.cache) for x in groups]
            for x in groups:
                x.close()
            return jax.tree.map(lambda *c: np.concatenate(c), *caches)

        shared(), per_row()  # compile both paths
        a, t_shared = timed(shared, REPEATS)
        b, t_each = timed(per_row, REPEATS)
        same = all(np.allclose(x, y, atol=1e-4) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        print(f"group prefill, G={g}, {p}-token prompt: shared {t_shared:.2f} s, per-row {t_each:.2f} s "
              f"-> saving {t_each / t_shared:.2f}x ({g}x fewer prefill tokens); caches equal: {same}")
        long_engine.close()

    if args.rollouts:
        import rollouts as rollouts_bench  # bench/rollouts.py, beside this file

        rollouts_bench.main([])


if __name__ == "__main__":
    main()
