"""coder.train.aot.hlo_stats on Pallas kernels: instructions spanning lines (a Mosaic kernel's
backend_config), the splash attention FLOPs XLA's cost analysis does not count and the megablox
FLOPs it counts for every row of the kernel's input."""
from coder.model import attention_kernels as ak
from coder.train.aot import hlo_stats

HLO = """HloModule m, entry_computation_layout={()->f32[]}

%sparse_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}, execution_thread="sparsecore"

ENTRY %main (p0: bf16[2,256,24], p1: bf16[2,256,24], p2: bf16[2,256,16], p3: bf16[2,1024,24]) -> f32[] {
  %q = bf16[2,256,24]{2,1,0} parameter(0)
  %k = bf16[2,256,24]{2,1,0} parameter(1)
  %v = bf16[2,256,16]{2,1,0} parameter(2)
  %m = s8[1,1,1]{2,1,0} constant({...})
  %splash_mha_fwd_segmented_residuals.1 = (bf16[2,256,16]{2,1,0}, f32[2,256,128]{2,1,0}) custom-call(%m, %m, %q, %k, %v), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "module {
}}", "x": 1}
  %splash_mha_dkv_segmented_no_residuals.2 = (bf16[2,256,24]{2,1,0}, bf16[2,256,16]{2,1,0}) custom-call(%m, %m, %q, %k, %v), custom_call_target="tpu_custom_call"
  %splash_mha_dkv_segmented_no_residuals.4 = (bf16[2,256,24]{2,1,0}, bf16[2,256,24]{2,1,0}, bf16[2,256,16]{2,1,0}) custom-call(%m, %m, %q, %k, %v), custom_call_target="tpu_custom_call"
  %kq = bf16[2,1024,24]{2,1,0} parameter(3)
  %kv = bf16[2,1024,16]{2,1,0} broadcast(%v), dimensions={0,1,2}
  %splash_mha_dq_segmented_no_residuals.3 = bf16[2,256,24]{2,1,0} custom-call(%m, %m, %q, %kq, %kv), custom_call_target="tpu_custom_call"
  %x = bf16[512,128]{1,0} parameter(4)
  %w = bf16[4,128,256]{2,1,0} parameter(5)
  %gs = s32[4]{0} parameter(6)
  %gmm.7 = bf16[512,256]{1,0} custom-call(%gs, %x, %w), custom_call_target="tpu_custom_call"
  ROOT %r = f32[] constant(0)
}
"""


def test_an_instruction_spanning_lines_does_not_end_its_computation():
    module = hlo_stats.parse_hlo(HLO)
    # a SparseCore computation ends with `}, execution_thread=...`: the next one is its own
    assert [i.name for i in module.computations["sparse_add"]] == ["a", "b", "s"]
    names = [i.name for i in module.computations["main"]]
    assert "splash_mha_dkv_segmented_no_residuals.2" in names and names[-1] == "r"
    fwd = next(i for i in module.computations["main"] if i.name.startswith("splash_mha_fwd"))
    assert fwd.operands == ["m", "m", "q", "k", "v"]


