"""bench/gpu_calibration.py's form switch: with `expert_form("ragged_dot")` the MoE's expert
matmuls lower to `jax.lax.ragged_dot` for an H100 (the form the 1689 ms step ran, with the glue
around it of then), without it to the Triton grouped matmul, and the switch is undone on exit. The bench's own compile of the ~1B MoE
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
    from coder.model import expert_dispatch, expert_ffn, sharding, transformer
    from coder.pallas import flash_gpu
    from coder.stages import compile as C
    from coder.train import losses
    from configs import base

    bench = _bench()
    c = base.get_config()
    c.model.update(num_hidden_layers=1, dtype="bfloat16")
    c.data.batch_size, c.data.seq_len = 2, 256
    mesh = sharding.make_mesh(c.mesh, hw.topology_devices(hw.parse_topology("h100")))
    library = [(m, name, getattr(m, name)) for m, name in (
        (expert_ffn, "grouped_matmul"), (expert_dispatch, "grouped_matmul"), (expert_ffn, "sorted_ffn"),
        (transformer, "head_logits"), (losses, "next_token_loss"), (losses, "mtp_loss"),
        (flash_gpu, "width_parts"))]
    texts = {}
    for form in ("ragged_dot", "kernel"):
        with bench.expert_form(form):
            if form == "ragged_dot":  # the glue of then: the losses on sliced logits, JAX's head transpose
                assert losses.next_token_loss is bench._next_token_loss_then
                assert transformer.head_logits is bench._head_then
                assert flash_gpu.width_parts(192) is None and flash_gpu.width_parts(128) == ((0, 128),)
            lowered, _ = C.lower_train_step(c, mesh)
        texts[form] = lowered.as_text()
    assert "chlo.ragged_dot" in texts["ragged_dot"] and "chlo.ragged_dot" not in texts["kernel"]
    assert all(getattr(m, name) is fn for m, name, fn in library)  # restored: the library's own
    assert expert_ffn.grouped_matmul.__module__ == "coder.model.grouped_matmul"
    assert bench.MEASURED_STEP_S == pytest.approx(1.689, abs=5e-4) and bench.TOLERANCE == 0.10
    with pytest.raises(ValueError, match="one of"):
        with bench.expert_form("blocks"):
            pass
