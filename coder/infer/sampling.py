"""Token sampling: temperature, top-k, top-p, and the logprob the RL trainer must reproduce.

For logits z `[B, V]` (float32) and temperature T:
    recorded logprob  = log_softmax(z / T)[token]    (T = 0: log_softmax(z)[token])
over the *full* vocabulary, so a training forward at the same temperature recomputes it exactly,
whatever top-k / top-p did to the sampling distribution. The sampling distribution is
    p = softmax(z / T) restricted to the top-k tokens, then to the smallest prefix (by
        probability) of those whose renormalised mass reaches top_p, renormalised;
T = 0 is greedy (argmax). top_k = 0 and top_p = 1 disable their filter.

Randomness is per row and per absolute position: the key of the token at position p of row r is
`fold_in(fold_in(rng, r), p)`, so a row's samples do not depend on which other rows share its
batch or on the batch bucket (and a reference decoder without a cache can replay them).

All functions are pure and jittable; temperature / top_k / top_p may be traced scalars or
per-row arrays `[B]` (rows of one batch may belong to different requests: one compiled step
serves every setting).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def _per_row(x, logits, dtype):
    """A scalar or a per-row setting `logits.shape[:-1]` as `[..., 1]` against logits `[..., V]`."""
    return jnp.broadcast_to(jnp.asarray(x, dtype), logits.shape[:-1])[..., None]


def scale_logits(logits, temperature):
    """logits `[..., V]` / T, or unchanged for T = 0 (greedy). Returns float32."""
    logits = logits.astype(jnp.float32)
    t = _per_row(temperature, logits, jnp.float32)
    return jnp.where(t > 0, logits / jnp.where(t > 0, t, 1.0), logits)


def filter_logits(scaled, top_k, top_p):
    """Mask (to -inf) the tokens that top-k and then top-p remove. scaled `[B, V]` -> `[B, V]`.

    top-k keeps the k highest; top-p keeps, among those, the smallest set of most likely tokens
    whose probability reaches top_p (the most likely token is always kept). Ties at the
    boundary are broken by sort order, so exactly k tokens survive top-k.
    """
    v = scaled.shape[-1]
    top_k = _per_row(top_k, scaled, jnp.int32)
    top_p = _per_row(top_p, scaled, jnp.float32)

    def apply(x):
        order = jnp.argsort(-x, axis=-1)  # [B, V] token ids, most likely first
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        rank = jnp.arange(v)[None, :]
        k = jnp.where(top_k > 0, top_k, v)
        keep = rank < k
        sorted_x = jnp.where(keep, sorted_x, NEG_INF)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive cumulative mass
        keep = keep & ((mass_before < top_p) | (rank == 0))
        keep_vocab = jnp.zeros_like(keep).at[jnp.arange(x.shape[0])[:, None], order].set(keep)
        return jnp.where(keep_vocab, x, NEG_INF)

    needed = ((top_k > 0) | (top_p < 1.0)).any()
    return jax.lax.cond(needed, apply, lambda x: x, scaled)


def sampling_probs(logits, temperature, top_k, top_p):
    """The distribution a token is drawn from: `[B, V]` float32 (one-hot argmax when T = 0)."""
    scaled = scale_logits(logits, temperature)
    filtered = filter_logits(scaled, top_k, top_p)
    probs = jax.nn.softmax(filtered, axis=-1)
    greedy = jax.nn.one_hot(jnp.argmax(scaled, axis=-1), scaled.shape[-1], dtype=jnp.float32)
    return jnp.where(_per_row(temperature, scaled, jnp.float32) > 0, probs, greedy)


def token_logprob(logits, tokens, temperature):
    """log_softmax(logits / T)[token] over the full vocab (T = 0: log_softmax(logits)).

    logits `[..., V]`, tokens `[...]` int -> `[...]` float32.
    """
    logp = jax.nn.log_softmax(scale_logits(logits, temperature), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def row_keys(rng, row_ids, positions):
    """Per-token keys `[B]`: fold_in(fold_in(rng, row), position). row_ids/positions `[B]`."""
    return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(rng, r), p))(
        row_ids.astype(jnp.uint32), positions.astype(jnp.uint32))


def position_keys(row_rngs, positions):
    """Per-token keys `[B]`: fold_in(row_rng, position); row_rngs `[B]` = fold_in(rng, row)
    (the same keys as `row_keys`, for rows that each carry their own rng)."""
    return jax.vmap(jax.random.fold_in)(row_rngs, positions.astype(jnp.uint32))


def sample(logits, keys, temperature, top_k, top_p):
    """Draw one token per row. logits `[B, V]`, keys `[B]` (from `row_keys`).

    Returns (tokens `[B]` int32, logprobs `[B]` float32 = log_softmax(logits / T)[token]).
    """
    scaled = scale_logits(logits, temperature)
    filtered = filter_logits(scaled, top_k, top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    greedy = _per_row(temperature, scaled, jnp.float32)[..., 0] <= 0
    tokens = jnp.where(greedy, jnp.argmax(scaled, axis=-1), drawn)
    tokens = tokens.astype(jnp.int32)
    return tokens, token_logprob(logits, tokens, temperature)
