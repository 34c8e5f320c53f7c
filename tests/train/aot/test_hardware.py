"""coder.train.aot.hardware's GPU targets: the topology spellings, the chips' figures against the
target configs vendored from XLA, and the compile-only devices of jax's CUDA plugin (skipped
when the gpu-compile extra is absent; the test extra installs it)."""
import re

import pytest

from coder.train.aot import hardware as hw

needs_plugin = pytest.mark.skipif(
    not hw.gpu_compile_available(),
    reason="GPU targets need jax's CUDA plugin: pip install -e '.[gpu-compile]' (jax-cuda12-plugin and "
           "jax-cuda12-pjrt matching jaxlib)")


@pytest.mark.parametrize("spec, gpus, nodes, chips, arg", [
    ("h100", 1, 1, 1, "1x1x1"),
    ("h100-8", 8, 1, 8, "1x1x8"),
    ("h200-4", 4, 1, 4, "1x1x4"),
    ("b200-8x32", 8, 32, 256, "1x32x8"),
])
def test_parse_gpu_topology(spec, gpus, nodes, chips, arg):
    t = hw.parse_topology(spec)
    assert (t.gpus_per_node, t.nodes, t.num_chips, t.topology_arg, t.name) == (gpus, nodes, chips, arg, spec)
    assert t.chips_per_host_bounds == (gpus, 1, 1) and t.num_slices == 1


@pytest.mark.parametrize("spec, slices, match", [
    ("h100-16", 1, "holds 1 to 8 GPUs"),
    ("h100-0", 1, "holds 1 to 8 GPUs"),
    ("h100-8", 2, r"h100-8x2"),
    ("a100", 1, "GPU target"),
])
def test_parse_gpu_topology_rejects_what_no_node_holds(spec, slices, match):
    with pytest.raises(ValueError, match=match):
        hw.parse_topology(spec, slices)


def _field(text: str, name: str) -> str:
    return re.search(rf"^\s*{name}: (.+)$", text, re.M).group(1).strip('"')


@pytest.mark.parametrize("name", sorted(hw.GPU_CHIPS))
def test_chip_figures_agree_with_the_target_config_xla_compiles_against(name):
    chip = hw.GPU_CHIPS[name]
    text = hw.target_config(chip)
    assert int(_field(text, "device_memory_size")) == chip.hbm_bytes
    assert int(_field(text, "l2_cache_size")) == chip.l2_bytes
    assert _field(text, "name") == chip.device_kind
    # the data sheet's HBM bandwidth within 5% of the one XLA's cost model takes
    assert float(_field(text, "memory_bandwidth")) == pytest.approx(chip.hbm_bandwidth, rel=0.05)
    assert chip.pool_bytes == 0.75 * chip.hbm_bytes
    # dense peaks: fp8 twice bf16 on every part here
    assert chip.peak_fp8_flops == 2 * chip.peak_bf16_flops


def test_the_h100_pool_is_what_jax_preallocates_on_an_80_gb_h100():
    assert hw.GPU_CHIPS["h100"].pool_bytes / 1e9 == pytest.approx(63.7, abs=0.05)


@needs_plugin
def test_gpu_devices_are_compile_only_cuda_devices_node_major():
    import jax

    devices = hw.topology_devices(hw.parse_topology("h100-8x2"))
    assert len(devices) == 16 and {d.device_kind for d in devices} == {hw.GPU_CHIPS["h100"].device_kind}
    assert [d.process_index for d in devices] == [d.id // 8 for d in devices] == [i // 8 for i in range(16)]
    assert jax.devices()[0].platform == "cpu"  # the default backend is untouched


def test_a_missing_plugin_names_what_to_install(monkeypatch):
    monkeypatch.setattr(hw, "gpu_compile_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"gpu-compile.*jax-cuda12-plugin==\S+ jax-cuda12-pjrt=="):
        hw.topology_devices(hw.parse_topology("h100"))
