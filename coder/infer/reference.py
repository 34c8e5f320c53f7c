"""Decoding without a KV cache: every step recomputes the whole sequence.

The baseline the cached engine is checked (tests/infer/test_engine.py) and timed (bench/engine.py)
against. It draws with the same per-row, per-position keys as `Engine` (coder/infer/sampling.py),
so for the same rng and row it samples the same tokens up to floating-point ties.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coder.infer import sampling
from coder.infer.scheduler import Generation, SamplingParams, bucket, default_len_buckets


class NoCacheDecoder:
    """`generate(prompt_ids, params, rng, row=0) -> Generation` by full recomputation per token.

    The sequence is padded to a length bucket (padding is segment 0, which real tokens never
    attend to), so programs compile once per bucket, as the engine's do.
    """

    def __init__(self, model, *, max_len: int, len_buckets=None):
        self.max_len = max_len
        self.len_buckets = tuple(sorted(len_buckets or default_len_buckets(max_len)))
        self._graphdef, self._state = nnx.split(model)
        self._step = jax.jit(self._step_impl)

    def _step_impl(self, state, tokens, n, row, rng, temperature, top_k, top_p):
        """tokens `[1, T]` holding n real tokens -> (next token, its logprob, expert ids
        `[moe_layers, T, top_k]` of the sequence)."""
        model = nnx.merge(self._graphdef, state)
        t = tokens.shape[1]
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        seg = (pos < n).astype(jnp.int32)
        logits, aux = model(tokens, pos, seg, mtp=False)
        last = jax.lax.dynamic_index_in_dim(logits[0], n - 1, axis=0, keepdims=True)  # [1, V]
        keys = sampling.row_keys(rng, row[None], n[None])
        tok, logp = sampling.sample(last, keys, temperature, top_k, top_p)
        return tok[0], logp[0], aux["expert_ids"][:, 0]

    def generate(self, prompt_ids, params: SamplingParams, rng, row: int = 0) -> Generation:
        seq = [int(t) for t in prompt_ids]
        stops = {int(s) for s in params.stop_token_ids}
        toks, logps, reason = [], [], "length"
        args = (np.int32(row), rng, np.float32(params.temperature), np.int32(params.top_k),
                np.float32(params.top_p))
        while len(toks) < params.max_new_tokens:
            if len(seq) >= self.max_len:
                reason = "max_len"
                break
            t = bucket(self.len_buckets, len(seq))
            buf = np.zeros((1, t), np.int32)
            buf[0, :len(seq)] = seq
            tok, logp, _ = self._step(self._state, buf, np.int32(len(seq)), *args)
            tok = int(tok)
            toks.append(tok)
            logps.append(float(logp))
            seq.append(tok)
            if tok in stops:
                reason = "stop"
                break
            if len(seq) >= self.max_len:
                reason = "max_len"
                break
        experts = self.expert_ids(seq)[len(seq) - len(toks):]
        return Generation(toks, logps, experts, reason, [0] * len(toks))

    def expert_ids(self, seq) -> np.ndarray:
        """Routing of every token of `seq` in one full forward: `[len, moe_layers, top_k]`."""
        t = bucket(self.len_buckets, len(seq))
        buf = np.zeros((1, t), np.int32)
        buf[0, :len(seq)] = seq
        _, _, eids = self._step(self._state, buf, np.int32(len(seq)), np.int32(0),
                                jax.random.key(0), np.float32(0), np.int32(0), np.float32(1))
        return np.asarray(eids)[:, :len(seq)].transpose(1, 0, 2)
