"""Muon's per-parameter matrices (coder/train/optim.py muon_dimension_numbers).

Each N-D parameter kind gets one Muon step from `make_optimizer` that must equal optax's own
Muon on the 2-D matrices the parameter stands for (fused heads reshaped, expert / layer axes as
separate matrices); the real model's parameters (unrolled and scan-stacked) must all get a rule.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from coder.train.optim import (
    _MUON_RMS,
    decay_mask,
    lr_schedule,
    make_optimizer,
    muon_dimension_numbers,
)
from configs import base, quickstart

MuonDims = optax.contrib.MuonDimensionNumbers


def train_cfg(**kw):
    c = base.get_config().train
    c.optimizer = "muon"
    c.lr = 2e-2
    c.warmup_steps = 0
    c.grad_clip = 0.0  # the reference optimizer has no clipping
    c.weight_decay = 0.1
    for k, v in kw.items():
        c[k] = v
    return c


def nest(path: str, value) -> dict:
    """nest("a/b/c", x) == {"a": {"b": {"c": x}}}."""
    for key in reversed(path.split("/")):
        value = {key: value}
    return value


def one_step(tx, params, grads):
    """The updates of tx's first step (jitted: eager Newton-Schulz dispatches op by op)."""
    return jax.tree.map(np.asarray, jax.jit(lambda p, g: tx.update(g, tx.init(p), p)[0])(params, grads))


def leaf(tree, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


# (parameter path, shape, N-D array -> its matrices [n, in, out])
KINDS = [
    # 2-D [in, out]
    ("layers/mlp/gate_proj", (24, 40), lambda x: x[None]),
    # MLA q_b_proj [q_lora, H, dq] -> [q_lora, H*dq]; q_proj [D, H, dq] -> [D, H*dq]
    ("self_attn/q_b_proj", (16, 4, 12), lambda x: x.reshape(1, 16, 48)),
    ("self_attn/q_proj", (24, 4, 12), lambda x: x.reshape(1, 24, 48)),
    # MLA kv_b_proj [r, H, dn+dv] -> [r, H*(dn+dv)]
    ("self_attn/kv_b_proj", (20, 4, 14), lambda x: x.reshape(1, 20, 56)),
    # MLA o_proj [H, dv, D] -> [H*dv, D]
    ("self_attn/o_proj", (4, 6, 24), lambda x: x.reshape(1, 24, 24)),
    # NSA gates [D, H, 3] -> [D, H*3]
    ("self_attn/nsa/gate_w", (24, 4, 3), lambda x: x.reshape(1, 24, 12)),
    # routed experts [E, in, out] -> E matrices
    ("mlp/wg", (2, 24, 10), lambda x: x),
    ("mlp/wd", (2, 10, 24), lambda x: x),
    # scan-stacked layers [L, ...]: one more batch axis
    ("moe_stack/mlp/wu", (2, 2, 24, 10), lambda x: x.reshape(4, 24, 10)),
    ("moe_stack/mlp/router", (2, 24, 3), lambda x: x),
    ("moe_stack/self_attn/kv_b_proj", (2, 20, 4, 14), lambda x: x.reshape(2, 20, 56)),
    ("moe_stack/self_attn/o_proj", (2, 4, 6, 24), lambda x: x.reshape(2, 24, 24)),
]


@pytest.fixture(scope="module")
def one_step_per_kind():
    """{path: (our update as matrices, optax's update of those matrices)} for every KINDS
    entry; all kinds in one params tree (one compilation per optimizer keeps this fast)."""
    cfg = train_cfg()
    rng = np.random.default_rng(0)  # numpy data: eager jax.random would compile per shape
    ws = {path: 0.5 * rng.standard_normal(shape, np.float32) for path, shape, _ in KINDS}
    gs = {path: rng.standard_normal(shape, np.float32) for path, shape, _ in KINDS}

    def tree(arrays):
        out = {}
        for path, x in arrays.items():
            node = out
            *parents, name = path.split("/")
            for key in parents:
                node = node.setdefault(key, {})
            node[name] = x
        return out

    updates = one_step(make_optimizer(cfg), tree(ws), tree(gs))

    # optax's Muon with its default rule: every 2-D parameter is one [in, out] matrix
    ref_tx = optax.contrib.muon(
        learning_rate=lr_schedule(cfg), beta=float(cfg.b1), weight_decay=float(cfg.weight_decay),
        adam_b1=float(cfg.b1), adam_b2=float(cfg.b2), adam_weight_decay=float(cfg.weight_decay),
        consistent_rms=_MUON_RMS)
    matrices = {path: (to_matrices(ws[path]), to_matrices(gs[path])) for path, _, to_matrices in KINDS}
    ref_params = {f"{path}#{i}": w[i] for path, (w, _) in matrices.items() for i in range(w.shape[0])}
    ref_grads = {f"{path}#{i}": g[i] for path, (_, g) in matrices.items() for i in range(g.shape[0])}
    ref_updates = one_step(ref_tx, ref_params, ref_grads)

    out = {}
    for path, _, to_matrices in KINDS:
        n = matrices[path][0].shape[0]
        ref = np.stack([ref_updates[f"{path}#{i}"] for i in range(n)])
        out[path] = (to_matrices(leaf(updates, path)), ref)
    return out


@pytest.mark.parametrize("path", [k[0] for k in KINDS])
def test_muon_step_equals_optax_muon_on_the_matrices(one_step_per_kind, path):
    ours, ref = one_step_per_kind[path]
    assert ours.shape == ref.shape
    scale = np.abs(ref).max()
    assert scale > 0
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5 * scale)


