"""stage=compile: AOT compilation for TPU topologies on this CPU (libtpu) and its report.

The HLO-analysis tests use a small stand-in sharded function; the stage tests compile the
quickstart model's real training step, RL engine programs and GRPO learner step for a TPU v5e
2x2 slice.
"""
import collections
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from coder.stages import compile as C
from coder.stages import compile_report
from coder.train.aot import hardware as hw

libtpu = pytest.importorskip("libtpu", reason="the tpu extra (libtpu) is needed for TPU topologies")


@pytest.fixture(autouse=True, scope="module")
def _compile_only_executables_not_cached():
    """This module's own TPU compiles (stand-ins, the DCN test) too (see the stage's run)."""
    with hw.without_persistent_cache():
        yield


# ----------------------------------------------------------------------------- topologies
@pytest.mark.parametrize("spec, slices, libtpu_name, chips, name", [
    ("v5e-4", 1, "v5e:2x2", 4, "v5e-4"),
    ("v5p-512", 1, "v5:4x8x8", 256, "v5p-512"),
    ("v5p:4x4x4", 1, "v5:4x4x4", 64, "v5p-128"),
    ("v6e-256", 2, "v6e:16x16", 512, "2xv6e-256"),
    ("v4-8", 1, "v4:2x2x1", 4, "v4-8"),
])
def test_parse_topology(spec, slices, libtpu_name, chips, name):
    t = hw.parse_topology(spec, slices)
    assert (t.libtpu_name, t.num_chips, t.name) == (libtpu_name, chips, name)


@pytest.mark.parametrize("spec", ["v5e-3", "v7-8", "v5p-7", "v5p:4x4", "tpu"])
def test_parse_topology_rejects_unknown_slices(spec):
    with pytest.raises(ValueError, match="compile.topology"):
        hw.parse_topology(spec)


def test_topology_devices_are_tpu_chips_of_every_slice():
    devs = hw.topology_devices(hw.parse_topology("v5p-16", 2))
    assert len(devs) == 16
    assert {d.platform for d in devs} == {"tpu"}
    assert {d.device_kind for d in devs} == {hw.CHIPS["v5p"].device_kind}
    assert collections.Counter(d.slice_index for d in devs) == {0: 8, 1: 8}
    assert jax.devices()[0].platform == "cpu"  # the default backend is untouched


def test_tpu_mesh_puts_slices_on_the_data_axis():
    from coder.model import sharding

    from configs import base

    devices = hw.topology_devices(hw.parse_topology("v5e-4", 2))
    mesh_cfg = base.get_config().mesh
    mesh_cfg.update(dict(data=2, fsdp=4, num_slices=2))
    mesh = sharding.make_mesh(mesh_cfg, devices)
    assert dict(mesh.shape) == dict(data=2, fsdp=4, expert=1, tensor=1, sequence=1)
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()  # only `data` crosses the DCN
    mesh_cfg.update(dict(data=1, fsdp=1, tensor=8))  # no data-parallel axis to span slices
    with pytest.raises(ValueError, match="num_slices=2 must divide"):
        sharding.make_mesh(mesh_cfg, devices)


# ----------------------------------------------------------------------------- HLO analysis
def _stand_in(mesh, layers, scan):
    """grad of an L-layer tanh MLP with weights sharded over fsdp: [L, 512, 512] f32."""
    w = jax.ShapeDtypeStruct((layers, 512, 512), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "fsdp", None)))
    x = jax.ShapeDtypeStruct((32, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))

    def loss(w, x):
        if scan:
            h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl.astype(h.dtype)), None), x, w)
        else:
            h = x
            for i in range(layers):
                h = jnp.tanh(h @ w[i].astype(h.dtype))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss)).lower(w, x).compile()


@pytest.fixture(scope="module")
def v5e_mesh():
    return Mesh(np.array(hw.topology_devices(hw.parse_topology("v5e-4"))), ("fsdp",))


