"""DeepSeek-V3 (671B total, 37B activated; Hugging Face deepseek-ai/DeepSeek-V3 config.json).

Compile-checked, not trained here. The published 671B excludes the 14B MTP module, which this
config keeps (num_mtp_layers=1); count_params reports it separately.

Start from the released checkpoint (any stage; its FP8 weights are dequantized block-wise as
they are read, its MTP module, layer 61, is imported, its tokenizer.json is the run's tokenizer):

    huggingface-cli download deepseek-ai/DeepSeek-V3 --local-dir /data/DeepSeek-V3  # or gs://...
    python main.py --config=configs/deepseek_v3_671b.py --config.stage=sft \
        --config.init_from=/data/DeepSeek-V3 --config.sft.data=gs://BUCKET/sft/*.jsonl

config.json sets the model keys below (they already agree). The chat template's tokens are
coder's own by default, added as 11 new rows; DeepSeek's own role tokens can stand in for some:
    --config.data.chat_tokens.user='<｜User｜>' --config.data.chat_tokens.assistant='<｜Assistant｜>'
"""
from configs.base import get_config as base_config


def get_config():
    c = base_config()
    c.stage = "pretrain"  # --config.stage=compile plans the run on a TPU slice first
    # c.init_from = "gs://BUCKET/DeepSeek-V3"  # the released weights + tokenizer (docstring)
    m = c.model
    m.vocab_size = 129280
    m.hidden_size = 7168
    m.intermediate_size = 18432
    m.moe_intermediate_size = 2048
    m.num_hidden_layers = 61
    m.num_attention_heads = 128
    m.q_lora_rank = 1536
    m.kv_lora_rank = 512
    m.qk_nope_head_dim = 128
    m.qk_rope_head_dim = 64
    m.v_head_dim = 128
    m.n_routed_experts = 256
    m.n_shared_experts = 1
    m.num_experts_per_tok = 8
    m.n_group = 8
    m.topk_group = 4
    m.routed_scaling_factor = 2.5
    m.norm_topk_prob = True
    m.first_k_dense_replace = 3
    m.rms_norm_eps = 1e-6
    m.rope_theta = 10000.0
    m.max_position_embeddings = 163840
    m.rope_scaling.type = "yarn"
    m.rope_scaling.factor = 40.0
    m.rope_scaling.original_max_position_embeddings = 4096
    m.rope_scaling.beta_fast = 32.0
    m.rope_scaling.beta_slow = 1.0
    m.rope_scaling.mscale = 1.0
    m.rope_scaling.mscale_all_dim = 1.0
    m.num_mtp_layers = 1
    m.tie_word_embeddings = False
    m.remat = "save_qkv_proj"
    # Experts over 32-way expert parallelism; the rest FSDP. Tokens are split over the expert
    # axis too (batch -> data, fsdp, expert), so no device repeats the dense layers' work.
    c.mesh.update(dict(data=1, fsdp=-1, expert=32, tensor=1, sequence=1))
    c.mesh.rules = tuple((k, ("data", "fsdp", "expert")) if k == "batch" else (k, v) for k, v in c.mesh.rules)
    return c
