"""The ~1B MoE that bench/accelerator.py trains on one accelerator (docs/accelerator.md: 1689 ms a
step of 8 x 2048 tokens on one H100, 2026-11-28): a DeepSeek-V3-shaped model of 0.98B parameters
(0.23B active), compile-checked for GPUs by docs/scale/configs.py ("moe_1b,h100").

V3's MLA head widths (nope 128, RoPE 64, value 128), query LoRA, one dense layer first, 64 routed
experts top-6 in 8 groups with 4 allowed per token + 1 shared, routed scaling 2.5, one MTP module,
vocab 32768; narrower (hidden 1024) and shallower (12 layers). Everything else is configs/base.py's
default, as the bench runs it (bf16 compute, float32 parameters and AdamW).
"""
from configs.base import get_config as base_config

# the model keys (configs/base.py) bench/accelerator.py sets
MODEL_1B = dict(vocab_size=32768, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=384,
                num_hidden_layers=12, first_k_dense_replace=1, num_attention_heads=16, q_lora_rank=384,
                kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=1, n_group=8, topk_group=4,
                routed_scaling_factor=2.5, num_mtp_layers=1, max_position_embeddings=4096)


def get_config():
    c = base_config()
    c.model.update(MODEL_1B)
    c.data.batch_size, c.data.seq_len = 8, 2048  # the bench's batch on one device
    return c
