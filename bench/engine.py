"""Engine throughput, measured side by side in one run (CPU, float32, the base tiny config).

1. Decode tokens/s (greedy, after compilation) of
     a. coder's Engine with the MLA latent KV cache, batch 1 and batch --batch,
     b. the same model without a cache (every step recomputes the whole sequence),
     c. Hugging Face transformers' DeepseekV3ForCausalLM.generate (its own KV cache) on the same
        weights, exported with coder.model.hf_import.save_hf,
   and whether the three agree on the greedy tokens.
2. Prefill of a shared-prefix group (G rows, one P-token prompt): the engine prefills the prompt
   once and broadcasts its cache, against prefilling it in every row.

    JAX_PLATFORMS=cpu python bench/engine.py [--new_tokens 128 --prompt 128 --batch 8
                                              --group 8 --group_prompt 2048]
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


def hf_decode(cfg, model, prompt, new_tokens):
    """tokens/s of transformers' generate (greedy, KV cache) on the same weights, its tokens, and
    the torch thread count that gave it (1 or 2: the better one; on a CPU shared with other
    jobs torch's 2-thread pool can be 20x slower than 1 thread)."""
    import torch
    import transformers
    from transformers import DeepseekV3ForCausalLM

    from coder.model import hf_import

    transformers.logging.set_verbosity_error()  # the MTP layers are extra tensors HF ignores
    with tempfile.TemporaryDirectory() as d:
        hf_import.save_hf(cfg, model, d)
        hf = DeepseekV3ForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def gen(n):
        with torch.no_grad():
            return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                               pad_token_id=0)

    best = (0.0, None, 0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        gen(4)  # warm up
        _, t1 = timed(lambda: gen(1), REPEATS)
        out, tn = timed(lambda: gen(new_tokens), REPEATS)
        # decode time only: subtract a generate of one token (prefill + first token)
        tps = (new_tokens - 1) / (tn - t1)
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
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--group_prompt", type=int, default=2048)
    ap.add_argument("--skip_hf", action="store_true")
    ap.add_argument("--skip_group", action="store_true")
    args = ap.parse_args()

    cfg = model_config()
    cfg.dtype = "float32"
    cfg.max_position_embeddings = max(4096, args.group_prompt * 2)
    cfg.initializer_range = 0.1  # spread logits so greedy paths are not decided by float ties
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, cfg.vocab_size, args.prompt).tolist()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    n = args.new_tokens
    print(f"config: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, vocab {cfg.vocab_size}, "
          f"experts {cfg.n_routed_experts} (top {cfg.num_experts_per_tok}), float32, "
          f"{jax.device_count()} {jax.default_backend()} device(s); prompt {args.prompt}, {n} new tokens")

    # ---------------------------------------------------------------- decode
    max_len = args.prompt + n + 1
    engine = Engine(model, cfg, max_len=max_len, batch_buckets=(1, args.batch))
    results = {}
    for b in (1, args.batch):
        sampled = SamplingParams(temperature=1.0, max_new_tokens=n)
        params = greedy if b == 1 else sampled  # rows of a batch sample different continuations
        engine.generate(engine.start_group(prompt, b), params, jax.random.key(0))  # compile
        dt = float("inf")
        for _ in range(REPEATS):  # time the decode only, not the prefill of start_group
            group = engine.start_group(prompt, b)
            block(group.cache)
            gens, t = timed(lambda g=group, p=params: engine.generate(g, p, jax.random.key(1)))
            dt = min(dt, t)
        results[b] = (sum(len(g.tokens) for g in gens) / dt, gens)
    cached_tps, cached = results[1][0], results[1][1][0].tokens
    print(f"engine, KV cache, batch 1:        {cached_tps:9.1f} tok/s")
    print(f"engine, KV cache, batch {args.batch:<2d}:       {results[args.batch][0]:9.1f} tok/s "
          f"({results[args.batch][0] / cached_tps:.2f}x batch 1)")

    ref = NoCacheDecoder(model, max_len=max_len)
    ref.generate(prompt, greedy, jax.random.key(0))  # compile every length bucket
    out, dt = timed(lambda: ref.generate(prompt, greedy, jax.random.key(1)), REPEATS)
    nocache_tps = len(out.tokens) / dt
    print(f"no cache (recompute), batch 1:    {nocache_tps:9.1f} tok/s   -> cache speed-up "
          f"{cached_tps / nocache_tps:.2f}x; greedy tokens agree on {agree(cached, out.tokens)}/{n}")

    if not args.skip_hf:
        hf_tps, hf_tokens, threads = hf_decode(cfg, model, prompt, n)
        print(f"HF transformers generate, batch 1:{hf_tps:9.1f} tok/s   ({threads} torch thread(s)) -> engine/HF "
              f"{cached_tps / hf_tps:.2f}x; greedy tokens agree on {agree(cached, hf_tokens)}/{n}")

    # ---------------------------------------------------------------- shared-prefix prefill
    if args.skip_group:
        return
    g, p = args.group, args.group_prompt
    long_engine = Engine(model, cfg, max_len=p + 64, batch_buckets=(1, g), len_buckets=(p, p + 64))
    long_prompt = rng.integers(5, cfg.vocab_size, p).tolist()
    for share in (True, False):  # compile both paths
        block(long_engine.start_group(long_prompt, g, share_prefix=share).cache)
    shared, t_shared = timed(lambda: block(long_engine.start_group(long_prompt, g).cache), REPEATS)
    unshared, t_each = timed(lambda: block(long_engine.start_group(long_prompt, g, share_prefix=False).cache),
                             REPEATS)
    same = all(np.allclose(a[:g], b[:g], atol=1e-4) for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(unshared)))
    print(f"group prefill, G={g}, {p}-token prompt: shared {t_shared:.2f} s, per-row {t_each:.2f} s "
          f"-> saving {t_each / t_shared:.2f}x ({g}x fewer prefill tokens); caches equal: {same}")


if __name__ == "__main__":
    main()
