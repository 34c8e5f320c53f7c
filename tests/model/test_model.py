"""coder.model.Transformer: aux contract, KV cache == full forward, masking, remat, MTP."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.model import Transformer, init_cache


def tiny(**kw):
    from configs.base import model_config

    cfg = model_config()
    cfg.update(dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                    num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, n_group=2, topk_group=1,
                    num_experts_per_tok=2, num_mtp_layers=1, dtype="float32", initializer_range=0.1))
    cfg.update(kw)
    return cfg


fwd = nnx.jit(lambda m, t, p, s: m(t, p, s))
fwd_cache = nnx.jit(lambda m, t, p, s, c: m(t, p, s, cache=c))
mtp = nnx.jit(lambda m, h, n, p, s, c: m.mtp_module(0, h, n, p, s, cache=c))


def inputs(b=2, t=12, v=64, seed=0):
    tok = jax.random.randint(jax.random.key(seed), (b, t), 1, v, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return tok, pos, jnp.ones((b, t), jnp.int32)


def test_aux_contract():
    cfg = tiny()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tok, pos, seg = inputs()
    logits, aux = fwd(model, tok, pos, seg)
    assert logits.shape == (2, 12, 64) and logits.dtype == jnp.float32
    assert aux["router_load"].shape == (2, 8)
    np.testing.assert_allclose(aux["router_load"].sum(-1), 1.0, rtol=1e-6)
    assert aux["expert_ids"].shape == (2, 2, 12, 2) and aux["expert_ids"].dtype == jnp.int32
    assert aux["router_z_loss"].shape == () and float(aux["router_z_loss"]) > 0
    assert aux["hidden"].shape == (2, 12, 32)
    assert aux["mtp_logits"].shape == (1, 2, 12, 64)
    assert "cache" not in aux
    # the MTP logits equal an explicit mtp_module call on the trunk hidden state
    nxt = jnp.pad(tok[:, 1:], ((0, 0), (0, 1)))
    _, lg, _ = mtp(model, aux["hidden"], nxt, pos, seg, None)
    np.testing.assert_allclose(lg, aux["mtp_logits"][0], atol=1e-5)


def test_bf16_compute_float32_params():
    cfg = tiny(dtype="bfloat16")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    assert model.layers[0].self_attn.kv_b_proj[...].dtype == jnp.float32
    logits, aux = fwd(model, *inputs())
    assert logits.dtype == jnp.float32 and aux["hidden"].dtype == jnp.bfloat16
    ref, _ = fwd(Transformer(tiny(), rngs=nnx.Rngs(0)), *inputs())
    assert np.abs(np.asarray(logits) - np.asarray(ref)).max() < 0.1 * np.abs(np.asarray(ref)).max()


@pytest.mark.parametrize("q_lora_rank", [0, 8])
def test_cached_decode_equals_full_forward(q_lora_rank):
    """Ragged prefill (rows of length 5 and 8), then token-by-token decode at per-row positions."""
    cfg = tiny(q_lora_rank=q_lora_rank)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    tok, pos, seg = inputs(t=12)
    full, aux = fwd(model, tok, pos, seg)
    lens = np.array([5, 8])
    pseg = jnp.asarray((np.arange(8)[None] < lens[:, None]).astype(np.int32))  # 0 = padding
    cache = init_cache(cfg, 2, 16, jnp.float32)
    logits, a = fwd_cache(model, tok[:, :8], pos[:, :8], pseg, cache)
    assert "mtp_logits" not in a
    for b in range(2):
        np.testing.assert_allclose(logits[b, : lens[b]], full[b, : lens[b]], atol=2e-5)
    cache = a["cache"]
    cur = lens.copy()
    while (cur < 12).any():
        p = np.minimum(cur, 11)
        t_ = jnp.asarray(np.asarray(tok)[np.arange(2), p][:, None])
        s_ = jnp.asarray((cur < 12).astype(np.int32)[:, None])  # finished rows feed padding
        lg, a = fwd_cache(model, t_, jnp.asarray(p[:, None], jnp.int32), s_, cache)
        cache = a["cache"]
        for b in range(2):
            if cur[b] < 12:
                np.testing.assert_allclose(lg[b, 0], full[b, cur[b]], atol=2e-5)
        cur = cur + 1
    # MTP module with its own cache reproduces the full forward's MTP logits
    nxt = jnp.pad(tok[:, 1:], ((0, 0), (0, 1)))
    _, mlg, cache2 = mtp(model, aux["hidden"], nxt, pos, seg, cache)
    np.testing.assert_allclose(mlg, aux["mtp_logits"][0], atol=2e-5)
    assert float(jnp.abs(cache2["mtp"][0]["latent"][:, :12]).max()) > 0


def test_rolling_back_is_rewriting():
    cfg = tiny()
    model = Transformer(cfg, rngs=nnx.Rngs(2))
    tok, pos, seg = inputs(b=1, t=6)
    full, _ = fwd(model, tok, pos, seg)
    cache = init_cache(cfg, 1, 8, jnp.float32)
    _, a = fwd_cache(model, tok, pos, seg, cache)
    wrong = tok.at[0, 5].set((tok[0, 5] + 1) % 64)  # speculate a wrong token at slot 5
    _, a = fwd_cache(model, wrong[:, 5:], pos[:, 5:], seg[:, 5:], a["cache"])
    lg, _ = fwd_cache(model, tok[:, 5:], pos[:, 5:], seg[:, 5:], a["cache"])  # rewrite slot 5
    np.testing.assert_allclose(lg[0, 0], full[0, 5], atol=2e-5)


def test_document_masking():
    """A packed row of two documents equals the two documents run separately."""
    cfg = tiny(num_mtp_layers=0)
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    tok, _, _ = inputs(b=1, t=10)
    pos = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]], jnp.int32)
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2, 2, 2]], jnp.int32)
    packed, _ = fwd(model, tok, pos, seg)
    a, _ = fwd(model, tok[:, :4], pos[:, :4], seg[:, :4])
    b, _ = fwd(model, tok[:, 4:], pos[:, 4:], seg[:, 4:] - 1)
    np.testing.assert_allclose(packed, jnp.concatenate([a, b], 1), atol=2e-5)


def _grads(cfg):
    cfg.num_hidden_layers = 2
    model = Transformer(cfg, rngs=nnx.Rngs(4))
    tok, pos, seg = inputs(t=8)

    def loss(m):
        logits, aux = m(tok, pos, seg)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + jnp.mean(aux["mtp_logits"] ** 2)

    return nnx.to_flat_state(nnx.jit(nnx.grad(loss))(model))


@pytest.mark.slow
def test_remat_policies_same_gradients():
    ref = dict(_grads(tiny()))
    for policy in ("full", "save_dots", "save_qkv_proj"):
        got = dict(_grads(tiny(remat=policy)))
        for p in ref:
            np.testing.assert_allclose(got[p].get_value(), ref[p].get_value(), atol=1e-6, err_msg=f"{policy} {p}")


def test_rejects_unknown_backend_and_remat():
    with pytest.raises(ValueError, match="attention_backend"):
        Transformer(tiny(attention_backend="sparse"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="remat"):
        Transformer(tiny(remat="some"), rngs=nnx.Rngs(0))


def test_next_key_is_the_streams_own_key_sequence():
    """layers.next_key draws what RngStream.__call__ would (the same keys, the same count), so
    every model's init is unchanged; and it is the one allowed under a trace of the stream's level."""
    from coder.model.layers import next_key

    a, b = nnx.Rngs(7), nnx.Rngs(7)
    ours = [next_key(a.params) for _ in range(3)]
    flax = [b.params() for _ in range(3)]
    for x, y in zip(ours, flax):
        np.testing.assert_array_equal(jax.random.key_data(x), jax.random.key_data(y))
    assert int(a.params.count.get_value()) == int(b.params.count.get_value()) == 3

    @nnx.jit
    def draw(rngs):
        return next_key(rngs.params)

    np.testing.assert_array_equal(jax.random.key_data(draw(a)), jax.random.key_data(b.params()))
    assert int(a.params.count.get_value()) == 4


def test_head_backward_multiplies_in_the_models_dtype():
    """coder.model.transformer.head_logits: float32 logits from bf16 h and w; its backward casts
    the logits' cotangent to bf16 and multiplies bf16 x bf16 (float32 accumulation), where JAX's
    own transpose multiplied float32 x float32; the gradients agree with the float32 VJP to bf16
    rounding, and in float32 it is the plain VJP."""
    from coder.model.transformer import head_logits

    kh, kw, kg = jax.random.split(jax.random.key(3), 3)
    h, w = jax.random.normal(kh, (2, 5, 32)), jax.random.normal(kw, (32, 48)) * 0.2
    g = jax.random.normal(kg, (2, 5, 48))
    plain = lambda h, w: jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)  # noqa: E731
    vjp = lambda f, *a: jax.vjp(f, *a)[1](g)  # noqa: E731
    for got, want in zip(vjp(head_logits, h, w), vjp(plain, h, w)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    assert head_logits(hb, wb).dtype == jnp.float32
    for got, want in zip(vjp(head_logits, hb, wb), vjp(plain, h, w)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05 * float(jnp.abs(want).max()))
    dots = [e for e in jax.make_jaxpr(lambda h, w: jax.vjp(head_logits, h, w)[1](g))(hb, wb).eqns
            if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), dots
    plain_dots = [e for e in jax.make_jaxpr(lambda h, w: jax.vjp(plain, h, w)[1](g))(hb, wb).eqns
                  if e.primitive.name == "dot_general"]
    assert any(v.aval.dtype == jnp.float32 for e in plain_dots for v in e.invars)  # what it replaces