def test_loop_trip_counts_restore_the_flops_xla_counts_once(v5e_mesh):
    layers = 6
    unrolled = _stand_in(v5e_mesh, layers, scan=False)
    scanned = _stand_in(v5e_mesh, layers, scan=True)
    matmul = 3 * 2 * 32 * 512 * 512 * layers / 4  # fwd + 2 bwd matmuls per layer, per chip
    xla_unrolled = unrolled.cost_analysis()["flops"]
    xla_scanned = scanned.cost_analysis()["flops"]
    assert xla_unrolled == pytest.approx(matmul, rel=0.05)
    assert xla_scanned < 0.5 * matmul  # XLA counts the loop body once

    module = C.parse_hlo(scanned.as_text())
    runs, unknown = C.multiplicities(module)
    assert not unknown
    assert max(runs.values()) == layers  # the loop bodies run once per layer
    flops, traffic = C.loop_corrected_cost(module, xla_scanned,
                                           scanned.cost_analysis()["bytes accessed"])
    assert flops == pytest.approx(xla_unrolled, rel=0.05)
    assert traffic > scanned.cost_analysis()["bytes accessed"]


def test_padded_convolution_counts_the_taps_that_meet_data():
    """XLA:TPU's input gradient of a matmul over heads: a window of 4 slid over one element
    padded 3 on each side meets data once per output (as the forward's dot), not 4 times."""
    from coder.train.aot.hlo_stats import dot_flops

    module = C.parse_hlo("""HloModule m
ENTRY %main (a: bf16[3,64,256,1], b: bf16[4,32,256,1]) -> bf16[3,64,4,32] {
  %a = bf16[3,64,256,1]{2,1,3,0} parameter(0)
  %b = bf16[4,32,256,1]{2,1,0,3} parameter(1)
  ROOT %c = bf16[3,64,4,32]{3,1,2,0} convolution(%a, %b), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
}
""")
    ins = module.computations["main"]
    shapes = {i.name: i.shape for i in ins}
    assert dot_flops(module, ins[-1], shapes) == 2 * (3 * 64 * 4 * 32) * 256


def test_hbm_traffic_is_attributed_to_its_source_ops(v5e_mesh):
    """traffic_by_source: the scanned stand-in's bytes per step, by JAX op, forward / backward."""
    from coder.train.aot.hlo_stats import instruction_traffic, source_op, traffic_by_source

    compiled = _stand_in(v5e_mesh, 4, scan=True)
    module = C.parse_hlo(compiled.as_text())
    runs, _ = C.multiplicities(module)
    top = traffic_by_source(module, runs, top=100)
    total = sum(runs.get(c, 0) * b for c, _, b in instruction_traffic(module))
    assert sum(b for _, b in top) == pytest.approx(total) and total > 0
    assert [b for _, b in top] == sorted((b for _, b in top), reverse=True)
    labels = {src for src, _ in top}
    assert any(s.startswith("forward: ") for s in labels) and any(s.startswith("backward: ") for s in labels)
    ins = C.parse_hlo("""HloModule m
ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%c, metadata={op_name="jit(train_step)/while/body/closed_call/vmap(transpose(jvp(btd,de->bte)))/checkpoint/rematted_computation/dot_general"}
}
""").computations["main"][-1]
    assert source_op(ins) == "backward (remat): btd,de->bte/dot_general"


def test_batched_matmul_weight_gradient_counts_one_tap_per_output(v5e_mesh):
    # XLA:TPU writes the weight gradient of a batched matmul as a convolution whose window spans
    # the batch over an lhs-dilated input: only one tap per output meets real data
    g, b, k, n = 16, 128, 256, 512
    one = NamedSharding(v5e_mesh, P())
    x = jax.ShapeDtypeStruct((g, b, k), jnp.bfloat16, sharding=one)
    w = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=one)
    loss = lambda x, w: jnp.einsum("gbk,gkn->gbn", x, w).astype(jnp.float32).sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()
    module = C.parse_hlo(compiled.as_text())
    from coder.train.aot.hlo_stats import per_computation_costs

    convs = [i for c in module.computations.values() for i in c if i.opcode == "convolution"]
    assert convs, "XLA:TPU no longer writes this gradient as a convolution: the test is moot"
    counted = sum(f for f, _ in per_computation_costs(module).values())
    assert counted == pytest.approx(2 * 2 * g * b * k * n, rel=0.01)  # dX and dW


def test_collectives_are_counted_per_execution(v5e_mesh):
    layers = 5
    compiled = _stand_in(v5e_mesh, layers, scan=True)
    module = C.parse_hlo(compiled.as_text())
    runs, _ = C.multiplicities(module)
    stats = C.collective_stats(module, runs, num_devices=4)
    gathers = stats["all-gather"]
    # each layer's weight shard is all-gathered in the forward (and again in the backward)
    assert gathers["count"] >= 1 and gathers["executed"] >= layers
    per_layer = 512 * 512 * 2  # bf16 weight of one layer, gathered whole on every chip
    assert gathers["bytes"] >= layers * per_layer
    assert gathers["wire_bytes"] == pytest.approx(gathers["bytes"] * 3 / 4)


