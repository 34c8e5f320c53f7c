"""The MoE's TPU paths, run on CPU: the megablox grouped matmul (coder.model.grouped_matmul) in
Pallas interpret mode, under the dropless expert FFN (coder.model.expert_ffn) and the
ragged_all_to_all expert-parallel dispatch (coder.model.expert_dispatch; XLA:CPU has no
ragged-all-to-all, so `emulated_ragged_all_to_all` stands in for it inside the shard_map)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.model import expert_dispatch, expert_ffn, grouped_matmul, sharding
from coder.model.grouped_matmul import megablox_grouped_matmul
from tests.model.model_inputs import mesh_cfg


def _check_values_and_grads(f, f_ref, *args, atol_y=1e-5, rtol=1e-5, atol=1e-4):
    """f's output (atol_y) and the gradients of sum(f ** 2) w.r.t. every argument equal f_ref's;
    one jitted function (output and gradients) per implementation."""
    def run(fn):
        loss = lambda *a: (lambda y: (jnp.sum(y ** 2), y))(fn(*a))
        return jax.jit(jax.value_and_grad(loss, tuple(range(len(args))), has_aux=True))(*args)

    (_, y), g = run(f)
    (_, y_ref), g_ref = run(f_ref)
    np.testing.assert_allclose(y, y_ref, atol=atol_y)
    for a, b in zip(g, g_ref, strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("sizes,tiling", [
    ([3, 0, 70, 5], (16, 16, 8)),  # empty group, groups across 16-row tiles, 22 rows past the last
    ([40, 40, 0, 20], (32, 16, 8)),  # an empty last-but-one group, every row in a group
    ([0, 0, 0, 0], None),  # nothing routed here: every row past the last group
    ([10, 20, 0, 0], None),  # default tiling: one 112-row tile, K and N padded to 128
])
def test_megablox_grouped_matmul_equals_ragged_dot(sizes, tiling):
    """Values and gradients w.r.t. x and w of the megablox kernels (interpret mode) equal
    jax.lax.ragged_dot's. Interpret mode fills uninitialised output with NaN, so rows past the
    last group (forward output and dx) check the masking."""
    x = jax.random.normal(jax.random.key(0), (100, 16))
    w = jax.random.normal(jax.random.key(1), (4, 16, 8))
    gs = jnp.asarray(sizes, jnp.int32)
    f = lambda x, w: megablox_grouped_matmul(x, w, gs, interpret=True, tiling=tiling)
    f_ref = lambda x, w: jax.lax.ragged_dot(x, w, gs)
    _check_values_and_grads(f, f_ref, x, w)


def test_gmm_tiling_divides_shapes():
    """tk = tn divides both K and N (megablox's backward swaps them); tm a multiple of 16."""
    assert grouped_matmul.gmm_tiling(100, 128, 128) == (112, 128, 128)
    assert grouped_matmul.gmm_tiling(4096, 7168, 2048) == (512, 512, 512)
    assert grouped_matmul.gmm_tiling(4096, 7168, 768) == (512, 256, 256)
    assert grouped_matmul.gmm_tiling(4096, 384, 640) == (512, 128, 128)


def test_sorted_ffn_with_megablox_equals_ragged_dot(monkeypatch):
    """The dropless FFN with megablox as its grouped matmul (interpret mode, its row masks left to
    sorted_ffn: NaN in the rows it leaves unwritten) against ragged_dot: pairs of non-local
    experts sort past the last group (expert parallelism's layout)."""
    k = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(k[0], (24, 16))
    ids = jax.random.randint(k[1], (24, 2), 0, 8).at[:, 0].set(jnp.arange(24) % 3)  # expert 3: none
    w = jax.random.uniform(k[2], (24, 2))
    wg, wu = jax.random.normal(k[3], (4, 16, 8)), jax.random.normal(k[4], (4, 16, 8))
    wd = jax.random.normal(k[5], (4, 8, 16))
    ffn = lambda x, wg, wu, wd: expert_ffn.sorted_ffn(x, ids, w, wg, wu, wd, first_expert=2)
    mb = functools.partial(megablox_grouped_matmul, interpret=True, tiling=(16, 16, 8))
    run = lambda: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(ffn(*a) ** 2), (0, 1, 2, 3)))(x, wg, wu, wd)
    with monkeypatch.context() as m:
        m.setattr(expert_ffn, "grouped_matmul", lambda x, w, gs, mask_rows=True: jax.lax.ragged_dot(x, w, gs))
        want = run()
    monkeypatch.setattr(expert_ffn, "grouped_matmul", mb)
    got = run()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("k,n", [(256, 128), (16, 8)])  # tiny widths: padded to 128 lanes
