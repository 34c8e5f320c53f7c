"""coder.train.aot.hlo_stats on Pallas kernels: instructions spanning lines (a Mosaic kernel's
backend_config) and the splash attention FLOPs XLA's cost analysis does not count."""
from coder.train.aot import hlo_stats

HLO = """HloModule m, entry_computation_layout={()->f32[]}

ENTRY %main (p0: bf16[2,256,24], p1: bf16[2,256,24], p2: bf16[2,256,16], p3: bf16[2,1024,24]) -> f32[] {
  %q = bf16[2,256,24]{2,1,0} parameter(0)
  %k = bf16[2,256,24]{2,1,0} parameter(1)
  %v = bf16[2,256,16]{2,1,0} parameter(2)
  %m = s8[1,1,1]{2,1,0} constant({...})
  %splash_mha_fwd_segmented_residuals.1 = (bf16[2,256,16]{2,1,0}, f32[2,256,128]{2,1,0}) custom-call(%m, %m, %q, %k, %v), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "module {
}}", "x": 1}
  %splash_mha_dkv_segmented_no_residuals.2 = (bf16[2,256,24]{2,1,0}, bf16[2,256,16]{2,1,0}) custom-call(%m, %m, %q, %k, %v), custom_call_target="tpu_custom_call"
  %kq = bf16[2,1024,24]{2,1,0} parameter(3)
  %kv = bf16[2,1024,16]{2,1,0} broadcast(%v), dimensions={0,1,2}
  %splash_mha_dq_segmented_no_residuals.3 = bf16[2,256,24]{2,1,0} custom-call(%m, %m, %q, %kq, %kv), custom_call_target="tpu_custom_call"
  ROOT %r = f32[] constant(0)
}
"""


def test_an_instruction_spanning_lines_does_not_end_its_computation():
    module = hlo_stats.parse_hlo(HLO)
    names = [i.name for i in module.computations["main"]]
    assert "splash_mha_dkv_segmented_no_residuals.2" in names and names[-1] == "r"
    fwd = next(i for i in module.computations["main"] if i.name.startswith("splash_mha_fwd"))
    assert fwd.operands == ["m", "m", "q", "k", "v"]


def test_splash_kernel_flops_count_the_causal_pairs_the_busiest_device_visits():
    module = hlo_stats.parse_hlo(HLO)
    shapes = {i.name: i.shape for i in module.computations["main"]}
    cost = {i.name.split("_segmented")[0]: hlo_stats.splash_cost(i, shapes)
            for i in module.computations["main"] if i.opcode == "custom-call"}
    half = 256 * 256 / 2  # causal pairs of a 256-token row (one device holds every query)
    assert cost["splash_mha_fwd"][0] == 2 * 2 * half * (24 + 16)  # Q K^T and P V, 2 heads
    assert cost["splash_mha_dkv"][0] == 2 * 2 * half * (2 * 24 + 2 * 16)
    # queries 256 of 1024 keys (sequence split 4 ways): the last shard visits 7/8 of its keys
    assert cost["splash_mha_dq"][0] == 2 * 2 * 256 * 1024 * (2 * 24 + 16) * (7 / 8)
    assert cost["splash_mha_fwd"][1] == 0  # one 256-row query block: K and V read once
    assert cost["splash_mha_dq"][1] == 0  # 256 queries: one block
    total, _ = hlo_stats.loop_corrected_cost(module, 0.0, 0.0)
    assert total == sum(f for f, _ in cost.values())
