"""The model's `nsa` attention backend: MLA in absorbed form through coder.pallas.nsa.

Causality and document masking hold end to end (a later token or another document never changes
a logit), every NSA parameter gets a gradient, and a few optimizer steps lower the loss. Cached
calls (decode, chunked prefill, the engine): tests/model/test_nsa_engine.py.

Which NSA implementation the full forward runs (MLA._nsa): lowered for CUDA from this CPU host
(`lowering_platforms=("cuda",)`, JAX needs no GPU for that), the model's forward and its gradient
carry the Mosaic GPU kernels' custom calls; a layer they cannot take lowers to the XLA path with
the reason logged; and forced through the pallas_gpu implementation in GPU interpret mode
(`force_nsa_impl`), the model's logits and gradients match the XLA path's. Not shown here (no
GPU): PTX compilation and running on hardware (tests/pallas/test_nsa_gpu.py's docstring)."""
import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax._src.pallas.mosaic_gpu.interpret.params import (
    InterpretGPUParams,  # not yet exported by plgpu
)
from tests.nsa_inputs import fast_compiles  # noqa: F401

from coder.model import Transformer, attention, sharding
from coder.pallas.nsa import ops
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


@pytest.mark.slow
@pytest.mark.parametrize("forced", [None, "pallas_tpu"])
def test_sequence_sharded_nsa_equals_unsharded_forward_and_backward(monkeypatch, caplog, forced):
    """Queries split over the mesh's `sequence` axis (8 CPU devices, 5 queries each: the 8-token
    window's halo spans shards, and the first shard's reaches past the row's start): the layer
    runs each device's queries in a shard_map against the gathered keys, and the logits and
    gradients equal the unsharded model's (the XLA path over whole rows).
    - forced None: the platform's choice where the program is lowered (as on GPUs; here the
      CPU's: the XLA path at the shard's offset), logged;
    - forced "pallas_tpu": the Pallas TPU kernels, the selected kernels at the shard's traced
      offset, the window kernels behind a halo of dummy queries. Run by Pallas's generic
      interpreter (`interpret=True`: 4 s here; TPU interpret mode, which also simulates DMAs
      and memory spaces, took 69 s for these 8 devices x 2 layers, and checks the same kernels
      at an offset in tests/pallas/test_nsa_tpu.py). Their sums run in another order than the
      XLA path's: measured differences 4.8e-7 (loss ~4.2), 8.9e-7 (logits) and 5.8e-8
      (gradients), under the tolerances below (rtol 1e-6, atol 1e-5 and 1e-6)."""
    from tests.model.model_inputs import mesh_cfg

    def loss_and_logits(m, tok, pos, seg):
        logits = m(tok, pos, seg)[0]
        nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tok[..., None], -1)[..., 0]
        return jnp.mean(nll), logits

    step = nnx.jit(nnx.value_and_grad(loss_and_logits, has_aux=True))
    tok, pos, seg = inputs()
    (loss0, logits0), grads0 = step(Transformer(nsa_cfg(), rngs=nnx.Rngs(0)), tok, pos, seg)
    mc = mesh_cfg(sequence=8)
    mesh = sharding.make_mesh(mc)
    model = Transformer(nsa_cfg(), rngs=nnx.Rngs(0))
    sharding.shard_model(model, mesh, mc.rules)
    monkeypatch.setattr(sharding, "target_platform", lambda: None)  # decided where lowered, as for a GPU
    monkeypatch.setattr(attention, "_NSA_LOGGED", set())
    step = nnx.jit(nnx.value_and_grad(loss_and_logits, has_aux=True))  # traced again, inside the blocks
    kernel = ops.Kernel(backend="pallas_tpu", interpret=True)
    with (sharding.activate(mesh, mc.rules), caplog.at_level(logging.WARNING, logger=attention.__name__),
          attention.force_nsa_impl(forced, kernel) if forced else contextlib.nullcontext()):
        (loss, logits), grads = step(model, tok, pos, seg)
        text = step.lower(model, tok, pos, seg).compile().as_text()
    assert "all-gather" in text  # the keys, gathered for each device's queries
    logged = any("8 sequence shards" in r.getMessage() and "shard_map" in r.getMessage() for r in caplog.records)
    assert logged == (forced is None)
    if forced:
        with sharding.activate(mesh, mc.rules), attention.force_nsa_impl(forced, kernel):
            jaxpr = str(jax.make_jaxpr(lambda m: loss_and_logits(m, tok, pos, seg))(model))
        assert "pallas_call" in jaxpr, "the forced impl must reach the kernels"
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    np.testing.assert_allclose(logits, logits0, atol=1e-5)
    flat0 = dict(nnx.to_flat_state(grads0))
    for path, g in nnx.to_flat_state(grads):
        np.testing.assert_allclose(g.get_value(), flat0[path].get_value(), atol=1e-6, err_msg=str(path))


