"""model.scan_layers: the MoE layers as one lax.scan over stacked weights equal the unrolled loop.

Both models come from one seed (stack_blocks stacks the same per-layer initialisation), so every
comparison is between the same numbers computed two ways: forward, gradients, remat, routing
replay, cached decoding, the trainer's step with its router-bias update, and the shardings.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.model import Transformer, init_cache, sharding
from coder.model.moe import moe_layers


def _cfg(scan: bool, **kw):
    from configs.base import model_config

    m = model_config()
    m.update(dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=2, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, n_group=2,
                  topk_group=1, num_experts_per_tok=2, num_mtp_layers=1, dtype="float32",
                  scan_layers=scan))
    m.update(kw)
    return m


def _batch(b=2, t=12, seed=0):
    tok = jax.random.randint(jax.random.key(seed), (b, t), 1, 64, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = jnp.ones((b, t), jnp.int32).at[1, 8:].set(2)  # two documents in row 1
    return tok, pos, seg


@functools.cache
def _init(scan: bool):
    """The seed-0 variables of _cfg(scan), initialised once for the module (eager init is slow)."""
    return nnx.state(Transformer(_cfg(scan), rngs=nnx.Rngs(0)))


def _model(scan: bool, **kw):
    """A new Transformer(_cfg(scan, **kw)) holding a copy of the seed-0 variables (kw: keys that
    change no variable, e.g. remat)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(_cfg(scan, **kw), rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, _init(scan)))


def _pair(**kw):
    return _model(False, **kw), _model(True, **kw)


def test_stacked_weights_are_the_unrolled_layers():
    unrolled, scanned = _pair()
    assert len(scanned.layers) == 1 and scanned.moe_stack is not None
    wq = scanned.moe_stack.self_attn.kv_b_proj
    assert wq[...].shape[0] == 3 and wq.get_metadata()["logical_axes"][0] == "layers"
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(wq[...][i]),
                                      np.asarray(unrolled.layers[1 + i].self_attn.kv_b_proj[...]))


