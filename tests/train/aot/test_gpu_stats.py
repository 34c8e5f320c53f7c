"""coder.train.aot.gpu_stats on hand-written HLO in the form XLA:GPU prints: collectives inside a
node and across nodes, the step's FLOPs and bytes with a loop and a Triton kernel, and the flash
kernels' visited pairs against a brute-force count."""
import numpy as np
import pytest

from coder.train.aot import gpu_stats, hlo_stats


@pytest.mark.parametrize("attrs, n, groups", [
    ("replica_groups={{0,1},{2,3}}, to_apply=%add", 4, [[0, 1], [2, 3]]),
    ("replica_groups=[2,4]<=[8], dimensions={0}", 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}", 8, [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("source_target_pairs={{0,1},{1,2},{2,3}}", 4, [[0, 1], [1, 2], [2, 3]]),
    ("replica_groups={}, to_apply=%add", 3, [[0, 1, 2]]),
])
def test_device_groups_read_every_spelling(attrs, n, groups):
    assert gpu_stats.device_groups(attrs, n) == groups


def test_a_group_crosses_nodes_when_it_holds_two_nodes_devices():
    # 2 nodes of 8: the 8-device groups of [2,8]<=[16] stay in a node, its transpose pairs nodes
    assert not gpu_stats.crosses_nodes("replica_groups=[2,8]<=[16]", 16, 8)
    assert gpu_stats.crosses_nodes("replica_groups=[8,2]<=[2,8]T(1,0)", 16, 8)
    assert gpu_stats.crosses_nodes("source_target_pairs={{7,8}}", 16, 8)
    assert not gpu_stats.crosses_nodes("source_target_pairs={{6,7}}", 16, 8)


ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

COLLECTIVES = ADD + """
ENTRY %main (x: f32[1024]) -> (f32[1024], f32[1024]) {
  %x = f32[1024]{0} parameter(0)
  %in_node = f32[1024]{0} all-reduce(%x), replica_groups=[2,8]<=[16], to_apply=%add
  %across = f32[1024]{0} all-reduce(%x), replica_groups=[8,2]<=[2,8]T(1,0), to_apply=%add
  ROOT %t = (f32[1024]{0}, f32[1024]{0}) tuple(%in_node, %across)
}
"""


def test_collectives_inside_a_node_are_nvlink_and_across_nodes_infiniband():
    module = hlo_stats.parse_hlo(COLLECTIVES)
    runs, _ = hlo_stats.multiplicities(module)
    stats = gpu_stats.collective_stats(module, runs, 16, 8)
    size = 1024 * 4
    assert stats["all-reduce"]["count"] == 1 and stats["dcn"]["count"] == 1
    assert stats["all-reduce"]["wire_bytes"] == pytest.approx(2 * size * 7 / 8)  # a ring of the node's 8
    assert stats["dcn"]["wire_bytes"] == pytest.approx(2 * size * 1 / 2)  # a pair across the nodes


# a 3-trip loop whose body runs a GEMM fusion (bf16 [64,128] x [128,32]) and two Triton kernels
STEP = """
%gemm (p0: bf16[64,128], p1: bf16[128,32]) -> bf16[64,32] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: CARRY) -> CARRY {
  %p = CARRY parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = bf16[64,128]{1,0} get-tuple-element(%p), index=1
  %b = bf16[128,32]{1,0} get-tuple-element(%p), index=2
  %q = Q get-tuple-element(%p), index=3
  %y = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
  %o = Q custom-call(%q, %q, %q), custom_call_target="TRITON", backend_config={name = "flash_fwd_at_positions"}
  %z = Q custom-call(%o), custom_call_target="TRITON", backend_config={name = "other_kernel"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = CARRY tuple(%next, %a, %b, %z)
}

%cond (p: CARRY) -> pred[] {
  %p = CARRY parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[64,128], b: bf16[128,32], q: Q) -> CARRY {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,32]{1,0} parameter(1)
  %q = Q parameter(2)
  %zero = s32[] constant(0)
  %init = CARRY tuple(%zero, %a, %b, %q)
  ROOT %loop = CARRY while(%init), condition=%cond, body=%body
}
""".replace("CARRY", "(s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, Q)").replace(
    "Q", "bf16[1,256,2,64]{3,2,1,0}").replace("TRITON", "__gpu$xla.gpu.triton")


