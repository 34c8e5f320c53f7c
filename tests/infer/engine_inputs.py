"""The engine tests' tiny model and helpers (tests/infer/test_engine.py and the engine, serve and
RL tests built on it): its config and buckets, the training forward, the near-bigram MTP drafts
of the speculative tests, a chi-squared check of sampled distributions."""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.base import model_config

MAX_LEN = 64
BATCH = (1, 4)  # few buckets: each is a compiled program, and compiling dominates test time
LENS = (32, 64)


def tiny_cfg():
    cfg = model_config()
    cfg.update({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                    "num_hidden_layers": 2, "num_attention_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "n_group": 2, "topk_group": 1,
                    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_mtp_layers": 1,
                    "max_position_embeddings": MAX_LEN, "dtype": "float32"})
    # a larger init spreads the logits, so sampled sequences are far from argmax ties
    cfg.initializer_range = 0.2
    return cfg


@nnx.jit
def forward(model, tokens, segment_ids):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, aux = model(tokens, pos, segment_ids)
    return logits, aux["expert_ids"]


def draftable(model, scale=0.03):
    """Make the MTP modules a good but imperfect draft: the trunk's attention and FFN outputs are
    scaled by `scale` (a near-bigram model), and each MTP module passes the next token's
    normalised embedding straight to the shared head (its block's outputs zeroed, eh_proj =
    [I; 0]), i.e. it predicts with the trunk's bigram part. Drafts are then accepted often but
    not always, so both branches of the acceptance rule run."""
    def scale_by(var, f):
        var.set_value(var.get_value() * f)

    def ffn_out(mlp):
        return [mlp.wd, mlp.shared.down_proj] if hasattr(mlp, "wd") else [mlp.down_proj]

    for layer in model.layers:
        for var in [layer.self_attn.o_proj] + ffn_out(layer.mlp):
            scale_by(var, scale)
    for mod in model.mtp:
        for var in [mod.block.self_attn.o_proj] + ffn_out(mod.block.mlp):
            scale_by(var, 0.0)
        d = mod.eh_proj.get_value().shape[1]
        mod.eh_proj.set_value(jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))]).astype(mod.eh_proj.get_value().dtype))
    return model


def chi2_bound(df):
    """0.999 quantile of chi-squared (Wilson-Hilferty approximation, good to ~1% here)."""
    z = 3.090
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def chi2_ok(counts, probs):
    """Chi-squared goodness of fit, bins with expected count < 5 pooled."""
    expected = counts.sum() * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, chi2_bound(int(keep.sum()) - 1)