def test_grouped_matmul_lowers_megablox_for_tpu(k, n, monkeypatch):
    """grouped_matmul picks megablox (a Mosaic custom call) when lowered for TPU and the Triton kernels for GPU, from this CPU
    host (as stage compile does), forward and backward, with block shapes Mosaic accepts (it
    checks them while lowering); the CPU program has none, the GPU program no ragged dot."""
    monkeypatch.setattr(sharding, "target_platform", lambda: None)  # decided where lowered: each lowering below
    x = jnp.ones((64, k), jnp.bfloat16)
    w = jnp.ones((4, k, n), jnp.bfloat16)
    gs = jnp.array([10, 0, 30, 4], jnp.int32)
    loss = lambda x, w: jnp.sum(grouped_matmul.grouped_matmul(x, w, gs).astype(jnp.float32) ** 2)
    step = jax.jit(jax.grad(loss, (0, 1)))
    tpu = step.trace(x, w).lower(lowering_platforms=("tpu",)).as_text()
    assert tpu.count("tpu_custom_call") == 3  # gmm forward, gmm for dx, tgmm for dw
    assert "@tgmm" in tpu
    assert "tpu_custom_call" not in step.trace(x, w).lower().as_text()
    # GPU: coder's Triton kernels (gmm forward, gmm for dx, tgmm for dw), never a ragged dot
    # (XLA would multiply every row by every group)
    cuda = step.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "chlo.ragged_dot" not in cuda and "tpu_custom_call" not in cuda
    assert cuda.count("__gpu$xla.gpu.triton") == 3, cuda.count("__gpu$xla.gpu.triton")


# ----------------------------------------------------------------------------- ragged dispatch
def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics from all-gathers (XLA:CPU cannot compile the
    real one): slice i of each device's (input_offsets, send_sizes) goes to device
    i // (len / axis size), written at that device at the sender's output_offsets[i]; other
    rows keep `output`. recv_sizes must equal the senders' send_sizes (as for the real one):
    the rows written are the senders' send_sizes."""
    del recv_sizes
    ops = jax.lax.all_gather(operand, axis_name)  # [devices, N, ...]
    io, ss, oo = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    n_dev, per = ops.shape[0], io.shape[1] // ops.shape[0]
    mine = jax.lax.axis_index(axis_name) * per + jnp.arange(per)  # the slices sent to me
    io, ss, oo = (jnp.take(a, mine, axis=1).reshape(-1) for a in (io, ss, oo))  # [devices*per]
    src = jnp.repeat(jnp.arange(n_dev), per)
    rows = jnp.arange(output.shape[0])
    inside = (rows[None] >= oo[:, None]) & (rows[None] < (oo + ss)[:, None])  # [slices, M]
    which = jnp.argmax(inside, axis=0)
    got = ops[src[which], jnp.clip(io[which] + rows - oo[which], 0, ops.shape[1] - 1)]
    keep = inside.any(0).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(keep, got, output)


def test_emulated_ragged_all_to_all_matches_documented_example():
    """The emulation reproduces the example in jax.lax.ragged_all_to_all's docstring."""
    from jax.sharding import AxisType, Mesh, PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("x",), axis_types=(AxisType.Auto,))
    args = (jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32), jnp.zeros((2, 4), jnp.float32),
            jnp.array([[0, 1], [0, 1]], jnp.int32), jnp.array([[1, 2], [1, 1]], jnp.int32),
            jnp.array([[0, 0], [1, 2]], jnp.int32), jnp.array([[1, 1], [2, 1]], jnp.int32))
    f = lambda *a: emulated_ragged_all_to_all(*(v[0] for v in a), axis_name="x")[None]
    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(*args)
    np.testing.assert_array_equal(out, [[1, 3, 0, 0], [2, 2, 4, 0]])


def _mesh(rules_override=None, **axes):
    m = mesh_cfg(rules_override, **axes)
    return sharding.make_mesh(m), sharding.rules_dict(m.rules)


