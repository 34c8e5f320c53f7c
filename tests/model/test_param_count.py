"""count_params from abstract shapes against a closed-form count and the published totals.

What is counted: `total` = trunk parameters incl. embedding and output head, excluding MTP
modules (DeepSeek-V3's 671B excludes its 14B MTP module; Kimi K2 has none). `active` =
per-token activated parameters: everything but the unchosen routed experts (embedding and head
included). The published figures are rounded: DeepSeek-V3's released config gives 37.55B
activated ("37B") and Kimi K2's released config gives 1.026T total ("1.04T") and 32.86B activated
("32B"), so those three are checked at the tolerance the rounding needs, the exact values by
the closed form.
"""
import pytest

from coder.model import count_params


def closed_form(m) -> dict:
    d, h = m.hidden_size, m.num_attention_heads
    dq = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * dq if m.q_lora_rank else d * h * dq
    attn = (q + d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d)
    norms = 2 * d
    dense = 3 * d * m.intermediate_size
    expert = 3 * d * m.moe_intermediate_size
    moe_fixed = d * m.n_routed_experts + m.n_shared_experts * expert
    n_moe = m.num_hidden_layers - m.first_k_dense_replace
    emb = m.vocab_size * d * (1 if m.tie_word_embeddings else 2)
    base = m.num_hidden_layers * (attn + norms) + m.first_k_dense_replace * dense + n_moe * moe_fixed + emb + d
    total = base + n_moe * m.n_routed_experts * expert
    active = base + n_moe * m.num_experts_per_tok * expert
    mtp_base = m.num_mtp_layers * (3 * d + 2 * d * d + attn + norms + moe_fixed)
    mtp = mtp_base + m.num_mtp_layers * m.n_routed_experts * expert
    mtp_active = mtp_base + m.num_mtp_layers * m.num_experts_per_tok * expert
    return {"total": total, "active": active, "mtp": mtp, "mtp_active": mtp_active}


@pytest.mark.slow
@pytest.mark.parametrize("name,total,active,tol_total,tol_active", [
    ("deepseek_v3_671b", 671e9, 37e9, 0.01, 0.02),
    ("kimi_k2_1t", 1.04e12, 32e9, 0.015, 0.03),
])
def test_full_size_counts(name, total, active, tol_total, tol_active):
    import importlib

    m = importlib.import_module(f"configs.{name}").get_config().model
    got = count_params(m)
    assert got == closed_form(m)
    assert abs(got["total"] / total - 1) < tol_total, got
    assert abs(got["active"] / active - 1) < tol_active, got
    if name == "deepseek_v3_671b":
        assert abs(got["total"] / 671e9 - 1) < 0.001  # 671.03B
        # MTP: 11.6B own + the shared 1.85B embedding/head = DeepSeek's "14B MTP module"
        assert 13e9 < got["mtp"] + 2 * 129280 * 7168 < 14e9


def test_tiny_config_counts_match_closed_form():
    from configs.base import model_config

    for kw in ({}, {"q_lora_rank": 16, "tie_word_embeddings": True, "n_shared_experts": 2}):
        m = model_config()
        m.update(kw)
        assert count_params(m) == closed_form(m)