def test_forcing_a_whole_row_impl_on_a_sequence_split_layer_raises():
    """Under a `sequence`-split mesh the reference (whole rows only) cannot take a shard's
    queries: forcing it raises, naming what can be forced, rather than running a path the
    layer does not take."""
    from tests.model.model_inputs import mesh_cfg

    mc = mesh_cfg(sequence=8)
    mesh = sharding.make_mesh(mc)
    model = Transformer(nsa_cfg(), rngs=nnx.Rngs(0))
    tok, pos, seg = inputs()
    with (sharding.activate(mesh, mc.rules), attention.force_nsa_impl("reference"),
          pytest.raises(ValueError, match="8 sequence shards.*'xla', 'pallas_tpu' and 'pallas_gpu'")):
        jax.make_jaxpr(lambda m: m(tok, pos, seg)[0])(model)


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



# ---------------------------------------------------------------- GPU kernels in the model

def gpu_cfg():
    """nsa_cfg() at widths the Mosaic GPU kernels take: 64-token selection blocks (their only
    size), key width r + dr = 128 and value width r = 64 (multiples of 64), 2 heads (padded to 64
    wgmma rows); one layer and a window of 24 < T, so interpret mode stays short."""
    cfg = nsa_cfg()
    cfg.update({"num_hidden_layers": 1, "first_k_dense_replace": 1, "num_attention_heads": 2,
                "kv_lora_rank": 64, "qk_rope_head_dim": 64})
    cfg.nsa.update({"select_block": 64, "window": 24})
    return cfg


def two_documents():
    """One row: tokens, positions and segments of two documents (25 and 15 tokens)."""
    tok = jnp.asarray(np.random.default_rng(2).integers(1, 64, (1, T)).astype(np.int32))
    pos = jnp.concatenate([jnp.arange(25), jnp.arange(T - 25)])[None].astype(jnp.int32)
    seg = jnp.concatenate([jnp.ones((1, 25), jnp.int32), jnp.full((1, T - 25), 2, jnp.int32)], 1)
    return tok, pos, seg


def split_params(model):
    """-> (fn(params) = the model with these params, params): jax transforms take the params alone."""
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    return lambda p: nnx.merge(graph, p, rest), params


def lowered(f, params, *platforms):
    """f(params) lowered for each of `platforms` from this CPU host -> texts. Traced once, except
    for TPU: traced and lowered under an abstract TPU device, which the TPU kernels ask for their
    chip."""
    traced = jax.jit(f).trace(params)
    device = jax.sharding.AbstractDevice(device_kind="TPU v5p", num_cores=1, platform="tpu")

    def lower(platform):
        if platform != "tpu":
            return traced.lower(lowering_platforms=(platform,)).as_text()
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
            return jax.jit(f).trace(params).lower(lowering_platforms=("tpu",)).as_text()

    return [lower(p) for p in platforms]


@pytest.mark.slow
def test_model_lowers_to_the_mosaic_gpu_kernels_for_cuda(monkeypatch):
    """The model's forward lowered for CUDA holds the two forward kernels (selected, window), its
    gradient also the four backward ones (dQ and dK/dV of each branch); the same forward lowered
    for TPU holds the Pallas TPU kernels and no Mosaic GPU one, for CPU neither."""
    monkeypatch.setattr(sharding, "target_platform", lambda: None)  # decided where lowered, as on GPUs
    with_params, params = split_params(Transformer(gpu_cfg(), rngs=nnx.Rngs(0)))
    tok, pos, seg = two_documents()
    fwd_ = lambda p: with_params(p)(tok, pos, seg)[0]
    gpu_call = "stablehlo.custom_call @mosaic_gpu"
    cuda, tpu, cpu = lowered(fwd_, params, "cuda", "tpu", "cpu")
    assert cuda.count(gpu_call) == 2
    assert "tpu_custom_call" in tpu and "mosaic_gpu" not in tpu
    assert "tpu_custom_call" not in cpu and "mosaic_gpu" not in cpu
    [cuda_grad] = lowered(jax.grad(lambda p: jnp.sum(fwd_(p))), params, "cuda")
    assert cuda_grad.count(gpu_call) == 6


