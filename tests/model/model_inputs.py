"""The model tests' shared inputs: a tiny MoE model config (tests/model/test_moe.py,
test_moe_kernels.py), a mesh config of given axis sizes (test_sharding.py, test_nsa_model.py),
and the Triton launch grids of a function lowered for CUDA from this CPU host
(test_attention_kernels.py, test_sharding.py)."""
import re

import jax


def tiny_moe(**kw):
    from configs.base import model_config

    cfg = model_config()
    cfg.update(dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                    num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
                    qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=8, n_group=4, topk_group=2,
                    num_experts_per_tok=3, routed_scaling_factor=2.5, num_mtp_layers=1,
                    dtype="float32", initializer_range=0.3))
    cfg.update(kw)
    return cfg


def mesh_cfg(rules_override=None, **axes):
    from configs.base import get_config

    m = get_config().mesh
    m.update(dict(data=1, fsdp=1, expert=1, tensor=1, sequence=1))
    m.update(axes)
    if rules_override:
        m.rules = tuple((k, rules_override.get(k, v)) for k, v in m.rules)
    return m


def cuda_grids(fn, *args) -> dict:
    """{kernel name: its launch grid (x, y, z)} of every Triton call of `fn` lowered for CUDA from
    this CPU host (one custom call per line of the module's text)."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "tpu_custom_call" not in text
    grids = {}
    for line in text.splitlines():
        if "@__gpu$xla.gpu.triton" in line:
            grid = tuple(int(re.search(rf"grid_{a} = (\d+)", line).group(1)) for a in "xyz")
            grids[re.search(r'name = "([^"]+)"', line).group(1)] = grid
    return grids
