"""coder.model.sharding on 8 fake CPU devices: same logits and grads on several meshes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from coder.model import Transformer, sharding
from tests.model.model_inputs import cuda_grids, mesh_cfg


def tiny(**kw):
    from configs.base import model_config

    cfg = model_config()
    cfg.update(dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, n_group=2, topk_group=1,
                    num_experts_per_tok=2, num_mtp_layers=1, q_lora_rank=8, dtype="float32",
                    initializer_range=0.1))
    cfg.update(kw)
    return cfg





TOKENS_OVER_EXPERT = {"batch": ("data", "fsdp", "expert")}
# every axis in at least one layout; data and fsdp alone (no expert axis: the MoE's un-split
# shard_map, as in tensor4_seq2) add no path of their own: fsdp is split in the expert layouts
LAYOUTS = {
    "expert4_data2": mesh_cfg(data=2, expert=4),  # tokens replicated over expert: psum path
    "expert4_fsdp2_tokens": mesh_cfg(TOKENS_OVER_EXPERT, fsdp=2, expert=4),  # gather / scatter
    "tensor2_expert2_fsdp2": mesh_cfg(fsdp=2, expert=2, tensor=2),
    "tensor4_seq2": mesh_cfg(tensor=4, sequence=2),
    # sequence parallelism: the residual stream split over sequence x tensor, attention's
    # queries over sequence and its heads over tensor (the docs/scale layout, smaller)
    "seq2_tensor2_expert2_sp": mesh_cfg({"res_seq": ("sequence", "tensor")}, sequence=2, tensor=2,
                                        expert=2),
}


def batch(b=8, t=8):
    tok = jax.random.randint(jax.random.key(0), (b, t), 1, 64, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = jnp.ones((b, t), jnp.int32).at[:, 6:].set(2)  # two documents per row
    return tok, pos, seg


def loss_fn(model, tok, pos, seg):
    logits, aux = model(tok, pos, seg)
    lp = jax.nn.log_softmax(logits[:, :-1])
    ce = -jnp.take_along_axis(lp, tok[:, 1:, None], -1).mean()
    return ce + 0.1 * jnp.mean(aux["mtp_logits"] ** 2), logits


def run(model):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, *batch())
    return loss, logits, grads


@pytest.fixture(scope="module")
def reference():
    cfg = tiny()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    loss, logits, grads = nnx.jit(run)(model)
    return cfg, nnx.state(model), (loss, logits, dict(nnx.to_flat_state(grads))), nnx.graphdef(model)


def copy_of(reference):
    """A new model holding a copy of the reference's variables (the seed-0 init, not re-run)."""
    cfg, state, _, graphdef = reference
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


# the three costliest layouts (~15 s each) run only in the full suite
SLOW_LAYOUTS = {"expert4_data2", "tensor2_expert2_fsdp2", "seq2_tensor2_expert2_sp"}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_LAYOUTS else k
                                    for k in sorted(LAYOUTS)])
def test_same_logits_and_grads(layout, reference):
    """Every layout against the unsharded reference. The sequence-parallel one runs the shared
    experts data-parallel on the stream's own tokens (model.moe_shared_data_parallel, as the
    docs/scale configs do); the others tensor-parallel."""
    cfg, state, (loss0, logits0, grads0), _ = reference
    mcfg = LAYOUTS[layout]
    sharding.validate(cfg, mcfg, 8)
    mesh = sharding.make_mesh(mcfg)
    model = copy_of(reference)
    if layout.endswith("_sp"):  # same variables, the shared experts' other layout
        shared_dp = tiny(moe_shared_data_parallel=True)
        model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Transformer(shared_dp, rngs=nnx.Rngs(0)))),
                          nnx.state(model))
        assert model.layers[1].mlp.shared.data_parallel
    sharding.shard_model(model, mesh, mcfg.rules)
    with sharding.activate(mesh, mcfg.rules):
        loss, logits, grads = nnx.jit(run)(model)
    np.testing.assert_allclose(loss, loss0, rtol=1e-5)
    np.testing.assert_allclose(logits, logits0, atol=2e-5)
    for p, g in nnx.to_flat_state(grads):
        np.testing.assert_allclose(g.get_value(), grads0[p].get_value(), atol=2e-5, err_msg=str(p))


def test_expert_weights_are_split(reference):
    cfg, mcfg = tiny(), LAYOUTS["expert4_fsdp2_tokens"]
    mesh = sharding.make_mesh(mcfg)
    model = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh, mcfg.rules)
    wg = model.layers[1].mlp.wg[...]  # [E=8, D=32, F=16], spec (expert, fsdp, tensor=1)
    assert wg.sharding.spec == P("expert", "fsdp", "tensor")  # tensor has size 1 here
    shards = wg.addressable_shards
    assert len(shards) == 8 and all(s.data.shape == (2, 16, 16) for s in shards)
    experts_on = {}
    for s in shards:
        experts_on.setdefault(s.device, set()).update(range(*s.index[0].indices(8)))
    assert all(len(e) == 2 for e in experts_on.values())  # each device holds 2 of the 8 experts
    # created-sharded parameters equal an unsharded init with the same seed (the reference's)
    ref = reference[1]
    np.testing.assert_allclose(np.asarray(wg), np.asarray(ref["layers"][1]["mlp"]["wg"][...]), rtol=1e-6)


