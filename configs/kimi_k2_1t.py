"""Kimi K2 (1.04T total, 32B activated; Hugging Face moonshotai/Kimi-K2-Instruct config.json).

DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer, no expert groups and no
MTP module. Compile-checked, not trained here.

Start from the released checkpoint (any stage; FP8 weights dequantized as read; its tokenizer is
tiktoken.model + tokenizer_config.json, encoded with tiktoken and Kimi K2's pre-tokenizer, the
default of data.tiktoken_pattern):

    huggingface-cli download moonshotai/Kimi-K2-Instruct --local-dir /data/Kimi-K2  # or gs://...
    python main.py --config=configs/kimi_k2_1t.py --config.stage=sft \
        --config.init_from=/data/Kimi-K2 --config.sft.data=gs://BUCKET/sft/*.jsonl

The release has no MTP module: set --config.model.num_mtp_layers=1 to train one from scratch
(it starts fresh, logged; the mtp stage distils it). Kimi's own chat tokens can stand in for
coder's: --config.data.chat_tokens.user='<|im_user|>' --config.data.chat_tokens.assistant='<|im_assistant|>'
--config.data.chat_tokens.system='<|im_system|>' --config.data.chat_tokens.end='<|im_end|>'.
"""
from configs.base import get_config as base_config


def get_config():
    c = base_config()
    c.stage = "pretrain"  # --config.stage=compile plans the run on a TPU slice first
    # c.init_from = "gs://BUCKET/Kimi-K2-Instruct"  # the released weights + tokenizer (docstring)
    m = c.model
    m.vocab_size = 163840
    m.hidden_size = 7168
    m.intermediate_size = 18432
    m.moe_intermediate_size = 2048
    m.num_hidden_layers = 61
    m.num_attention_heads = 64
    m.q_lora_rank = 1536
    m.kv_lora_rank = 512
    m.qk_nope_head_dim = 128
    m.qk_rope_head_dim = 64
    m.v_head_dim = 128
    m.n_routed_experts = 384
    m.n_shared_experts = 1
    m.num_experts_per_tok = 8
    m.n_group = 1
    m.topk_group = 1
    m.routed_scaling_factor = 2.827
    m.norm_topk_prob = True
    m.first_k_dense_replace = 1
    m.rms_norm_eps = 1e-6
    m.rope_theta = 50000.0
    m.max_position_embeddings = 131072
    m.rope_scaling.type = "yarn"
    m.rope_scaling.factor = 32.0
    m.rope_scaling.original_max_position_embeddings = 4096
    m.rope_scaling.beta_fast = 1.0
    m.rope_scaling.beta_slow = 1.0
    m.rope_scaling.mscale = 1.0
    m.rope_scaling.mscale_all_dim = 1.0
    m.num_mtp_layers = 0
    m.tie_word_embeddings = False
    m.remat = "save_qkv_proj"
    c.mesh.update(dict(data=1, fsdp=-1, expert=32, tensor=1, sequence=1))
    c.mesh.rules = tuple((k, ("data", "fsdp", "expert")) if k == "batch" else (k, v) for k, v in c.mesh.rules)
    return c
