"""coder.model.moe and its parts (routing, expert_ffn, grouped_matmul): dropless routing vs a
per-token loop, balancing bias, router replay, capacity-bounded experts."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.model import Transformer
from coder.model.moe import MoE, moe_layers, update_router_bias
from tests.model.model_inputs import tiny_moe





def _np_reference(moe: MoE, x: np.ndarray, cfg) -> np.ndarray:
    """Per-token loop: DeepSeek-V3 routing and every chosen expert, written out in numpy."""
    wr, b = np.asarray(moe.router[...]), np.asarray(moe.bias[...])
    wg, wu, wd = (np.asarray(w[...]) for w in (moe.wg, moe.wu, moe.wd))
    sh = moe.shared
    silu = lambda v: v / (1 + np.exp(-v))
    e, g = cfg.n_routed_experts, cfg.n_group
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        s = 1 / (1 + np.exp(-(x[n] @ wr)))
        c = s + b
        group_score = [np.sort(c[i * e // g:(i + 1) * e // g])[-2:].sum() for i in range(g)]
        groups = np.argsort(group_score)[-cfg.topk_group:]
        allowed = np.concatenate([np.arange(i * e // g, (i + 1) * e // g) for i in groups])
        chosen = allowed[np.argsort(c[allowed])[-cfg.num_experts_per_tok:]]
        w = s[chosen] / s[chosen].sum() if cfg.norm_topk_prob else s[chosen]
        for j, ex in zip(w * cfg.routed_scaling_factor, chosen):
            out[n] += j * ((silu(x[n] @ wg[ex]) * (x[n] @ wu[ex])) @ wd[ex])
        out[n] += (silu(x[n] @ np.asarray(sh.gate_proj[...])) * (x[n] @ np.asarray(sh.up_proj[...]))) @ np.asarray(sh.down_proj[...])
    return out


def test_dropless_matches_per_token_loop():
    cfg = tiny_moe()
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.bias[...] = 0.05 * jax.random.normal(jax.random.key(1), (8,))
    x = jax.random.normal(jax.random.key(2), (2, 16, 16))
    valid = jnp.ones((2, 16), bool)
    y, stats = nnx.jit(lambda m, x, v: m(x, v))(moe, x, valid)
    np.testing.assert_allclose(y.reshape(32, 16), _np_reference(moe, np.asarray(x).reshape(32, 16), cfg),
                               atol=2e-5)
    # group-limited: each token's experts lie in at most topk_group of the n_group groups
    groups = np.asarray(stats["expert_ids"]) // 2
    assert max(len(set(r)) for r in groups.reshape(-1, 3)) <= 2
    # skewed: a large bias sends every token to expert 5 — no token is dropped
    moe.bias[...] = jnp.zeros(8).at[5].set(10.0)
    y, stats = nnx.jit(lambda m, x, v: m(x, v))(moe, x, valid)
    assert (np.asarray(stats["expert_ids"]) == 5).any(-1).all()
    np.testing.assert_allclose(y.reshape(32, 16), _np_reference(moe, np.asarray(x).reshape(32, 16), cfg),
                               atol=2e-5)


def test_bias_update_moves_load_toward_uniform():
    cfg = tiny_moe(n_group=1, topk_group=1, num_experts_per_tok=2)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    layers = moe_layers(model)  # the trunk's MoE layer, then the MTP module's
    assert len(layers) == 2
    # skewed inputs: every token shares a direction u that experts 0 and 1 prefer
    u = jax.random.normal(jax.random.key(3), (16,))
    x = u + 0.3 * jax.random.normal(jax.random.key(4), (4, 32, 16))
    for moe in layers:
        moe.router[...] = moe.router[...].at[:, :2].add(0.5 * u[:, None])
    valid = jnp.ones((4, 32), bool)
    loads = nnx.jit(lambda ms: jnp.stack([m(x, valid)[1]["load"] for m in ms]))
    first = np.asarray(loads(layers))
    load, history = first, []
    for _ in range(80):
        update_router_bias(model, load[:1], 0.01, mtp_router_load=load[1:])
        load = loads(layers)
        history.append(np.asarray(load))
    last = np.mean(history[-20:], axis=0)  # sign updates oscillate around balance: average
    dev = lambda l: np.abs(l - 1 / 8).max(-1)
    assert (dev(first) > 0.25).all(), first  # the input really is skewed
    assert (dev(last) < 0.4 * dev(first)).all(), (first, last)
    # the bias is not a parameter: the optimizer never sees it
    assert not any(p[-1] == "bias" for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_routing_replay_reproduces_forward():
    cfg = tiny_moe()
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    tok = jax.random.randint(jax.random.key(4), (2, 16), 1, 64, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    seg = jnp.ones((2, 16), jnp.int32)
    fwd = nnx.jit(lambda m, r: m(tok, pos, seg, routing=r))
    logits, aux = fwd(model, None)
    ids = aux["expert_ids"]
    replay, aux2 = fwd(model, ids)
    np.testing.assert_array_equal(np.asarray(replay), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(aux2["expert_ids"]), np.asarray(ids))
    for moe in moe_layers(model):  # a changed bias would route differently ...
        moe.bias[...] = 0.5 * jax.random.normal(jax.random.key(5), (8,))
    moved, aux3 = fwd(model, None)
    assert (np.asarray(aux3["expert_ids"]) != np.asarray(ids)).any()
    replay2, aux4 = fwd(model, ids)  # ... but replay keeps the recorded choice
    np.testing.assert_allclose(np.asarray(replay2), np.asarray(logits), atol=1e-6)
    # router_ids: each router's own choice, the one replay overrode (the first MoE layer sees
    # the same input either way; later ones see the replayed layers' output)
    np.testing.assert_array_equal(np.asarray(aux3["router_ids"]), np.asarray(aux3["expert_ids"]))
    np.testing.assert_array_equal(np.asarray(aux4["expert_ids"]), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(aux4["router_ids"][0]), np.asarray(aux3["expert_ids"][0]))
    assert (np.asarray(aux4["router_ids"]) != np.asarray(ids)).any()


@pytest.mark.parametrize("rows", [100, 6])  # padded blocks; per-row gathered weights (decode)
def test_block_grouped_matmul_equals_ragged_dot(rows):
    """The CPU grouped matmul: same values and gradients as jax.lax.ragged_dot, incl. empty
    groups and rows past the last group (non-local experts)."""
    from coder.model.grouped_matmul import block_grouped_matmul

    x = jax.random.normal(jax.random.key(0), (rows, 16))
    w = jax.random.normal(jax.random.key(1), (4, 16, 8))
    cases = ([3, 0, 70, 5], [0, 0, 0, 0], [40, 40, 0, 20], [10, 20, 0, 0]) if rows == 100 else (
        [1, 0, 3, 1], [0, 0, 0, 0], [2, 2, 0, 2], [3, 0, 0, 0])
    for sizes in cases:
        gs = jnp.asarray(sizes, jnp.int32)
        f_ref = lambda x, w: jax.lax.ragged_dot(x, w, gs)
        f = lambda x, w: block_grouped_matmul(x, w, gs, block=16)
        np.testing.assert_allclose(f(x, w), f_ref(x, w), atol=1e-5)
        g_ref = jax.grad(lambda x, w: jnp.sum(f_ref(x, w) ** 2), (0, 1))(x, w)
        g = jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), (0, 1))(x, w)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def _np_capacity_reference(moe: MoE, x: np.ndarray, ids: np.ndarray, w: np.ndarray, cap: int):
    """Routed experts only, each expert keeping its first `cap` pairs in token order."""
    wg, wu, wd = (np.asarray(v[...]) for v in (moe.wg, moe.wu, moe.wd))
    silu = lambda v: v / (1 + np.exp(-v))
    out, taken, dropped = np.zeros_like(x), collections.Counter(), np.zeros(x.shape[0])
    for n in range(x.shape[0]):
        for j, ex in zip(w[n], ids[n]):
            if taken[ex] >= cap:
                dropped[n] += 1
                continue
            taken[ex] += 1
            out[n] += j * ((silu(x[n] @ wg[ex]) * (x[n] @ wu[ex])) @ wd[ex])
    return out, dropped


def test_capacity_drops_pairs_past_each_experts_capacity_in_token_order():
    from coder.model.expert_ffn import capacity_ffn, expert_capacity
    from coder.model.routing import route

    cfg = tiny_moe(n_shared_experts=0, moe_capacity_factor=0.5)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.bias[...] = jnp.zeros(8).at[5].set(10.0)  # every token wants expert 5: it overflows
    x = jax.random.normal(jax.random.key(2), (2, 16, 16))
    valid = jnp.ones((2, 16), bool).at[1, 12:].set(False)
    y, stats = nnx.jit(lambda m, x, v: m(x, v))(moe, x, valid)
    xf = np.asarray(x).reshape(32, 16)
    logits = xf @ np.asarray(moe.router[...])
    weights, ids = route(jnp.asarray(logits), moe.bias[...], cfg)
    cap = expert_capacity(32 * 3, 8, 0.5)
    assert cap == 8  # ceil(0.5 * 96 / 8) = 6, rounded up to 8
    want, n_dropped = _np_capacity_reference(moe, xf, np.asarray(ids), np.asarray(weights), cap)
    np.testing.assert_allclose(np.asarray(y).reshape(32, 16), want, atol=2e-5)
    assert n_dropped.sum() >= 32 - cap  # at least expert 5's pairs past the 8th
    valid_tokens = np.asarray(valid).reshape(-1)
    assert float(stats["dropped"]) == pytest.approx(n_dropped[valid_tokens].sum() / (28 * 3))
    # a capacity that holds every pair is the dropless layer
    out, dropped = capacity_ffn(jnp.asarray(xf), ids, weights, moe.wg[...], moe.wu[...],
                                moe.wd[...], capacity=96)
    dropless = MoE(tiny_moe(n_shared_experts=0), rngs=nnx.Rngs(0))
    nnx.update(dropless, nnx.state(moe))
    y0, stats0 = dropless(x, valid)
    np.testing.assert_allclose(out, np.asarray(y0).reshape(32, 16), atol=2e-5)
    assert not np.asarray(dropped).any() and "dropped" not in stats0


def test_all_local_sorted_ffn_gathers_in_and_out():
    """Without expert parallelism (every expert local) the pairs reach the experts and return by
    gathers (dispatch_rows, combine_rows: their cotangents are gathers too), equal to the masked
    scatter-add form in values and in the gradients of x, the weights and the router gates; the
    differentiated program holds no scatter-add and no select over the pairs' rows."""
    from coder.model.expert_ffn import sorted_ffn

    k = jax.random.split(jax.random.key(1), 6)
    n, d, f, e = 10, 16, 8, 4
    x = jax.random.normal(k[0], (n, d))
    ids = jax.random.randint(k[1], (n, 3), 0, e).at[:, 0].set(jnp.arange(n) % 2)  # expert 2 / 3 used less
    w = jax.random.uniform(k[2], (n, 3))
    wg, wu = jax.random.normal(k[3], (e, d, f)), jax.random.normal(k[4], (e, d, f))
    wd = jax.random.normal(k[5], (e, f, d))
    grads = {}
    for all_local in (False, True):
        fn = lambda x, w, wg, wd: jnp.sum(sorted_ffn(x, ids, w, wg, wu, wd, all_local=all_local) ** 2)  # noqa: B023
        grads[all_local] = jax.value_and_grad(fn, (0, 1, 2, 3))(x, w, wg, wd)
    for a, b in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    def token_scatter_adds(all_local):  # scatter-adds into the tokens' rows [n, d] (the CPU
        # grouped matmul's own backward and the group sizes' bincount have scatter-adds of their own)
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(
            sorted_ffn(x, ids, w, wg, wu, wd, all_local=all_local) ** 2), (0, 1)))(x, w))
        return jaxpr.count(f"f32[{n},{d}] = scatter-add")

    assert token_scatter_adds(True) == 0
    assert token_scatter_adds(False) == 2  # the combine forward, the gather's transpose