def test_golden_partition_specs():
    """Every parameter's PartitionSpec for the tiny config under DeepSeek-V3's rules."""
    from configs.deepseek_v3_671b import get_config

    rules = get_config().mesh.rules
    model = nnx.eval_shape(lambda: Transformer(tiny(), rngs=nnx.Rngs(0)))
    got = {k: tuple(v) for k, v in sharding.param_specs(model, rules).items()}
    attn = {
        "input_layernorm/weight": (None,), "post_attention_layernorm/weight": (None,),
        "self_attn/q_a_proj": ("fsdp", None), "self_attn/q_a_layernorm/weight": (None,),
        "self_attn/q_b_proj": (None, "tensor", None), "self_attn/kv_a_proj": ("fsdp", None),
        "self_attn/kv_a_layernorm/weight": (None,), "self_attn/kv_b_proj": (None, "tensor", None),
        "self_attn/o_proj": ("tensor", None, "fsdp"),
    }
    dense = {"mlp/gate_proj": ("fsdp", "tensor"), "mlp/up_proj": ("fsdp", "tensor"),
             "mlp/down_proj": ("tensor", "fsdp")}
    moe = {"mlp/router": ("fsdp", None), "mlp/bias": (None,),
           "mlp/wg": ("expert", "fsdp", "tensor"), "mlp/wu": ("expert", "fsdp", "tensor"),
           "mlp/wd": ("expert", "tensor", "fsdp"), "mlp/shared/gate_proj": ("fsdp", "tensor"),
           "mlp/shared/up_proj": ("fsdp", "tensor"), "mlp/shared/down_proj": ("tensor", "fsdp")}
    want = {"embed": ("tensor", "fsdp"), "norm/weight": (None,), "lm_head": ("fsdp", "tensor"),
            "mtp/0/enorm/weight": (None,), "mtp/0/hnorm/weight": (None,),
            "mtp/0/eh_proj": (None, "fsdp"), "mtp/0/shared_head_norm/weight": (None,)}
    for prefix, table in (("layers/0/", {**attn, **dense}), ("layers/1/", {**attn, **moe}),
                          ("mtp/0/block/", {**attn, **moe})):
        want.update({prefix + k: v for k, v in table.items()})
    assert got == want


def test_validate_names_the_keys():
    cfg = tiny()
    with pytest.raises(ValueError, match="model.num_attention_heads"):
        sharding.validate(cfg, mesh_cfg(tensor=8), 8)
    with pytest.raises(ValueError, match="model.n_routed_experts"):
        sharding.validate(tiny(n_routed_experts=6, n_group=1), mesh_cfg(expert=4, data=2), 8)
    with pytest.raises(ValueError, match="devices"):
        sharding.validate(cfg, mesh_cfg(data=4, expert=4), 8)
    with pytest.raises(ValueError, match="model.topk_group"):
        sharding.validate(tiny(topk_group=3), mesh_cfg(data=-1), 8)
    assert sharding.validate(cfg, mesh_cfg(data=-1, expert=2), 8)["data"] == 4


def test_single_token_rows_run_expert_parallel_with_sequence_axis(reference):
    """A decode step feeds one token per row: the sequence axis cannot split it, so the expert
    shard_map holds the token replicated over `sequence` (and still returns the same logits)."""
    mcfg = mesh_cfg(TOKENS_OVER_EXPERT, expert=4, sequence=2)
    mesh = sharding.make_mesh(mcfg)
    tok, pos, seg = (x[:, :1] for x in batch(b=4))
    fwd = nnx.jit(lambda m, *a: m(*a)[0])
    want = fwd(copy_of(reference), tok, pos, seg)
    model = copy_of(reference)
    sharding.shard_model(model, mesh, mcfg.rules)
    with sharding.activate(mesh, mcfg.rules):
        got = fwd(model, tok, pos, seg)
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("layout", ["expert8", "expert4_fsdp2_tokens"])
def test_expert_capacity_under_expert_parallelism(layout):
    """With model.moe_capacity_factor each device's experts take their share of the pairs that
    device sees: replicated tokens (expert8) see the whole batch, tokens split over fsdp x
    expert gather each fsdp half; the logits and the dropped fraction equal the single-device
    layer run on what each device saw."""
    from coder.model.moe import moe_layers

    cfg = tiny(moe_capacity_factor=0.6)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    for moe in moe_layers(model):  # skewed routing: experts 4/5 overflow their capacity
        moe.bias[...] = jnp.zeros(8).at[5].set(10.0).at[4].set(5.0)
    state = nnx.state(model)
    tok, pos, seg = batch()
    halves = [slice(0, 8)] if layout == "expert8" else [slice(0, 4), slice(4, 8)]
    fwd = nnx.jit(lambda m, *a: m(*a))
    outs = [fwd(model, tok[h], pos[h], seg[h]) for h in halves]
    want = np.concatenate([np.asarray(o[0]) for o in outs])
    want_dropped = np.mean([float(o[1]["router_dropped"]) for o in outs])
    assert want_dropped > 0.05

    mcfg = mesh_cfg(expert=8) if layout == "expert8" else LAYOUTS[layout]
    mesh = sharding.make_mesh(mcfg)
    sharded = nnx.merge(nnx.graphdef(model), jax.tree.map(jnp.copy, state))
    sharding.shard_model(sharded, mesh, mcfg.rules)
    with sharding.activate(mesh, mcfg.rules):
        got, aux = fwd(sharded, tok, pos, seg)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert float(aux["router_dropped"]) == pytest.approx(want_dropped, rel=1e-5)