def test_splash_kernel_flops_count_the_causal_pairs_the_busiest_device_visits():
    module = hlo_stats.parse_hlo(HLO)
    shapes = {i.name: i.shape for i in module.computations["main"]}
    cost = {i.name.split("_segmented")[0] + ("_fused" if i.name.endswith(".4") else ""):
            hlo_stats.splash_cost(i, shapes)
            for i in module.computations["main"] if i.opcode == "custom-call" and "splash" in i.name}
    gmm_call = next(i for i in module.computations["main"] if i.name == "gmm.7")
    cost["gmm.7"] = (hlo_stats.megablox_flops(gmm_call, shapes), 0.0)
    pairs = 256 * 256  # one 256 x 256 block: computed whole (masked inside the kernel)
    assert cost["splash_mha_fwd"][0] == 2 * 2 * pairs * (24 + 16)  # Q K^T and P V, 2 heads
    assert cost["splash_mha_dkv"][0] == 2 * 2 * pairs * (2 * 24 + 2 * 16)
    # the fused backward (dq, dk, dv out of one kernel): one Q K^T recompute for all three
    assert cost["splash_mha_dkv_fused"][0] == 2 * 2 * pairs * (3 * 24 + 2 * 16)
    # 256 queries of 1024 keys (4 shards, zigzag): half-chunks 128 wide; the busiest shard's
    # query block reaches key block 2 of 2 (blocks of 512)
    assert cost["splash_mha_dq"][0] == 2 * 2 * 256 * 1024 * (2 * 24 + 16) * ak.visited_fraction(256, 1024)
    assert ak.visited_fraction(256, 1024) == 1.0
    assert cost["splash_mha_fwd"][1] == 0  # one 256-row query block: K and V read once
    assert cost["splash_mha_dq"][1] == 0  # 256 queries: one block
    splash = sum(f for name, (f, _) in cost.items() if name.startswith("splash"))
    gmm = 2 * 512 * 128 * 256  # megablox's own estimate, every row: what XLA counts
    assert cost["gmm.7"][0] == gmm
    total, _ = hlo_stats.loop_corrected_cost(module, gmm, 0.0)
    assert total == splash + gmm
    # a quarter of the rows routed: the kernel's dynamic grid visits a quarter of the tiles
    total, _ = hlo_stats.loop_corrected_cost(module, gmm, 0.0, gmm_scale=0.25)
    assert total == splash + gmm / 4


def test_causal_block_skipping_at_32k_visits_half_the_pairs_on_every_shard():
    # 64 blocks of 512: sum(1..64) / 64^2 of the pairs, with or without 8 zigzag query shards
    assert ak.visited_fraction(32768, 32768) == 2080 / 4096
    assert ak.visited_fraction(4096, 32768) == 2080 / 4096


def test_grouped_rows_fraction_is_the_routed_share_of_the_kernel_rows():
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from coder.model import expert_dispatch, sharding
    from configs import base

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 1, 8, 1, 1), sharding.AXES,
                axis_types=(AxisType.Auto,) * 5)
    rules = (("batch", ("data", "fsdp")), ("exp", "expert"))
    cfg = base.get_config().model
    cfg.n_routed_experts, cfg.num_experts_per_tok = 16, 2
    # tokens replicated over the 8 expert devices: each routes 64 / 8 of them; the worst-case
    # receive buffer holds all 8 devices' pairs
    assert expert_dispatch.ragged_buffer(mesh, rules, 1, 64, 2, 0.0) == (8, 8 * 2 * 8)
    assert expert_dispatch.grouped_rows_fraction(cfg, mesh, rules, 1, 64) == 1 / 8
    cfg.moe_a2a_buffer_factor = 2.0
    assert expert_dispatch.grouped_rows_fraction(cfg, mesh, rules, 1, 64) == 1 / 2
    cfg.moe_dispatch = "all_gather"  # every gathered pair, 1/8 of them local
    assert expert_dispatch.grouped_rows_fraction(cfg, mesh, rules, 1, 64) == 1 / 8
    cfg.moe_capacity_factor = 2.0  # no grouped matmul kernel
    assert expert_dispatch.grouped_rows_fraction(cfg, mesh, rules, 1, 64) == 1.0