def test_step_cost_counts_gemms_and_flash_kernels_per_trip_and_lists_the_rest():
    module = hlo_stats.parse_hlo(STEP)
    runs, unknown = hlo_stats.multiplicities(module)
    assert unknown == [] and runs["body"] == 3
    cost = gpu_stats.step_cost(module, runs)
    assert cost["matmul_flops"] == 3 * 2 * 64 * 32 * 128
    q = (1, 256, 2, 64)
    kernel, rereads = gpu_stats.flash_cost("flash_fwd_at_positions", q, q, q)
    assert cost["kernel_flops"] == {"flash_fwd_at_positions": pytest.approx(3 * kernel)}
    assert cost["uncounted_kernels"] == {"other_kernel": 3.0}
    assert cost["flops"] == pytest.approx(cost["matmul_flops"] + 3 * kernel)
    # bytes: the GEMM fusion reads a and b and writes y; each kernel reads its operands once and
    # writes its result, the flash kernel re-reads k and v per query tile beyond that
    gemm = (64 * 128 + 128 * 32 + 64 * 32) * 2
    flash = 4 * 256 * 2 * 64 * 2
    other = 2 * 256 * 2 * 64 * 2
    assert cost["kernel_bytes"] == pytest.approx(3 * rereads) and rereads > 0
    assert cost["bytes_accessed"] == pytest.approx(3 * (gemm + flash + other + rereads) + 3 * 4, rel=0.01)
    # on a GPU whose L2 holds a (row, head)'s keys and values (256 x 128 bf16) they are L2 hits
    cached = gpu_stats.step_cost(module, runs, l2_bytes=256 * 128 * 2)
    assert cached["kernel_bytes"] == 0
    assert cached["bytes_accessed"] == pytest.approx(cost["bytes_accessed"] - 3 * rereads)


def _visited_brute(kind, positions, s, bq, bk):
    """Pairs a kernel computes, enumerating its tiles: fwd / dq walk key tiles up to each query
    tile's last position; dkv visits a query tile iff its last position reaches the key tile."""
    total = 0
    for tile in positions.reshape(-1, bq):
        for j in range(s // bk):
            if tile.max() >= j * bk:
                total += bq * bk
    return total


@pytest.mark.parametrize("tq, s", [(256, 256), (64, 256)])
def test_flash_visited_pairs_match_an_enumeration_of_the_tiles(tq, s):
    from coder.model.context_parallel import zigzag_positions
    from coder.pallas.flash_gpu import Tiles

    tiles = Tiles(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=8)
    n = s // tq
    pos = (zigzag_positions(s, n) if n > 1 else np.arange(s)).reshape(n, tq)
    for kind, (bq, bk) in (("flash_fwd_at_positions", (32, 16)), ("flash_dq_at_positions", (16, 8)),
                           ("flash_dkv_at_positions", (16, 8))):
        busiest = max(_visited_brute(kind, p, s, bq, bk) for p in pos)
        assert gpu_stats.flash_visited(kind, tq, s, tiles) == pytest.approx(busiest / (tq * s)), kind
    # causal: about half the pairs, never more than all
    assert 0.5 <= gpu_stats.flash_visited("flash_fwd_at_positions", tq, s, tiles) < 0.75


def test_roofline_at_rates_prices_each_part_at_its_rate():
    from coder.train.aot import hardware

    chip = hardware.GPU_CHIPS["h100"]
    cost = dict(matmul_flops=774e12, kernel_flops={"flash_fwd_at_positions": 100e12}, bytes_accessed=3.35e12)
    colls = {"all-reduce": dict(wire_bytes=450e9), "dcn": dict(wire_bytes=50e9)}
    r = gpu_stats.roofline_at_rates(chip, 1, cost, colls, 989.5e12, matmul_flops_per_s=774e12,
                                    kernel_flops_per_s={"flash_fwd_at_positions": 50e12})
    assert (r["compute_s"], r["hbm_s"], r["ici_s"], r["dcn_s"]) == pytest.approx((3.0, 1.0, 1.0, 1.0))
    assert r["step_time_serial_s"] == pytest.approx(6.0) and r["bound"] == "compute"
    assert r["mfu_lower"] == pytest.approx(1 / 6)