@pytest.mark.parametrize("attrs, n", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 4),
    ("replica_groups=[2,4]<=[8], to_apply=%add", 4),
    ("replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add", 2),
    ("replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}, dimensions={1}", 4),
    ("replica_groups=mesh['data'=2,'fsdp'=4] {'data','fsdp'}, dimensions={1}", 8),
    ("replica_groups={}, to_apply=%add", 16),
])
def test_group_size_reads_every_replica_group_spelling(attrs, n):
    assert C.group_size(attrs, 16) == n


def test_memory_report_flags_a_step_over_hbm_and_advice_names_the_fix():
    Stats = collections.namedtuple("Stats", "argument_size_in_bytes output_size_in_bytes "
                                   "alias_size_in_bytes temp_size_in_bytes "
                                   "generated_code_size_in_bytes peak_memory_in_bytes "
                                   "host_argument_size_in_bytes host_output_size_in_bytes "
                                   "host_temp_size_in_bytes")
    gib = 2**30
    stats = Stats(12 * gib, 12 * gib, 12 * gib, 6 * gib, 0, 0, 0, 0, 0)
    mem = C.memory_report(stats, 16 * 10**9, params=4 * gib, optimizer=8 * gib, batch=0)
    assert mem["total_bytes"] == 18 * gib and not mem["fits"]
    assert mem["fraction_of_hbm"] > 1

    from configs import base
    config = base.get_config()
    report = dict(memory=mem, setup=dict(mesh={"data": 4}),
                  roofline=dict(bound="compute", step_time_lower_s=1.0, step_time_serial_s=2.0))
    tips = " ".join(C.advice(report, config))
    assert "train.offload_optimizer=True" in tips and "model.remat=full" in tips


@pytest.mark.parametrize("message, used, hbm", [
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
     "hbm. Used 120.53G of 95.74G hbm. Exceeded hbm capacity by 24.79G.", 120.53, 95.74),
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
     "temporaries (4.97T) exceeds available HBM (95.74G).", 4.97 * 1024, 95.74),
])
def test_hbm_overflow_reads_xla_tpu_out_of_memory_errors(message, used, hbm):
    got = C.hbm_overflow(message)
    assert got[0] == pytest.approx(used * 2**30) and got[1] == pytest.approx(hbm * 2**30)
    assert C.hbm_overflow("INVALID_ARGUMENT: shapes do not match") is None


# ----------------------------------------------------------------------------- the stage
@pytest.fixture(scope="module")
def quickstart_report(tmp_path_factory):
    from configs import quickstart

    config = quickstart.get_config()
    config.compile.topology = "v5e-4"
    config.model.dtype = "bfloat16"  # as on a TPU
    # the GRPO step: replay the engine's routing (off by default), and a batch shape of its own
    # (8 rows: not data.batch_size's 4; 256 tokens: rl.context_budget's 2048 only compiles slower)
    config.grpo.router_replay = True
    config.compile.grpo_batch, config.compile.grpo_seq_len = 8, 256
    # the engine as these checks were written for: 2 rows (not split over the 4 chips: replicated)
    # of 2048 cache slots (at quickstart's 1024 the prefill's compiled FLOPs per chip were 0.94x
    # the model-FLOPs estimate, under the bound checked below: not examined yet)
    config.rl.group_size, config.rl.context_budget = 2, 2048
    out = str(tmp_path_factory.mktemp("compile"))
    assert C.run(config, out, "prev/ckpt") == "prev/ckpt"  # passes init_from on to a next stage
    with open(os.path.join(out, "report.json")) as f:
        return config, json.load(f), open(os.path.join(out, "report.md")).read()