def test_dense_ffn_equals_sorted_ffn():
    """The CPU decode form (every local expert on every token) equals the sorted grouped form,
    values and gradients, with pairs routed to experts that are not local (expert parallelism)."""
    from coder.model.expert_ffn import dense_ffn, sorted_ffn

    k = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(k[0], (6, 16))
    ids = jax.random.randint(k[1], (6, 2), 0, 8)
    w = jax.random.uniform(k[2], (6, 2))
    wg, wu = jax.random.normal(k[3], (4, 16, 8)), jax.random.normal(k[4], (4, 16, 8))
    wd = jax.random.normal(k[5], (4, 8, 16))
    for first in (0, 4, 2):  # experts first..first+3 are local
        f = lambda *a: dense_ffn(*a, first_expert=first)
        g = lambda *a: sorted_ffn(*a, first_expert=first)
        np.testing.assert_allclose(f(x, ids, w, wg, wu, wd), g(x, ids, w, wg, wu, wd), rtol=1e-5, atol=1e-4)
        loss = lambda fn: jax.grad(lambda x, wg, wd: jnp.sum(fn(x, ids, w, wg, wu, wd) ** 2), (0, 1, 2))
        for a, b in zip(loss(f)(x, wg, wd), loss(g)(x, wg, wd)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)
