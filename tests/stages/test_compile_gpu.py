"""stage=compile for a GPU target: XLA:GPU compiles a tiny model's training step for one H100 on
this CPU (jax's CUDA plugin's compile-only devices: the gpu-compile extra, which the test extra
installs; skipped with the reason when it is absent), and a Pallas-Triton kernel whose tiles do
not fit an H100's shared memory fails here as it failed on the H100 (docs/accelerator.md, run 1).
"""
import json
import os

import jax
import jax.numpy as jnp
import pytest

from coder.stages import compile as C
from coder.train.aot import hardware as hw

pytestmark = pytest.mark.skipif(
    not hw.gpu_compile_available(),
    reason="GPU targets need jax's CUDA plugin: pip install -e '.[gpu-compile]' (jax-cuda12-plugin and "
           "jax-cuda12-pjrt matching jaxlib)")


@pytest.fixture(autouse=True, scope="module")
def _compile_only_executables_not_cached():
    with hw.without_persistent_cache():
        yield


def _tiny(topology: str, tmp_path):
    from configs import base

    c = base.get_config()
    c.model.dtype = "bfloat16"
    c.model.num_hidden_layers = 1  # the dense layer; the MTP module's block is an MoE layer
    c.data.batch_size, c.data.seq_len = 2, 256
    c.compile.update(topology=topology, engine=False, grpo=False, report_dir=str(tmp_path / "report"))
    return c


@pytest.mark.slow
def test_tiny_train_step_compiles_for_an_h100_and_reports_it(tmp_path):
    """The report in the TPU reports' schema: memory against the pool JAX preallocates (75% of
    the H100's HBM), FLOPs off the HLO (cost_analysis is None on GPU) with the flash kernels
    counted from their shapes, a roofline, the roofline at the H100's measured rates."""
    c = _tiny("h100", tmp_path)
    C.run(c, str(tmp_path / "stage"))
    with open(tmp_path / "report" / "report.json") as f:
        r = json.load(f)
    assert r["status"] == "fits", r.get("error")
    m, cost, roof = r["memory"], r["cost"], r["roofline"]
    assert m["hbm_bytes"] == hw.GPU_CHIPS["h100"].pool_bytes and m["device_hbm_bytes"] == hw.GPU_CHIPS["h100"].hbm_bytes
    assert 0 < m["total_bytes"] < m["hbm_bytes"]
    assert cost["source"] == "hlo" and cost["uncounted_kernels"] == {}
    # the attention's flash kernels and the MTP module's MoE experts (coder.pallas.grouped_matmul_gpu)
    assert set(cost["kernel_flops"]) == {"flash_fwd_at_positions", "flash_dq_at_positions", "flash_dkv_at_positions",
                                         "grouped_matmul_gpu", "tgmm_gpu"}
    assert all(f > 0 for f in cost["kernel_flops"].values()) and cost["matmul_flops"] > 0
    # every model FLOP is in the compiled step (remat off, a few padded widths and masks beyond it)
    assert 1.0 <= roof["hlo_to_model_flops"] < 1.6, roof["hlo_to_model_flops"]
    assert 0 < roof["mfu_lower"] <= roof["mfu_upper"] < 1 and roof["step_time_serial_s"] > roof["step_time_lower_s"]
    assert roof["ici_s"] == roof["dcn_s"] == 0.0  # one GPU: no collectives
    measured = r["roofline_measured"]
    assert measured["compute_s"] > roof["compute_s"] and measured["hbm_s"] == roof["hbm_s"]
    assert r["hardware"]["chip"]["device_kind"] == "NVIDIA H100 80GB HBM3"
    with open(tmp_path / "report" / "report.md") as f:
        md = f.read()
    assert "Roofline at measured rates" in md and "preallocates 75%" in md
    assert os.path.exists(r["hlo_file"])


def _h100_mesh():
    from coder.model import sharding
    from configs import base

    return sharding.make_mesh(base.get_config().mesh, hw.topology_devices(hw.parse_topology("h100")))


def _flash_compiled(tiles):
    """coder's Pallas-Triton flash attention, forward, MLA's widths, compiled for one H100."""
    from jax.sharding import NamedSharding, PartitionSpec

    from coder.model import sharding
    from coder.pallas.flash_gpu import flash_attention
    from configs import base

    mesh = _h100_mesh()
    rep = NamedSharding(mesh, PartitionSpec())
    b, t, h = 1, 512, 2
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
    args = (spec((b, t, h, 192)), spec((b, t, h, 192)), spec((b, t, h, 128)),
            spec((b, t), jnp.int32), spec((b, t), jnp.int32), spec((b, t), jnp.int32))

    def fwd(q, k, v, pos, seg, kv_seg):
        return flash_attention(q, k, v, pos, seg, kv_seg, scale=0.1, tiles=tiles)

    with sharding.activate(mesh, tuple(tuple(r) for r in base.get_config().mesh.rules)):
        return jax.jit(fwd).lower(*args).compile()


def test_a_triton_kernel_over_shared_memory_fails_to_compile_as_it_did_on_the_h100():
    """The flash forward at the TPU's 512-token tiles keeps q and two stages of k and v at width
    256 in shared memory: 1.25 MiB of an H100's 227 KiB, the error run 1 printed on the H100;
    the kernel's own tiles (64 x 64) compile."""
    from coder.pallas.flash_gpu import Tiles

    assert _flash_compiled(Tiles()).as_text()
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        _flash_compiled(Tiles(block_q=512, block_k=512, block_q_bwd=512, block_k_bwd=512))


def test_moe_1b_h100_setting_compiles_the_bench_model_alone():
    """docs/scale/configs.py "moe_1b,h100": bench/accelerator.py's model and batch, the H100 as
    topology, the training step only, nothing of the TPU pod layout."""
    import importlib.util

    from configs import moe_1b

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "scale", "configs.py")
    spec = importlib.util.spec_from_file_location("scale_configs", path)
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    c = scale.get_config("moe_1b,h100")
    assert c.compile.topology == "h100" and not c.compile.engine and not c.compile.grpo
    assert (c.data.batch_size, c.data.seq_len) == (8, 2048) and c.compile.report_dir == "docs/scale/moe_1b_h100"
    assert all(c.model[k] == v for k, v in moe_1b.MODEL_1B.items())
    assert c.mesh.data == -1 and c.model.moe_capacity_factor == moe_1b.get_config().model.moe_capacity_factor