@pytest.mark.slow
def test_quickstart_train_step_compiles_for_v5e_2x2(quickstart_report):
    from coder.model import count_params

    config, r, md = quickstart_report
    assert r["status"] == "fits", r.get("error")
    assert r["hardware"]["libtpu_name"] == "v5e:2x2" and r["hardware"]["chips"] == 4
    assert r["setup"]["mesh"]["data"] == 4

    m = r["memory"]
    counts = count_params(config.model)
    n_params = counts["total"] + counts["mtp"]
    # data parallel: every chip holds all float32 params (+ router biases) and two Adam moments
    assert n_params * 4 <= m["params_bytes"] <= n_params * 4 * 1.01
    assert 2 * n_params * 4 <= m["optimizer_bytes"] <= 2 * n_params * 4 * 1.01
    rows_per_chip = config.data.batch_size // 4
    assert m["batch_bytes"] == 4 * 4 * rows_per_chip * config.data.seq_len  # 4 int32/f32 arrays
    assert m["activations_temp_bytes"] > 0
    assert m["params_bytes"] + m["optimizer_bytes"] <= m["total_bytes"] < m["hbm_bytes"]
    assert m["fits"] and m["fraction_of_hbm"] == pytest.approx(m["total_bytes"] / m["hbm_bytes"])

    c = r["cost"]
    model_flops = r["roofline"]["model_flops"]
    assert c["flops"] >= c["xla_flops"] > 0 and c["bytes_accessed"] > 0
    assert 0.8 < c["flops"] * 4 / model_flops < 5  # compiled work vs 6N + attention
    assert not c["loops_with_unknown_trip_count"]

    # data parallel over 4 chips: gradients are all-reduced (or reduce-scattered) every step
    reduced = r["collectives"]["all-reduce"]["bytes"] + r["collectives"]["reduce-scatter"]["bytes"]
    assert reduced > 0 and r["collectives"]["dcn"]["count"] == 0

    f = r["roofline"]
    assert f["step_time_lower_s"] == max(f["compute_s"], f["hbm_s"], f["ici_s"], f["dcn_s"]) > 0
    assert 0 < f["mfu_lower"] <= f["mfu_upper"] < 1
    assert "v5e-4" in md and "fits" in md and "| all-reduce |" in md


@pytest.mark.slow
def test_quickstart_engine_programs_compile_for_v5e_2x2(quickstart_report):
    """The RL engine's prefill and decode are compiled beside the training step."""
    from coder.model import count_params

    config, r, md = quickstart_report
    e = r["engine"]
    st = e["setup"]
    assert (st["rows"], st["cache_slots"]) == (config.rl.group_size, config.rl.context_budget)
    assert st["prefill_len"] == min(2048, config.rl.context_budget)
    counts = count_params(config.model)
    # weights are replicated over the 4 data-parallel chips, all of them in the serving dtype
    # (rl.engine_dtype "" = model.dtype, bf16 here: what coder.rl.actor.make_engine builds)
    assert st["params_bytes_per_chip"] >= 2 * (counts["total"] + counts["mtp"])
    assert st["params_bytes_per_chip"] < 4 * (counts["total"] + counts["mtp"])
    # the latent cache: rows x slots x (kv_lora_rank + rope dim) per layer (+ MTP layer)
    m = config.model
    per_row = config.rl.context_budget * (m.kv_lora_rank + m.qk_rope_head_dim) * jnp.dtype(m.dtype).itemsize * (
        m.num_hidden_layers + m.num_mtp_layers)
    rows_per_chip = st["rows"] // 4 if st["rows_split_over"] else st["rows"]
    assert st["cache_bytes_per_chip"] >= rows_per_chip * per_row
    for name in ("prefill", "decode"):
        p = e[name]
        assert p["status"] == "fits", p.get("error")
        assert p["cost"]["flops"] > 0 and p["tokens_per_s_upper"] > 0
        assert p["memory"]["params_bytes"] == st["params_bytes_per_chip"]
    # rows are replicated (2 rows, 4 chips): each chip does at least the programs' matmul work
    assert not st["rows_split_over"]
    for name in ("prefill", "decode"):
        assert e[name]["cost"]["flops"] >= e[name]["roofline"]["model_flops"] > 0
    assert e["prefill"]["cost"]["flops"] > 20 * e["decode"]["cost"]["flops"]
    assert e["decode"]["roofline"]["bound"] == "hbm"  # decoding a few rows reads every weight
    assert "## RL engine: prefill and decode programs" in md
    # the engine's slice is the learner's here; each host (4 chips: one v5e-4 host) reads its
    # chips' slices of a full version from the store
    assert (e["topology"], e["chips"], e["hosts"], e["mesh"]["data"]) == ("v5e-4", 4, 1, 4)
    assert e["store_read_bytes_per_host"] == 4 * st["params_bytes_per_chip"]
    # over the host's network: its 4 v5e chips' DCN bandwidth (25 Gb/s each)
    assert e["store_read_seconds_per_host"] == e["store_read_bytes_per_host"] / (4 * 25e9 / 8)
    assert "reads" in md and "from the weight store" in md and "GB/s of data-centre network" in md
    # colocated on this slice: the engine phase holds the engine's larger program and the
    # learner's parameters and optimizer state (kl_coef > 0: its reference copy too); the
    # learner phase the GRPO step and the reference (the engine released its memory)
    c, g = r["colocated"], r["grpo"]["memory"]
    assert config.grpo.kl_coef > 0 and c["reference_bytes"] == g["params_bytes"] > 0
    engine_bytes = max(e[p]["memory"]["total_bytes"] for p in ("prefill", "decode"))
    assert c["engine_phase_bytes"] == engine_bytes + 2 * g["params_bytes"] + g["optimizer_bytes"]
    assert c["learner_phase_bytes"] == g["total_bytes"] + g["params_bytes"]
    assert c["fits"] and "## Colocated RL on this slice" in md