def test_a_kernel_with_a_cost_estimate_counts_what_it_states_every_run():
    """coder's NSA kernels state their cost (pl.CostEstimate, in the backend_config as compiled
    HLO prints it: numbers in quotes); XLA counts it once per loop body, and loop_corrected_cost
    puts it in for each of the loop's 4 trips: its FLOPs, and its bytes in place of its
    operands' and result's."""
    hlo = """HloModule m, entry_computation_layout={()->f32[]}

%body (p: (s32[], bf16[8,64])) -> (s32[], bf16[8,64]) {
  %p = (s32[], bf16[8,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,64]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %jvp_nsa_window_fwd_.1 = bf16[8,64]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"TUzvUg==","cost_estimate":{"flops":"1000","transcendentals":"10","bytes_accessed":"300"},"serialization_format":1}}
  ROOT %t = (s32[], bf16[8,64]{1,0}) tuple(%j, %jvp_nsa_window_fwd_.1)
}

%cond (c: (s32[], bf16[8,64])) -> pred[] {
  %c = (s32[], bf16[8,64]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (a: bf16[8,64]) -> bf16[8,64] {
  %a = bf16[8,64]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,64]{1,0}) tuple(%zero, %a)
  %w = (s32[], bf16[8,64]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = bf16[8,64]{1,0} get-tuple-element(%w), index=1
}
"""
    module = hlo_stats.parse_hlo(hlo)
    call = next(i for i in module.computations["body"] if i.opcode == "custom-call")
    assert hlo_stats.estimated_cost(call) == (1000.0, 300.0)
    assert hlo_stats.kernel_costs(module) == {"body": (1000.0, 0.0, 1000.0)}
    assert [b for _, i, b in hlo_stats.instruction_traffic(module) if i is call] == [300.0]
    # XLA's cost analysis counted the body once (1000 FLOPs): the 3 trips it missed are added,
    # and a kernel stating 300 more bytes moves 3 x 300 more over them
    flops, traffic = hlo_stats.loop_corrected_cost(module, 1000.0, 0.0)
    more = hlo_stats.parse_hlo(hlo.replace('"bytes_accessed":"300"', '"bytes_accessed":"600"'))
    assert flops == 4000.0 and hlo_stats.loop_corrected_cost(more, 1000.0, 0.0)[1] - traffic == 3 * 300.0


def test_a_ring_attention_whole_block_counts_every_pair():
    """Ring attention (coder.model.context_parallel) calls splash on half-chunk blocks, causal
    on the diagonal and whole elsewhere: the same operand shapes, told apart by the whole
    blocks' named scope in the op's metadata."""
    from coder.model.context_parallel import FULL_BLOCK_SCOPE

    text = """HloModule m, entry_computation_layout={()->f32[]}

ENTRY %main (p0: bf16[2,1024,24], p1: bf16[2,1024,24], p2: bf16[2,1024,16]) -> f32[] {
  %q = bf16[2,1024,24]{2,1,0} parameter(0)
  %k = bf16[2,1024,24]{2,1,0} parameter(1)
  %v = bf16[2,1024,16]{2,1,0} parameter(2)
  %m = s8[1,1,1]{2,1,0} constant({...})
  %splash_mha_fwd_segmented_residuals.1 = (bf16[2,1024,16]{2,1,0}, f32[2,1024,128]{2,1,0}) custom-call(%m, %m, %q, %k, %v), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/shard_map/ring_causal_block/pallas_call"}
  %splash_mha_fwd_segmented_residuals.2 = (bf16[2,1024,16]{2,1,0}, f32[2,1024,128]{2,1,0}) custom-call(%m, %m, %q, %k, %v), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/shard_map/SCOPE/pallas_call"}
  ROOT %r = f32[] constant(0)
}
""".replace("SCOPE", FULL_BLOCK_SCOPE)
    module = hlo_stats.parse_hlo(text)
    shapes = {i.name: i.shape for i in module.computations["main"]}
    calls = {i.name[-1]: hlo_stats.splash_cost(i, shapes)[0] for i in module.computations["main"]
             if i.name.startswith("splash")}
    pairs = 1024 * 1024
    assert calls["1"] == 2 * 2 * pairs * (24 + 16) * 0.75  # blocks of 512: 3 of 4 visited
    assert calls["2"] == 2 * 2 * pairs * (24 + 16)
