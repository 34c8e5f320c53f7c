"""Rotary position embeddings (RoPE) and YaRN, the way DeepSeek-V3 applies them.

RoPE rotates pairs of features by an angle proportional to the position:
    (x_{2i}, x_{2i+1}) -> (x_{2i} cos(p w_i) - x_{2i+1} sin(p w_i),
                           x_{2i+1} cos(p w_i) + x_{2i} sin(p w_i)),   w_i = theta^(-2i/d).
DeepSeek stores the rotary features *interleaved* (pairs are adjacent features) and writes the
rotated result de-interleaved: first all rotated even features, then all rotated odd ones
(Hugging Face `apply_rotary_pos_emb_interleave`). Only the decoupled RoPE part of MLA
(`qk_rope_head_dim` features) is rotated, so a query/key pair's dot product is unchanged by the
layout as long as q and k use the same one.

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension") blends interpolated
frequencies w_i / factor (low frequencies) with the original ones (high frequencies) over a
linear ramp between the dimensions that make `beta_slow` and `beta_fast` rotations in the
original context, and scales cos/sin by an attention factor
    attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim),
    mscale(s, m) = 0.1 m ln(s) + 1  (1 when s <= 1).
DeepSeek-V3 additionally multiplies the softmax scale by mscale(factor, mscale_all_dim)^2
(`softmax_scale`), which for mscale == mscale_all_dim exactly moves the temperature correction
out of cos/sin into the softmax.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * m * math.log(scale) + 1.0


def rope_frequencies(cfg) -> tuple[np.ndarray, float]:
    """Inverse frequencies `[qk_rope_head_dim // 2]` (float32) and the cos/sin attention factor."""
    dim = cfg.qk_rope_head_dim
    base = float(cfg.rope_theta)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    rs = cfg.rope_scaling
    if rs.type in ("none", "default", None):
        return inv_freq, 1.0
    if rs.type != "yarn":
        raise ValueError(f"model.rope_scaling.type={rs.type!r}: expected 'none' or 'yarn'")
    factor = float(rs.factor)
    mscale, mscale_all_dim = rs.mscale, rs.mscale_all_dim
    if mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)
    orig = rs.original_max_position_embeddings

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    # Hugging Face truncates the correction range to whole dimensions (truncate=True default).
    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp  # 1 = keep the original frequency (high-frequency dims)
    inv_interp = (1.0 / (factor * pos_freqs)).astype(np.float32)
    inv_freq = inv_interp * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def softmax_scale(cfg) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V3)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if rs.type == "yarn" and rs.mscale_all_dim:
        m = _yarn_mscale(float(rs.factor), rs.mscale_all_dim)
        scale = scale * m * m
    return scale


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq, attention_factor: float):
    """Rotate interleaved pairs of the last axis of x.

    x: `[batch, seq, ..., rope_dim]`; positions: `[batch, seq]` int. Returns x's shape and dtype,
    features laid out as [rotated evens, rotated odds] (DeepSeek / HF interleave convention).
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, d/2]
    cos = jnp.cos(angles) * attention_factor
    sin = jnp.sin(angles) * attention_factor
    extra = x.ndim - 3  # broadcast over head axes between seq and features
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