def _routing(b, t, k=2, n_experts=8, seed=0):
    """Uneven routing: experts 2 and 3 get no pair, expert 6 most of them."""
    ks = jax.random.split(jax.random.key(seed), 7)
    x = jax.random.normal(ks[0], (b, t, 16))
    choice = jnp.array([0, 1, 4, 5, 6, 6, 6, 7])
    ids = choice[jax.random.randint(ks[1], (b, t, k), 0, 8)]
    ids = ids.at[..., 1].set(jnp.where(ids[..., 1] == ids[..., 0], (ids[..., 0] + 1) % 8 // 4 * 4 + 1, ids[..., 1]))
    w = jax.random.uniform(ks[2], (b, t, k))
    wg, wu = (jax.random.normal(kk, (n_experts, 16, 8)) for kk in ks[3:5])
    wd = jax.random.normal(ks[5], (n_experts, 8, 16))
    return x, ids.astype(jnp.int32), w, wg, wu, wd


LAYOUTS = {  # name: (mesh axes, batch rule override, batch, seq)
    # tokens replicated over expert, each device routes its slice and an all-gather restores
    # the replication; 20 tokens over 8 replicas: slices of 3, the 7th padded, the 8th all padding
    "expert8_padded": (dict(expert=8), None, 5, 4),
    # tokens split over data x expert (batch) and over sequence
    "data2_expert2_seq2_tokens": (dict(data=2, expert=2, sequence=2), ("data", "fsdp", "expert"), 4, 8),
    "expert4_tensor2": (dict(expert=4, tensor=2), None, 8, 4),  # F split: psum of partial sums
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ragged_dispatch_equals_all_gather(layout):
    """Output and gradients (x, routing weights, every expert weight) of the ragged_all_to_all
    dispatch (emulated collective) equal the all-gather dispatch's: tokens replicated over the
    expert axis (each device routes its slice, padded past the tokens; an all-gather restores
    replication), tokens split over data x expert x sequence, and F split over tensor (psum of
    the partial sums)."""
    axes, batch_rule, b, t = LAYOUTS[layout]
    mesh, rules = _mesh({"batch": batch_rule} if batch_rule else None, **axes)
    x, ids, w, wg, wu, wd = _routing(b, t)
    assert not ((ids == 2) | (ids == 3)).any()
    split = tuple(tuple(a for a in axes if mesh.shape[a] > 1)
                  for axes in expert_dispatch._token_layout(mesh, rules, b, t))  # tokens, seq, exp, exp_mlp
    share, _ = expert_dispatch.ragged_buffer(mesh, rules, b, t, 2, 0.0)
    want = {"expert8_padded": ((), (), ("expert",), (), 3),
            "data2_expert2_seq2_tokens": (("data", "expert"), ("sequence",), ("expert",), (), 4),
            "expert4_tensor2": ((), (), ("expert",), ("tensor",), 8)}[layout]
    assert (*split, share) == want  # the layout the case names (share: tokens each device routes)

    def run(dispatch):
        def loss(x, w, wg, wu, wd):
            y, dropped = expert_dispatch.expert_parallel_ffn(
                x, ids, w, wg, wu, wd, mesh, rules, dispatch=dispatch,
                ragged_a2a=emulated_ragged_all_to_all)
            return jnp.sum(y ** 2), (y, dropped)
        return jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True)

    # one compile for both dispatches
    ((l_ref, (y_ref, _)), g_ref), ((l, (y, dropped)), g) = jax.jit(
        lambda *a: (run("all_gather")(*a), run("ragged_all_to_all")(*a)))(x, w, wg, wu, wd)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-4)
    assert not np.asarray(dropped).any()
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)
    assert np.abs(np.asarray(g[2][2:4])).max() == 0  # experts without pairs: no gradient