def _forward_and_grads(model, tok, pos, seg):
    """One jitted function: the forward's logits and aux, and the gradients of a loss of both."""
    def loss(m):
        logits, aux = m(tok, pos, seg)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + aux["router_z_loss"], (logits, aux)

    (_, (logits, aux)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    return logits, aux, grads


@pytest.mark.slow
def test_forward_and_gradients_equal_the_unrolled_loop():
    """The scan without remat and with remat "full" (jax.checkpoint around the scanned layer)
    against the unrolled loop without remat: remat changes no value (the unrolled model's remat
    policies give the same gradients: tests/model/test_model.py::test_remat_policies_same_gradients)."""
    tok, pos, seg = _batch()
    la, aa, ga = _forward_and_grads(_model(False), tok, pos, seg)
    for remat in ("none", "full"):
        lb, ab, gb = _forward_and_grads(_model(True, remat=remat), tok, pos, seg)
        np.testing.assert_allclose(np.asarray(lb), np.asarray(la), atol=2e-5)
        np.testing.assert_allclose(np.asarray(ab["mtp_logits"]), np.asarray(aa["mtp_logits"]), atol=2e-5)
        np.testing.assert_array_equal(np.asarray(ab["expert_ids"]), np.asarray(aa["expert_ids"]))
        np.testing.assert_allclose(np.asarray(ab["router_load"]), np.asarray(aa["router_load"]), atol=1e-6)
        assert ab["router_load"].shape == (3, 4)
        np.testing.assert_allclose(np.asarray(gb.moe_stack.mlp.wg[...][1]),
                                   np.asarray(ga.layers[2].mlp.wg[...]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(gb.moe_stack.self_attn.q_proj[...][2]),
                                   np.asarray(ga.layers[3].self_attn.q_proj[...]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(gb.embed[...]), np.asarray(ga.embed[...]), atol=1e-5)


def test_routing_replay_through_the_scan():
    _, scanned = _pair()
    tok, pos, seg = _batch()
    call = nnx.jit(lambda m, routing: m(tok, pos, seg, routing=routing))
    logits, aux = call(scanned, None)
    for moe in moe_layers(scanned):  # a moved bias routes differently, replay does not
        moe.bias[...] = moe.bias[...] + 0.5 * jax.random.normal(jax.random.key(5), moe.bias[...].shape)
    _, moved = call(scanned, None)
    assert (np.asarray(moved["expert_ids"]) != np.asarray(aux["expert_ids"])).any()
    replay, aux2 = call(scanned, aux["expert_ids"])
    np.testing.assert_array_equal(np.asarray(aux2["expert_ids"]), np.asarray(aux["expert_ids"]))
    np.testing.assert_allclose(np.asarray(replay), np.asarray(logits), atol=1e-5)


def test_cached_decoding_equals_the_unrolled_model():
    """The scanned model decoding with a cache (one scanned layer over the MoE layers' stacked
    cache `[B, L, S, ...]`): its prefill and every decode step give the unrolled model's
    full-forward logits (the unrolled model's own decoding equals its full forward:
    test_model.py::test_cached_decode_equals_full_forward)."""
    unrolled, scanned = _pair()
    tok, pos, _ = _batch()
    seg = jnp.ones_like(tok)
    call = nnx.jit(lambda m, t, p, s, c: m(t, p, s, cache=c)[0] if c is None else m(t, p, s, cache=c))
    cache = init_cache(scanned.cfg, 2, 16, jnp.float32)
    n_dense = scanned.cfg.first_k_dense_replace
    assert len(cache["layers"]) == n_dense and "stack" not in init_cache(unrolled.cfg, 2, 16)
    assert cache["stack"]["latent"].shape == (2, scanned.cfg.num_hidden_layers - n_dense, 16,
                                              scanned.cfg.kv_lora_rank)
    logits, aux = call(scanned, tok[:, :8], pos[:, :8], seg[:, :8], cache)
    steps = [logits[:, -1]]
    for t in range(8, 12):
        lg, aux = call(scanned, tok[:, t:t + 1], pos[:, t:t + 1], seg[:, t:t + 1], aux["cache"])
        steps.append(lg[:, 0])
    full = call(unrolled, tok, pos, seg, None)
    np.testing.assert_allclose(np.stack(steps), np.asarray(full[:, 7:12]).transpose(1, 0, 2), atol=2e-5)


@pytest.mark.slow  # 33 s: the not-slow set's longest test
def test_trainer_step_and_router_bias_update_match(tmp_path):
    from configs import base

    from coder.train.balancing import router_balancing
    from coder.train.losses import lm_loss_fn
    from coder.train.trainer import Trainer

    metrics, biases = [], []
    tok, pos, seg = _batch(b=8, t=12)
    batch = dict(tokens=np.asarray(tok), positions=np.asarray(pos), segment_ids=np.asarray(seg),
                 loss_mask=np.ones(tok.shape, np.float32))
    for scan in (False, True):
        c = base.get_config()
        # two steps on one batch: at 1e-3 the bias keeps the routing, so it cannot step back to 0
        c.model = _cfg(scan, bias_update_rate=1e-3)
        c.mesh.update(dict(data=1, fsdp=-1))
        c.train.update(dict(grad_accum=2, lr=1e-2, warmup_steps=0))
        # the module's seed-0 variables (Trainer's own init would compile the model's init again),
        # computed here: first computed inside the Trainer's jitted init, _init's cache would
        # keep that trace's values (the test then failed when it ran first in its worker)
        _init(scan)
        tr = Trainer(c, str(tmp_path / f"scan{scan}"), lm_loss_fn(c.train),
                     model_fn=lambda scan=scan: _model(scan, bias_update_rate=1e-3),
                     post_update=router_balancing(c.model))
        metrics.append([tr.train_step(batch) for _ in range(2)])
        model = tr.model
        biases.append(np.concatenate([np.atleast_2d(np.asarray(m.bias[...])) for m in moe_layers(model)]))
        tr.close()
    for a, b in zip(*metrics):
        np.testing.assert_allclose(float(b["loss"]), float(a["loss"]), rtol=1e-5)
        np.testing.assert_allclose(float(b["load_imbalance"]), float(a["load_imbalance"]), rtol=1e-5)
    assert np.abs(biases[0]).max() > 0  # the update ran
    np.testing.assert_array_equal(biases[1], biases[0])


def test_stacked_weights_shard_like_their_layers():
    from configs import base

    mesh_cfg = base.get_config().mesh
    mesh_cfg.update(dict(data=2, expert=4))
    mesh = sharding.make_mesh(mesh_cfg)
    rules = tuple(tuple(r) for r in mesh_cfg.rules)
    scanned = nnx.eval_shape(lambda: Transformer(_cfg(True), rngs=nnx.Rngs(0)))
    unrolled = nnx.eval_shape(lambda: Transformer(_cfg(False), rngs=nnx.Rngs(0)))
    s = sharding.state_shardings(nnx.state(scanned), mesh, rules)
    u = sharding.state_shardings(nnx.state(unrolled), mesh, rules)
    stacked = s["moe_stack"]["mlp"]["wg"].get_value().spec
    single = u["layers"][2]["mlp"]["wg"].get_value().spec
    assert tuple(stacked) == (None, *single) and "expert" in str(single)


NSA = dict(attention_backend="nsa", max_position_embeddings=64,
           nsa={"compress_block": 8, "compress_stride": 4, "select_block": 8, "select_topk": 3, "window": 16})


@pytest.mark.slow  # 22 s dense, 49 s NSA
@pytest.mark.parametrize("kw", [{}, NSA], ids=["dense", "nsa"])
def test_engine_on_the_scanned_model_equals_the_unrolled_one(kw):
    """The engine's prefill and multi-step decode (plain and with one MTP draft) over the scanned
    model's stacked cache: the unrolled model's tokens, its logprobs to float32 rounding, for the
    dense cached attention and NSA's (whose compressed entries are written back per layer)."""
    from coder.infer.engine import Engine, SamplingParams

    # from one seed (kw adds NSA's gate variables, so not _init's copies)
    unrolled, scanned = (Transformer(_cfg(scan, **kw), rngs=nnx.Rngs(0)) for scan in (False, True))
    prompt = jax.random.randint(jax.random.key(4), (20,), 1, 64).tolist()
    runs = []
    for model in (unrolled, scanned):
        for k in (0, 1):
            engine = Engine(model, model.cfg, max_len=64, batch_buckets=(2,), len_buckets=(32, 64),
                            speculative_k=k)
            group = engine.start_group(prompt, 2)
            greedy = engine.generate(group, SamplingParams(temperature=0.0, max_new_tokens=12), jax.random.key(0))
            engine.append(group, 1, [5, 6, 7])  # an observation prefilled as a chunk into row 1
            sampled = engine.generate(group, SamplingParams(temperature=1.0, max_new_tokens=8), jax.random.key(1),
                                      rows=[1])
            runs.append([(g.tokens, g.logprobs) for g in greedy + sampled])
    for k in (0, 1):
        for (tok_u, lp_u), (tok_s, lp_s) in zip(runs[k], runs[2 + k]):
            assert tok_u == tok_s
            np.testing.assert_allclose(lp_s, lp_u, atol=2e-5, rtol=0)