def test_grpo_shape_defaults_to_the_rollout_context():
    from configs import base

    config = base.get_config()
    config.data.batch_size, config.data.seq_len, config.rl.context_budget = 8, 256, 1024
    assert C.grpo_shape(config) == (8, 1024)  # a generation holds up to rl.context_budget tokens
    config.rl.context_budget = 0
    assert C.grpo_shape(config) == (8, 256)
    config.grpo.shared_prefix_len = 2048  # packed rows: a group's prompt once, its continuations after
    assert C.grpo_shape(config) == (8, 2048)
    config.compile.grpo_batch, config.compile.grpo_seq_len = 16, 512
    assert C.grpo_shape(config) == (16, 512)


def test_grpo_model_flops_count_the_mtp_modules_only_when_refreshed():
    from configs import quickstart

    from coder.train import metrics

    m = quickstart.get_config().model
    assert m.num_mtp_layers > 0
    trunk = 6 * metrics.active_matmul_params(m, mtp_modules=0) + 3 * metrics.attention_flops_per_token(
        m, 256, layers=m.num_hidden_layers)
    assert C.grpo_model_flops(m, 8, 256) == pytest.approx(8 * 256 * trunk)
    assert C.grpo_model_flops(m, 8, 256) < C.model_flops_per_step(m, 8, 256)  # pretraining: + MTP
    assert C.grpo_model_flops(m, 8, 256, m.num_mtp_layers) == pytest.approx(C.model_flops_per_step(m, 8, 256))


@pytest.mark.slow
def test_quickstart_grpo_step_compiles_for_v5e_2x2(quickstart_report):
    """The GRPO learner's step (GRPO loss and batch, router replay) is compiled beside it."""
    from coder.train.aot.hlo_stats import arrays

    config, r, md = quickstart_report
    g = r["grpo"]
    assert g["status"] == "fits", g.get("error")
    st = g["setup"]
    m = config.model
    layers, k = m.num_hidden_layers - m.first_k_dense_replace, m.num_experts_per_tok
    assert (st["rows"], st["seq_len"], st["moe_layers"], st["top_k"]) == (8, 256, layers, k)
    assert st["router_replay"] and layers > 0

    mem = g["memory"]
    assert mem["params_bytes"] == r["memory"]["params_bytes"]  # the same trainer state
    assert mem["optimizer_bytes"] == r["memory"]["optimizer_bytes"]
    rows, t = 8 // 4, 256  # rows split over the 4 data-parallel chips
    # 7 int32/f32 [B, T] arrays, advantages [B], expert_ids int32 [layers, B, T, k]
    assert mem["batch_bytes"] == 4 * (7 * rows * t + rows + layers * rows * t * k)
    # working memory beyond the step's inputs (XLA may book it as peak rather than temp here)
    assert mem["total_bytes"] > mem["params_bytes"] + mem["optimizer_bytes"] + mem["batch_bytes"]
    assert mem["fits"] and mem["total_bytes"] < mem["hbm_bytes"]

    # the engine's expert ids are an input of the compiled program (not pruned as unused)
    with open(g["hlo_file"]) as f:
        module = C.parse_hlo(f.read())
    params = [arrays(i.shape) for i in module.computations[module.entry] if i.opcode == "parameter"]
    assert [("s32", (layers, rows, t, k))] in params

    # compiled work vs model FLOPs of the trunk and the MTP module (grpo.mtp_weight > 0: the
    # refresh runs it); forward-only model FLOPs (2N + A) would give ~3x more
    f = g["roofline"]
    assert f["model_flops"] == pytest.approx(C.grpo_model_flops(m, 8, 256, m.num_mtp_layers))
    assert g["cost"]["flops"] > 0
    assert 0.9 < f["hlo_to_model_flops"] < 2.5
    assert 0 < f["mfu_lower"] <= f["mfu_upper"] < 1
    assert f["step_time_lower_s"] > 0
    # data parallel: the gradients are all-reduced (or reduce-scattered)
    reduced = g["collectives"]["all-reduce"]["executed"] + g["collectives"]["reduce-scatter"]["executed"]
    assert reduced > 0
    assert "## RL learner: GRPO step" in md and "router replay on" in md