def test_ragged_dispatch_with_megablox_unmasked_equals_all_gather(monkeypatch):
    """The ragged dispatch's grouped matmuls as TPU runs them: megablox without its row masks
    (mask_rows=False; interpret mode fills the rows the kernels leave unwritten, forward output
    and dx, with NaN), in the worst-case receive buffer (mostly past the groups). Output and
    every gradient are finite and equal the all-gather dispatch's."""
    mesh, rules = _mesh(data=2, expert=4)
    x, ids, w, wg, wu, wd = _routing(8, 4)

    def run(dispatch):
        def loss(x, w, wg, wu, wd):
            y, _ = expert_dispatch.expert_parallel_ffn(x, ids, w, wg, wu, wd, mesh, rules, dispatch=dispatch,
                                                       ragged_a2a=emulated_ragged_all_to_all)
            return jnp.sum(y ** 2), y
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True))(x, w, wg, wu, wd)

    (_, y_ref), g_ref = run("all_gather")
    calls = []

    def unmasked_megablox(x, w, group_sizes, mask_rows=True):
        calls.append(mask_rows)
        return megablox_grouped_matmul(x, w, group_sizes, interpret=True, tiling=(8, 16, 8),
                                       mask_rows=mask_rows)

    monkeypatch.setattr(expert_dispatch, "grouped_matmul", unmasked_megablox)
    (_, y), g = run("ragged_all_to_all")
    assert calls and not any(calls)  # every grouped matmul of the dispatch ran unmasked
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-4)
    for a, b in zip(g, g_ref, strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


def test_ragged_dispatch_bounded_buffer_drops_overflow_in_device_order():
    """model.moe_a2a_buffer_factor = 1: each receiver keeps the first share*k rows of its
    senders' pairs (senders in device order, each sender's pairs by expert then token); the
    rest are dropped and counted. Reference: the all-gather dispatch with those pairs' weights
    zeroed, the dropped pairs found by a numpy loop."""
    mesh, rules = _mesh(data=2, expert=4)  # tokens split over data, replicated over expert
    b, t, k = 8, 4, 2
    x, ids, w, wg, wu, wd = _routing(b, t, k)
    share, rows = b // 2 * t // 4, b // 2 * t // 4 * k  # tokens per device, buffer rows
    ids_np = np.asarray(ids).reshape(2, 4, share, k)  # [data half, expert index (source), token, k]
    drop = np.zeros_like(ids_np, bool)
    for h in range(2):
        for dst in range(4):
            filled = 0
            for src in range(4):
                pairs = [(e, n, j) for n in range(share) for j, e in enumerate(ids_np[h, src, n])
                         if e // 2 == dst]
                for e, n, j in sorted(pairs, key=lambda p: p[0]):  # stable: token order per expert
                    drop[h, src, n, j] = filled >= rows
                    filled += 1
    drop = drop.reshape(b, t, k)
    assert drop.any() and not drop.all()  # expert 6's device overflows, others do not
    y, dropped = jax.jit(lambda *a: expert_dispatch.expert_parallel_ffn(
        *a, mesh, rules, dispatch="ragged_all_to_all", buffer_factor=1.0,
        ragged_a2a=emulated_ragged_all_to_all))(x, ids, w, wg, wu, wd)
    y_ref, _ = jax.jit(lambda *a: expert_dispatch.expert_parallel_ffn(*a, mesh, rules, dispatch="all_gather"))(
        x, ids, jnp.where(drop, 0.0, w), wg, wu, wd)
    np.testing.assert_array_equal(dropped, drop.sum(-1))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-4)


def test_moe_layer_lowers_with_ragged_dispatch(monkeypatch):
    """The MoE layer (forward and backward) under an expert-parallel mesh lowers with the ragged
    dispatch: forced (model.moe_dispatch="ragged_all_to_all"; XLA:CPU could not compile it) and
    "auto" lowered for TPU from this host (ragged_all_to_all + megablox); "auto" on CPU lowers the
    all-gather form."""
    from flax import nnx

    from coder.model.moe import MoE
    from tests.model.model_inputs import tiny_moe

    mesh, rules = _mesh(data=2, expert=4)
    x = jnp.ones((8, 4, 16))
    valid = jnp.ones((8, 4), bool)

    def lowered(dispatch, platforms=None):
        moe = MoE(tiny_moe(moe_dispatch=dispatch), rngs=nnx.Rngs(0))
        graph, params, rest = nnx.split(moe, nnx.Param, ...)

        def loss(params, x):
            y, stats = nnx.merge(graph, params, rest)(x, valid)
            return jnp.sum(y ** 2)

        with sharding.activate(mesh, tuple(rules.items())):
            step = jax.jit(jax.grad(loss, (0, 1))).trace(params, x)
            return step.lower(lowering_platforms=platforms).as_text()

    forced = lowered("ragged_all_to_all")
    assert forced.count("ragged_all_to_all") == 4  # pairs there and back, and the transposes
    with monkeypatch.context() as m:
        m.setattr(sharding, "target_platform", lambda: None)  # decided where lowered: each lowering below
        tpu = lowered("auto", ("tpu",))
    assert tpu.count("ragged_all_to_all") == 4 and "tpu_custom_call" in tpu
    assert "ragged_all_to_all" not in lowered("auto")
