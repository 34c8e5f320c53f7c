"""The model's `nsa` attention backend: MLA in absorbed form through coder.pallas.nsa.

Causality and document masking hold end to end (a later token or another document never changes
a logit), every NSA parameter gets a gradient, and a few optimizer steps lower the loss. Cached
calls (decode, chunked prefill, the engine): tests/test_nsa_engine.py."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from test_nsa_reference import fast_compiles  # noqa: F401

from coder.model import Transformer
from configs.base import model_config

T = 40


def nsa_cfg():
    """Dense FFNs (MoE is not what these tests are about, and without it the programs compile faster)."""
    cfg = model_config()
    cfg.update({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4, "n_group": 1, "topk_group": 1,
                    "num_experts_per_tok": 2, "first_k_dense_replace": 2, "num_mtp_layers": 0, "dtype": "float32",
                    "attention_backend": "nsa",
                    "initializer_range": 0.1})
    cfg.nsa.update({"compress_block": 8, "compress_stride": 4, "select_block": 8, "select_topk": 3, "window": 8})
    return cfg


def inputs(seed=0):
    tok = jnp.asarray(np.random.default_rng(seed).integers(1, 64, (2, T)).astype(np.int32))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    return tok, pos, jnp.ones((2, T), jnp.int32)


fwd = nnx.jit(lambda m, t, p, s: m(t, p, s)[0])


def test_nsa_backend_is_causal_and_respects_documents():
    model = Transformer(nsa_cfg(), rngs=nnx.Rngs(0))
    tok, pos, seg = inputs()
    base = fwd(model, tok, pos, seg)
    later = tok.at[:, 30:].set((tok[:, 30:] + 7) % 63 + 1)
    np.testing.assert_allclose(fwd(model, later, pos, seg)[:, :30], base[:, :30], atol=1e-5)
    # Two documents: the second one's tokens never reach the first's logits, and the second
    # document's logits equal the same document run alone.
    seg2 = jnp.concatenate([jnp.ones((2, 20), jnp.int32), jnp.full((2, 20), 2, jnp.int32)], 1)
    pos2 = jnp.concatenate([jnp.arange(20), jnp.arange(20)])[None].repeat(2, 0).astype(jnp.int32)
    two = fwd(model, tok, pos2, seg2)
    other = tok.at[:, 20:].set(5)
    np.testing.assert_allclose(fwd(model, other, pos2, seg2)[:, :20], two[:, :20], atol=1e-5)
    # alone: at the start of a row, padding (segment 0) after it; the same [2, T] program
    alone = fwd(model, jnp.roll(tok, -20, 1), jnp.roll(pos2, -20, 1), seg2 * (jnp.arange(T) < 20))
    np.testing.assert_allclose(two[:, 20:], alone[:, :20], atol=1e-4)


def test_nsa_backend_trains():
    model = Transformer(nsa_cfg(), rngs=nnx.Rngs(0))
    tok, pos, seg = inputs(1)
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    def loss_fn(m):
        logits, _ = m(tok, pos, seg)
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], -1))

    @nnx.jit
    def step(m, o):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        o.update(m, grads)
        return loss, grads

    loss0, grads = step(model, opt)
    nsa_grads = nnx.state(grads, nnx.PathContains("nsa"))
    leaves = jax.tree.leaves(nsa_grads)
    assert leaves and all(bool(jnp.isfinite(g).all()) for g in leaves)
    assert any(float(jnp.abs(g).max()) > 0 for g in leaves)
    for _ in range(15):
        loss, _ = step(model, opt)
    assert float(loss) < float(loss0) - 0.1