def test_grpo_step_replays_the_engine_routing_with_router_replay():
    """grpo.router_replay reaches the lowered program: the expert ids are an input either way
    (the loss measures routing_mismatch against them), and with replay the MoE layers also
    dispatch by them, which changes the program."""
    from configs import quickstart

    from coder.model import sharding

    config = quickstart.get_config()
    config.compile.grpo_seq_len = 128
    mesh = sharding.make_mesh(config.mesh, hw.topology_devices(hw.parse_topology("v5e-4")))
    texts = {}
    for replay in (False, True):
        config.grpo.router_replay = replay
        lowered, _, setup = C.lower_grpo_step(config, mesh)
        assert setup["router_replay"] is replay and setup["moe_layers"] == 1
        texts[replay] = lowered.as_text()
        # global [moe_layers, B, T, top_k] int32 argument
        assert "tensor<1x4x128x2xi32>" in texts[replay]
    assert texts[True] != texts[False]


def test_grpo_step_failure_is_recorded_not_raised():
    """A GRPO batch the mesh cannot split (3 rows over 4 data-parallel chips) is a report entry."""
    from configs import quickstart

    from coder.model import sharding

    config = quickstart.get_config()
    config.compile.grpo_batch, config.compile.grpo_seq_len = 3, 128
    topo = hw.parse_topology("v5e-4")
    mesh = sharding.make_mesh(config.mesh, hw.topology_devices(topo))
    g = C.compile_grpo(config, mesh, topo)
    assert g["status"] == "compile_error" and "size is 3" in g["error"] and "memory" not in g
    md = "\n".join(compile_report.grpo_markdown(g))
    assert "## RL learner: GRPO step" in md and "**compile_error**" in md

    gib = 2**30
    oom = dict(status="does_not_fit", error="Ran out of memory", compile_seconds=9.0,
               memory_overflow=dict(used_bytes=20 * gib, hbm_bytes=16 * gib, fraction_of_hbm=1.25))
    assert "needs 20 GiB of 16 GiB HBM (125%)" in "\n".join(compile_report.grpo_markdown(oom))


@pytest.mark.slow
def test_reduce_grads_once_crosses_the_dcn_once_per_step_not_per_micro_batch():
    """Two v5e-4 slices (data 2 over DCN x fsdp 2 x expert 2), the quickstart model's MoE step
    (without its MTP module: the same dispatch, a shorter compile) with splash attention,
    megablox and ragged_all_to_all under the per-replica vmap: with train.reduce_grads_once
    every DCN transfer runs once per step (none inside the micro-batch loop); by default every
    micro-batch's gradient crosses the DCN inside the loop. 4 rows per micro-batch, 2 per
    replica, one per fsdp device: with 1 row per replica (an uneven split, which stage compile
    now refuses) XLA padded the rows and all-gathered the token ids across the slices in every
    micro-batch."""
    from coder.model import sharding

    from configs import quickstart

    devices = hw.topology_devices(hw.parse_topology("v5e-4", 2))
    dcn = {}
    for once in (False, True):
        config = quickstart.get_config()
        config.model.dtype = "bfloat16"
        config.model.num_mtp_layers = 0
        config.mesh.update(dict(data=2, fsdp=2, expert=2, num_slices=2))
        config.data.batch_size, config.data.seq_len = 16, 128
        config.train.grad_accum, config.train.reduce_grads_once = 4, once
        mesh = sharding.make_mesh(config.mesh, devices)
        lowered, _ = C.lower_train_step(config, mesh)
        module = C.parse_hlo(lowered.compile().as_text())
        runs, unknown = C.multiplicities(module)
        assert not unknown
        dcn[once] = C.collective_stats(module, runs, num_devices=8, num_slices=2)["dcn"]
    assert dcn[True]["executed"] == dcn[True]["count"] > 0  # each once per step
    assert dcn[False]["executed"] > dcn[False]["count"]  # some inside the loop: per micro-batch
    assert dcn[False]["executed"] > 2 * dcn[True]["executed"]