def test_platform_dependent_traces_the_branch_of_the_programs_platform(monkeypatch):
    """A program for CPU devices traces its cpu branch alone, one for a mesh of TPU devices (stage
    `compile` on a CPU host) its tpu branch alone; where the platform is left to the lowering
    (GPUs), jax.lax.platform_dependent traces every branch and the lowering picks one."""
    traced = []

    def branch(name, add):
        def fn(x):
            traced.append(name)
            return x + add
        return fn

    branches = dict(cpu=branch("cpu", 1.0), tpu=branch("tpu", 2.0), default=branch("default", 3.0))
    fn = jax.jit(lambda x: sharding.platform_dependent(x, **branches))
    assert float(fn(jnp.float32(0))) == 1.0 and traced == ["cpu"]

    pytest.importorskip("libtpu", reason="a mesh of TPU devices needs libtpu's topologies")
    from coder.train.aot import hardware as hw

    traced.clear()
    mesh = jax.sharding.Mesh(np.array(hw.topology_devices(hw.parse_topology("v5e-4"))), ("fsdp",))
    with sharding.activate(mesh, mesh_cfg().rules):
        assert sharding.target_platform() == "tpu"
        fn.trace(jax.ShapeDtypeStruct((), jnp.float32))
    assert traced == ["tpu"]

    traced.clear()
    monkeypatch.setattr(sharding, "target_platform", lambda: None)
    text = jax.jit(lambda x: sharding.platform_dependent(x, **branches)).trace(jnp.float32(0)).lower(
        lowering_platforms=("tpu",)).as_text()
    assert sorted(traced) == ["cpu", "default", "tpu"] and "2.0" in text and "1.0" not in text


def test_a_sequence_split_dense_model_lowered_for_cuda_splits_attention_by_queries(monkeypatch):
    """The model's dense attention on a GPU mesh with queries over 4 `sequence` devices and heads
    over 2 `tensor` ones: each device's Triton flash kernels take its 128 of the 512 queries
    (grid 128 / 64 query tiles) and its 2 heads, against all 512 keys
    (coder.model.attention_kernels.gpu_flash_attention; numbers in its tests)."""

    monkeypatch.setattr(sharding, "target_platform", lambda: None)  # decided where lowered, as on GPUs
    mc = mesh_cfg(sequence=4, tensor=2)
    model = Transformer(tiny(max_position_embeddings=512), rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    tok, pos, seg = batch(b=2, t=512)
    with sharding.activate(sharding.make_mesh(mc), mc.rules):
        grids = cuda_grids(lambda p: nnx.merge(graph, p, rest)(tok, pos, seg)[0], params)
    assert grids.pop("flash_fwd_at_positions") == (512 // 4 // 64, 2, 2), grids
    assert set(grids) <= {"grouped_matmul_gpu"}, grids  # the MoE layer's experts (coder.pallas.grouped_matmul_gpu)


def test_shared_prefix_rows_lowered_for_cuda_go_through_the_flash_kernel(monkeypatch):
    """The GRPO learner's shared-prefix rows (prefix_segment) lowered for CUDA: the model's dense
    attention takes the flash kernel's prefix mask, no [B,H,T,T] scores (XLA stays on TPU / CPU,
    where splash has no such mask)."""

    monkeypatch.setattr(sharding, "target_platform", lambda: None)
    model = Transformer(tiny(max_position_embeddings=256, num_mtp_layers=0), rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    tok, pos, _ = batch(b=1, t=256)
    seg = jnp.asarray([[1] * 100 + [2] * 80 + [3] * 76], jnp.int32)  # a prompt and two continuations
    pre = jnp.asarray([[0] * 100 + [1] * 156], jnp.int32)
    fwd = lambda p: nnx.merge(graph, p, rest)(tok, pos, seg, prefix_segment=pre)[0]
    assert set(cuda_grids(fwd, params)) - {"grouped_matmul_gpu"} == {"flash_fwd_at_positions"}  # + the MoE's experts
