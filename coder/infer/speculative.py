"""Speculative decoding with the MTP modules as the draft model (DeepSeek-V3 section 2.2, 5.4.3).

Notation: a row's main cache holds positions 0..L-1; h^0_i is the trunk's last hidden state at
position i, h^d_i the output of MTP module d-1 (depth d) at position i, which takes h^{d-1}_i
and the embedding of tok_{i+d} and predicts tok_{i+d+1}.

MTP caches lag: depth d can only run at position i once tok_{i+d} is known, so with L tokens in
the main cache depth d holds positions 0..L-1-d, and the engine keeps the one hidden state each
depth still owes its successor: `mtp_last[d-1] = h^d_{L-1-d}` (and h^0_{L-1} is the row's
`hidden`). `advance` moves every depth forward over a chunk of c tokens that entered the main
cache at positions L..L+c-1 (a prefill chunk, or the accepted tokens of a step): depth d runs
at positions L-d .. L+c-1-d on tokens tok_{L..L+c-1} (the same tokens at every depth) and on
the previous depth's outputs shifted right by one, led by the hidden state it owed.

One step (`draft` + one main forward + `accept`), for k <= num_mtp_layers drafts:
  t0     ~ p(. | tok_<L)  from the held logits (or from the residual max(0, p - q), normalised,
           when the previous step's draft at this position was rejected);
  draft  depth d (d = 1..k) runs at positions L-d .. L-1 on tokens [t0, x_1 .. x_{d-1}];
         its output at L-1 gives q_d, and x_d ~ q_d (the same temperature / top-k / top-p);
  verify the main model on [t0, x_1 .. x_k] at positions L .. L+k gives p_1 .. p_{k+1};
  accept x_j while u_j < p_j(x_j) / q_j(x_j) (Leviathan et al. 2023, Chen et al. 2023); the
         first rejection leaves its residual max(0, p_j - q_j) for the next step's t0, which
         makes every emitted token distributed exactly as the main model's p. At temperature 0
         p and q are one-hot, so this is "accept while the draft equals the argmax".
The cache slots of rejected drafts are rolled back by moving the row's length: they are past
the end, never attended, and overwritten before any query can reach them (the model attends to
slots <= the query's position and writes a call's tokens before attending; with the nsa backend
a compressed block holding a rejected slot is recomputed when its last slot is written again).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coder.infer import sampling


def check_draft_depth(key: str, k: int, num_mtp_layers: int) -> None:
    """ValueError naming config key `key` (e.g. "serve.speculative_k") unless its draft depth `k`
    is in [0, num_mtp_layers]: each drafted token takes one MTP module (0 = no speculative
    decoding). Every place that builds an engine from a config checks its key with this."""
    k, mtp = int(k), int(num_mtp_layers)
    if k < 0:
        raise ValueError(f"{key}={k} must be >= 0 (0 = no speculative decoding)")
    if k > mtp:
        why = (f"the model has no MTP modules (model.num_mtp_layers=0): set {key}=0, or use a model with MTP "
               "modules (model.num_mtp_layers >= 1, distilled by stage mtp)" if mtp == 0 else
               f"the model has model.num_mtp_layers={mtp}: set {key} <= {mtp}")
        raise ValueError(f"{key}={k}: each drafted token takes one MTP module, and {why}")


def advance(model, cache, h_last, mtp_last, main_hidden, tokens, start, n_valid, active, cache_rows=None):
    """Run every MTP depth over a chunk that entered the main cache.

    h_last `[B,D]` = h^0_{L-1}; mtp_last `[B,M,D]`; main_hidden `[B,T,D]` = h^0_{L..L+T-1};
    tokens `[B,T]` = tok_{L..L+T-1}; start `[B]` = L; n_valid `[B]` real tokens of the chunk
    (the rest is padding); active `[B]` rows to update; cache_rows as the model's (the batch
    rows' slots in a pool's `cache`).
    Returns (cache, mtp_last `[B,M,D]` = h^d_{L+c-1-d}).
    """
    t = tokens.shape[1]
    j = jnp.arange(t)[None, :]
    last = jnp.clip(n_valid - 1, 0, t - 1)[:, None, None]
    prev_out, prev_last = main_hidden, h_last
    new_last = []
    for d in range(1, mtp_last.shape[1] + 1):
        hin = jnp.concatenate([prev_last[:, None].astype(prev_out.dtype), prev_out[:, :-1]], axis=1)
        pos = start[:, None] - d + j
        seg = ((j < n_valid[:, None]) & (pos >= 0) & active[:, None]).astype(jnp.int32)
        out, _, cache = model.mtp_module(d - 1, hin, tokens, jnp.maximum(pos, 0), seg, cache, cache_rows)
        new_last.append(jnp.take_along_axis(out, last, axis=1)[:, 0])
        prev_out, prev_last = out, mtp_last[:, d - 1]
    if not new_last:
        return cache, mtp_last
    return cache, jnp.stack(new_last, axis=1).astype(mtp_last.dtype)


def draft(model, cache, h_last, mtp_last, t0, start, active, keys, k, temperature, top_k, top_p):
    """Draft k tokens after t0 with depths 1..k.

    keys `[k, B]` (one per drafted token). Returns (drafts `[B,k]`, their sampling
    distributions q `[B,k,V]`, cache with temporary MTP entries past the valid range).
    """
    b = t0.shape[0]
    j = jnp.arange(k)[None, :]
    toks = jnp.zeros((b, k), jnp.int32).at[:, 0].set(t0)
    prev_out = None
    drafts, qs = [], []
    for d in range(1, k + 1):
        lead = (h_last if d == 1 else mtp_last[:, d - 2])[:, None]
        if prev_out is None:
            hin = jnp.broadcast_to(lead, (b, k, lead.shape[-1]))
        else:
            hin = jnp.concatenate([lead.astype(prev_out.dtype), prev_out[:, :-1]], axis=1)
        pos = start[:, None] - d + j
        seg = ((j < d) & (pos >= 0) & active[:, None]).astype(jnp.int32)
        out, logits, cache = model.mtp_module(d - 1, hin, toks, jnp.maximum(pos, 0), seg, cache)
        q = sampling.sampling_probs(logits[:, d - 1], temperature, top_k, top_p)  # at position L-1
        x = draw(q, keys[d - 1], temperature)
        drafts.append(x)
        qs.append(q)
        if d < k:
            toks = toks.at[:, d].set(x)
        prev_out = out
    return jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), cache


def draw(probs, keys, temperature):
    """One token per row from `probs` `[B,V]` (argmax at temperature 0). keys `[B]`."""
    logp = jnp.log(jnp.maximum(probs, 0.0))
    drawn = jax.vmap(jax.random.categorical)(keys, logp)
    sampled = jnp.broadcast_to(jnp.asarray(temperature), probs.shape[:-1]) > 0
    return jnp.where(sampled, drawn, jnp.argmax(probs, axis=-1)).astype(jnp.int32)


def residual(p, q):
    """Normalised max(0, p - q) `[B,V]` (p where that is all zero, which only rounding can cause)."""
    r = jnp.maximum(p - q, 0.0)
    s = r.sum(-1, keepdims=True)
    return jnp.where(s > 0, r / jnp.where(s > 0, s, 1.0), p)


def accept(p, q, drafts, uniforms):
    """Number of leading drafts accepted `[B]`.

    p, q `[B,k,V]` main / draft distributions at the drafted positions, drafts `[B,k]`,
    uniforms `[B,k]` in [0, 1): draft j is accepted when u_j < p_j(x_j) / q_j(x_j)."""
    px = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ok = uniforms * qx < px  # u < p/q without dividing by a q that rounding made 0
    return jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1)
