"""bench/gpu_calibration.py's form switch: with `expert_form("ragged_dot")` the MoE's expert
matmuls lower to `jax.lax.ragged_dot` for an H100 (the form the 1689 ms step ran), without it to
the block-padded form, and the switch is undone on exit. The bench's own compile of the ~1B MoE
takes minutes; this lowers a tiny MoE model's step (configs/base.py: its MTP module's block is
an MoE layer)."""
import importlib.util
import os

import pytest

from coder.train.aot import hardware as hw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    not hw.gpu_compile_available(),
    reason="GPU targets need jax's CUDA plugin: pip install -e '.[gpu-compile]' (jax-cuda12-plugin and "
           "jax-cuda12-pjrt matching jaxlib)")


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_calibration", os.path.join(ROOT, "bench", "gpu_calibration.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # two lowerings of the tiny model's step: 20-50 s on 2 cores
def test_the_ragged_dot_form_lowers_to_ragged_dot_for_an_h100_and_is_undone():
    from coder.model import expert_dispatch, expert_ffn, sharding
    from coder.stages import compile as C
    from configs import base

    bench = _bench()
    c = base.get_config()
    c.model.update(num_hidden_layers=1, dtype="bfloat16")
    c.data.batch_size, c.data.seq_len = 2, 256
    mesh = sharding.make_mesh(c.mesh, hw.topology_devices(hw.parse_topology("h100")))
    texts = {}
    for form in ("ragged_dot", "block"):
        with bench.expert_form(form):
            lowered, _ = C.lower_train_step(c, mesh)
        texts[form] = lowered.as_text()
    assert "ragged_dot" in texts["ragged_dot"] and "ragged_dot" not in texts["block"]
    assert expert_ffn.grouped_matmul is expert_dispatch.grouped_matmul  # restored: the library's own
    assert expert_ffn.grouped_matmul.__module__ == "coder.model.grouped_matmul"
    assert bench.MEASURED_STEP_S == pytest.approx(1.689, abs=5e-4) and bench.TOLERANCE == 0.10