def test_stage_compile_refuses_a_micro_batch_that_does_not_divide_over_the_batch_axes(tmp_path):
    """data.batch_size / train.grad_accum rows must divide over the batch mesh axes of the target
    topology (stage validation checks the host's devices and skips compile): refused before
    anything is traced, naming the keys."""
    from configs import quickstart

    config = quickstart.get_config()
    config.compile.topology = "v5e-4"
    config.mesh.update(dict(data=2, fsdp=2, expert=2, num_slices=2))
    config.data.batch_size, config.train.grad_accum = 8, 4  # 2 rows over data 2 x fsdp 2
    with pytest.raises(ValueError, match=r"stage compile: data.batch_size=8 / train.grad_accum=4 rows"):
        C.run(config, str(tmp_path), "")
    assert not os.listdir(tmp_path)


_CACHE_SCRIPT = """
import os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from coder.train.aot import hardware as hw
cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
count = lambda: len(os.listdir(cache))
jax.jit(lambda x: x * 2 + 1)(jnp.ones(3))  # the process decides the cache is in use
counts = [count()]
with hw.without_persistent_cache():
    mesh = Mesh(np.array(hw.topology_devices(hw.parse_topology("v5e-4"))), ("fsdp",))
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    jax.jit(lambda a: a @ a.T).lower(x).compile()
counts.append(count())
jax.jit(lambda x: x * 3 - 1)(jnp.ones(3))
counts.append(count())
print(counts)
"""


def test_compile_only_executables_stay_out_of_the_persistent_cache(tmp_path):
    """hardware.without_persistent_cache in a process already using JAX_COMPILATION_CACHE_DIR: the
    TPU compile writes no entry (reading one back fails: no client), CPU compiles after it do."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    p = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    before, after_tpu, after_cpu = json.loads(p.stdout.strip().splitlines()[-1])
    assert before > 0 and after_tpu == before and after_cpu == before + 1


def test_engine_compiles_on_an_actor_slice_of_its_own():
    """compile.engine_topology: the engine's programs lowered for another slice than the
    learner's (an RL actor's), over the engine's mesh there (rows over the data axis)."""
    from configs import quickstart

    config = quickstart.get_config()
    config.compile.topology, config.compile.engine_topology = "v5e-4", "v5e-8"
    from coder.model import sharding
    from coder.train.aot import hardware

    topo = hardware.parse_topology("v5e-4")
    mesh = sharding.make_mesh(config.mesh, hardware.topology_devices(topo))
    emesh, etopo = C.engine_target(config, mesh, topo)
    assert etopo.name == "v5e-8" and emesh.devices.size == 8 and emesh.shape["data"] == 8
    assert {d.platform for d in emesh.devices.flat} == {"tpu"}
    lowered, setup = C.lower_engine(config, emesh)
    assert set(lowered) == {"prefill", "decode", "copy"} and setup["params_bytes_per_chip"] > 0
    config.rl.engine_dtype = "bfloat16"  # the serving weights' dtype, not the parameters'
    assert C.lower_engine(config, emesh)[1]["params_bytes_per_chip"] == pytest.approx(
        setup["params_bytes_per_chip"] / 2, rel=0.01)
    # rl.engine_mesh: the actor's engine splits the experts its own way (rows over the rest)
    config.rl.engine_mesh.expert = 4
    emesh, _ = C.engine_target(config, mesh, topo)
    assert (emesh.shape["expert"], emesh.shape["data"]) == (4, 2)
    # rl.engine_attention="data_parallel": the 8 rows split over data x expert, one per chip
    config.rl.engine_attention = "data_parallel"
    config.compile.engine_batch = 8
    _, setup = C.lower_engine(config, emesh)
    assert set(setup["rows_split_over"]) == {"data", "fsdp", "expert"}
    config.rl.engine_attention = "heads"
    with pytest.raises(ValueError, match="rl.engine_attention"):
        C.lower_engine(config, emesh)
    config.rl.engine_mesh.tensor = -1
    with pytest.raises(ValueError, match="rl.engine_mesh"):
        C.engine_target(config, mesh, topo)
    # no engine_topology: the learner's own chips (a colocated run), the engine's mesh over them
    config.rl.engine_mesh.tensor = 0
    config.compile.engine_topology = ""
    emesh, etopo = C.engine_target(config, mesh, topo)
    assert etopo == topo and set(emesh.devices.flat) == set(mesh.devices.flat)
    assert (emesh.shape["expert"], emesh.shape["data"]) == (4, 1)


