"""Fixtures of tests/model."""
import pytest


@pytest.fixture
def export_cfg():
    """`export_cfg(num_mtp_layers)`: the smallest model config hf_export / hf_import round-trip
    (2 layers, 4 experts in 2 groups, float32)."""
    from configs.base import model_config

    def make(num_mtp_layers: int = 0):
        cfg = model_config()
        cfg.update(dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, n_group=2, topk_group=1,
                        num_mtp_layers=num_mtp_layers, dtype="float32"))
        return cfg
    return make