@pytest.mark.slow
def test_sequence_sharded_model_lowered_for_cuda_holds_the_gpu_kernels(monkeypatch):
    """Queries split over 8 `sequence` shards (5 each): the model lowered for CUDA runs the
    shard_map's queries through the Mosaic GPU kernels at the shard's offset, two forward
    kernels and six in its gradient, as the whole-row layer does (their numbers:
    tests/pallas/test_nsa_gpu.py, a piece at a traced offset in GPU interpret mode)."""
    from tests.model.model_inputs import mesh_cfg

    monkeypatch.setattr(sharding, "target_platform", lambda: None)  # decided where lowered, as on GPUs
    mc = mesh_cfg(sequence=8)
    with_params, params = split_params(Transformer(gpu_cfg(), rngs=nnx.Rngs(0)))
    tok, pos, seg = two_documents()
    fwd_ = lambda p: with_params(p)(tok, pos, seg)[0]
    gpu_call = "stablehlo.custom_call @mosaic_gpu"
    with sharding.activate(sharding.make_mesh(mc), mc.rules):
        [cuda] = lowered(fwd_, params, "cuda")
        [cuda_grad] = lowered(jax.grad(lambda p: jnp.sum(fwd_(p))), params, "cuda")
    assert "sdy.manual_computation" in cuda or "shard_map" in cuda
    assert cuda.count(gpu_call) == 2 and cuda_grad.count(gpu_call) == 6


def test_a_layer_the_gpu_kernels_cannot_take_lowers_to_xla_with_the_reason_logged(monkeypatch, caplog):
    """nsa_cfg(): selection blocks of 8 and widths 20 / 16. Lowered for CUDA: no Mosaic GPU kernel,
    and one warning naming the config keys (both layers take the XLA path; the reason is logged
    once per process); forcing pallas_gpu raises instead."""
    monkeypatch.setattr(sharding, "target_platform", lambda: None)
    monkeypatch.setattr(attention, "_NSA_LOGGED", set())
    model = Transformer(nsa_cfg(), rngs=nnx.Rngs(0))
    with_params, params = split_params(model)
    tok, pos, seg = inputs()
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        [text] = lowered(lambda p: with_params(p)(tok, pos, seg)[0], params, "cuda")
    assert "mosaic_gpu" not in text
    warnings = [r.getMessage() for r in caplog.records if "XLA path" in r.getMessage()]
    assert len(warnings) == 1 and "model.nsa.select_block=8" in warnings[0], warnings
    with pytest.raises(ValueError, match="model.nsa.select_block=8"), attention.force_nsa_impl("pallas_gpu"):
        jax.jit(lambda p: with_params(p)(tok, pos, seg)[0]).trace(params)


def _loss_logits_grads(model, impl, kernel=None):
    """Mean next-token loss, logits and parameter gradients of one row of two documents, with
    NSA's full forward forced to `impl` (traced inside the block: a fresh jit each call), and the
    program's jaxpr (text)."""
    with_params, params = split_params(model)
    tok, pos, seg = two_documents()

    def loss(p):
        logits = with_params(p)(tok, pos, seg)[0]
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], -1)), logits

    with attention.force_nsa_impl(impl, kernel):
        traced = jax.jit(jax.value_and_grad(loss, has_aux=True)).trace(params)
    (value, logits), grads = traced.lower().compile()(params)
    return value, logits, grads, str(traced.jaxpr)


def with_compression_mlps(model):
    """model with random W2 in NSA's compressors: at init W2 = 0 (phi is mean pooling), so W1 would
    get no gradient and the position embedding of the keys exactly none (a shift of every
    compressed key shifts every score of a query alike); random W2 gives every parameter one."""
    _, params = split_params(model)
    rng = np.random.default_rng(3)
    w2 = lambda path, x: (0.1 * rng.standard_normal(x.shape).astype(x.dtype)
                          if "w2" in jax.tree_util.keystr(path) else x)
    nnx.update(model, jax.tree_util.tree_map_with_path(w2, params))
    return model


@pytest.mark.slow
def test_model_through_the_gpu_kernels_matches_xla_in_interpret_mode():
    """Forward and backward of the model with NSA on the Mosaic GPU kernels (GPU interpret mode,
    the kernels' own window tile 64 and head tile) == the XLA path: loss, logits and every
    parameter's gradient (each nonzero), to the kernels' bf16 operand rounding (~3 significant
    digits of each array's largest entry; measured 0.03-0.4%). 38-46 s on 2 shared CPU cores,
    most of it the kernels' backward in interpret mode (the selected branch runs one CTA per
    token)."""
    model = with_compression_mlps(Transformer(gpu_cfg(), rngs=nnx.Rngs(0)))
    kernel = ops.Kernel(backend="pallas_gpu", interpret=InterpretGPUParams())
    got, want = _loss_logits_grads(model, "pallas_gpu", kernel), _loss_logits_grads(model, "xla")
    assert "wgmma" in got[3] and "wgmma" not in want[3], "the forced impl must reach the GPU kernels"

    def close(a, b, msg):
        scale = float(jnp.max(jnp.abs(b)))
        assert scale > 0, f"{msg}: no gradient to compare"
        np.testing.assert_allclose(a, b, atol=1e-2 * scale, err_msg=msg)

    close(got[0], want[0], "loss")
    close(got[1], want[1], "logits")
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(want[2])]
    for path, a, b in zip(paths, jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
        close(a, b, f"d{path}")
    assert sum("nsa" in p for p in paths) == 8  # compress_k/v (pos, w1, w2), gate_w, gate_b