def test_engine_section_says_how_each_version_reaches_the_engine():
    """From the weight store (an actor slice, or a store-following engine on the learner's
    slice): the bytes each host reads; colocated: an on-device reshard, no store named."""
    from coder.stages.compile_report import engine_markdown

    setup = dict(rows=8, cache_slots=1024, prefill_len=256, speculative_k=0, rows_split_over=[])
    base = dict(setup=setup, topology="v5p-512", chips=256, hosts=64, mesh={"expert": 256})
    store = "\n".join(engine_markdown(dict(base, weights_from="store", store_read_bytes_per_host=2 ** 31)))
    assert "each host reads 2 GiB of a version written in full from the weight store" in store
    on_device = "\n".join(engine_markdown(dict(base, weights_from="on_device", reshard_bytes_per_host=2 ** 31)))
    assert "on-device reshard of the learner's arrays, 2 GiB per host" in on_device
    assert "weight store (" not in on_device
    timed = "\n".join(engine_markdown(dict(base, weights_from="store", store_read_bytes_per_host=50e9,
                                            host_network_bytes_per_s=25e9, store_read_seconds_per_host=2.0)))
    assert "(its chips' slices): 2.0 s at the host's 25 GB/s of data-centre network; a delta version" in timed
    assert "0.06-0.08 s." in timed
    # a report written before the key existed reads as the store path
    assert "from the weight store" in "\n".join(engine_markdown(dict(base, store_read_bytes_per_host=2 ** 31)))


def test_report_is_written_to_an_fsspec_url(tmp_path, monkeypatch):
    """compile.report_dir = gs://... (here memory://, as gs://): the report lands in the store, not
    in a local directory named `gs:` (os.makedirs of the URL)."""
    import uuid

    import fsspec

    monkeypatch.chdir(tmp_path)
    chip = dict(name="v5e", peak_bf16_flops=1.97e14, hbm_bytes=16 << 30, hbm_bandwidth=8.2e11,
                ici_bandwidth=4.5e10, dcn_bandwidth=6.25e9, assumed=[])
    report = dict(hardware=dict(name="v5e-4", chips=4, chip=chip), setup=dict(params_total=1000),
                  status="compile_error", error="stand-in", command="python main.py")
    url = f"memory://compile-report-{uuid.uuid4().hex}/report"
    fs = fsspec.filesystem("memory")
    try:
        assert C.write_report(report, url) == f"{url}/report.json"
        assert json.loads(fs.cat_file(f"{url}/report.json"))["status"] == "compile_error"
        assert "Status: **compile_error** — stand-in" in fs.cat_file(f"{url}/report.md").decode()
        assert not os.listdir(tmp_path)  # nothing local
    finally:
        if fs.exists(url):
            fs.rm(url.rsplit("/", 1)[0], recursive=True)


def test_compiled_hlo_is_written_to_an_fsspec_url(tmp_path, monkeypatch):
    """The HLO beside the report goes where the report goes (a gs:// stage dir: the store)."""
    import uuid

    import fsspec

    monkeypatch.chdir(tmp_path)
    url = f"memory://compile-hlo-{uuid.uuid4().hex}/compile"
    fs = fsspec.filesystem("memory")
    compiled = types.SimpleNamespace(as_text=lambda: "HloModule stand_in")
    try:
        assert C._save_hlo(compiled, url, "train_step") == f"{url}/train_step.hlo.txt"
        assert fs.cat_file(f"{url}/train_step.hlo.txt").decode() == "HloModule stand_in"
        assert not os.listdir(tmp_path)
    finally:
        if fs.exists(url):
            fs.rm(url, recursive=True)