def test_tables_vectors_and_biases_stay_on_adamw():
    params = {
        "embed": jnp.zeros((32, 8)),
        "lm_head": jnp.zeros((8, 32)),
        "norm": {"weight": jnp.ones((8,))},
        "moe_stack": {"input_layernorm": {"weight": jnp.ones((2, 8))},
                      "self_attn": {"nsa": {"gate_b": jnp.zeros((2, 4, 3)),
                                            "compress_k": {"pos": jnp.zeros((2, 4, 8)),
                                                           "w1": jnp.zeros((2, 32, 8))}}}},
    }
    dims = muon_dimension_numbers(params)
    assert dims["embed"] is None and dims["lm_head"] is None and dims["norm"]["weight"] is None
    stack = dims["moe_stack"]
    assert stack["input_layernorm"]["weight"] is None  # a stacked norm [L, D] is a vector
    assert stack["self_attn"]["nsa"]["gate_b"] is None
    assert stack["self_attn"]["nsa"]["compress_k"]["pos"] is None
    assert stack["self_attn"]["nsa"]["compress_k"]["w1"] == MuonDims((1,), (2,))
    mask = decay_mask(params)
    assert mask["embed"] and mask["lm_head"] and not mask["norm"]["weight"]
    assert not mask["moe_stack"]["input_layernorm"]["weight"]
    assert not mask["moe_stack"]["self_attn"]["nsa"]["gate_b"]
    assert mask["moe_stack"]["self_attn"]["nsa"]["compress_k"]["w1"]


@pytest.mark.parametrize("params,match", [
    (nest("layers/0/self_attn/mystery", jnp.zeros((4, 2, 3))), "layers/0/self_attn/mystery"),
    (nest("moe_stack/mlp/wg", jnp.zeros((4, 8, 8))), "moe_stack/mlp/wg"),  # a 2-D expert?
    (nest("self_attn/o_proj", jnp.zeros((2, 4, 6, 8))), "self_attn/o_proj"),  # stacked, unmarked
])
def test_unknown_shapes_raise_naming_the_parameter(params, match):
    with pytest.raises(ValueError, match=match):
        muon_dimension_numbers(params)
    with pytest.raises(ValueError, match=match):
        make_optimizer(train_cfg()).init(params)


def _expected(names: tuple, ndim: int):
    """The test's own table: per-layer kind -> Muon axes, shifted by the stack's layer axis."""
    lead = int("moe_stack" in names)
    name = names[-1]
    if name in ("embed", "lm_head", "weight", "pos", "gate_b") or ndim - lead <= 1:
        return None
    if name in ("q_proj", "q_b_proj", "kv_b_proj", "gate_w"):
        return MuonDims((lead,), (lead + 1, lead + 2))
    if name == "o_proj":
        return MuonDims((lead, lead + 1), (lead + 2,))
    if name in ("wg", "wu", "wd"):
        return MuonDims((lead + 1,), (lead + 2,))
    assert ndim - lead == 2, names
    return MuonDims((lead,), (lead + 1,))


def _names(path) -> tuple:
    """A params path's names, without the nnx.Variable's `value` attribute."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path
                 if getattr(k, "name", None) != "value")


@pytest.mark.parametrize("scan_layers,q_lora_rank,backend", [
    (False, 0, "dense"), (True, 0, "dense"), (False, 16, "nsa"), (True, 16, "nsa")])
def test_every_model_parameter_gets_its_rule(scan_layers, q_lora_rank, backend):
    from coder.model import Transformer

    mcfg = quickstart.get_config().model
    mcfg.scan_layers = scan_layers
    mcfg.q_lora_rank = q_lora_rank
    mcfg.attention_backend = backend
    model = nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0)))
    params = nnx.split(model, nnx.Param, ...)[1]

    is_rule = lambda x: x is None or isinstance(x, MuonDims)
    dims = muon_dimension_numbers(params)
    got = {_names(p): d for p, d in jax.tree_util.tree_flatten_with_path(dims, is_leaf=is_rule)[0]}
    shapes = {_names(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert got.keys() == shapes.keys()
    for names, shape in shapes.items():
        assert got[names] == _expected(names, len(shape)), (names, shape)

    on_muon = {n for n, d in got.items() if d is not None}
    # every MLA projection and routed expert is on Muon, stacked or not
    attn = ("q_b_proj" if q_lora_rank else "q_proj", "kv_b_proj", "o_proj")
    attn += ("gate_w",) if backend == "nsa" else ()
    for kind in attn:
        assert sum(n[-1] == kind for n in on_muon) == 3, kind  # 2 trunk layers + the MTP layer
    for kind in ("wg", "wu", "wd"):
        assert sum(n[-1] == kind for n in on_muon) == 2, kind  # the MoE layer + the MTP layer
    if scan_layers:  # the 4-D stacked experts [L, E, D, F]
        assert ("moe_stack", "mlp", "wg") in on_muon and shapes[("moe_stack", "mlp", "wg")] == (1, 4, 128, 64)

    # the optimizer's own partition agrees: Muon momentum exactly for those parameters
    tx = make_optimizer(train_cfg(grad_clip=1.0))
    state = jax.eval_shape(tx.init, params)
    muon_state = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]
                  if any(getattr(k, "key", None) == "muon" for k in p)
                  and any(getattr(k, "name", None) == "mu" for k in p)]
    mu_names = set()
    for p in muon_state:
        i = next(i for i, k in enumerate(p) if getattr(k, "name", None) == "mu")
        mu_names.add(_names(p[i + 1:]))
    assert mu_names == on_muon
    jax.eval_shape(tx.update, params, state, params)  # one step traces
