"""The whole pipeline on a laptop CPU in minutes: pretrain -> longctx -> mtp -> sft -> grpo -> eval,
tiny model.

    python main.py --config=configs/quickstart.py

Data: the Python standard library of the running interpreter (pretraining, held-out split for
eval) and transcripts of correct tool-using solutions of the env's toy tasks (SFT). The tokenizer
is trained from the corpus on first use and cached (~/.cache/coder/tokenizers).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/quickstart"
    c.stages = ("pretrain", "longctx", "mtp", "sft", "grpo", "eval")

    m = c.model
    m.vocab_size = 2048
    m.hidden_size = 128
    m.intermediate_size = 384
    m.moe_intermediate_size = 64
    m.num_hidden_layers = 2
    m.num_attention_heads = 4
    m.kv_lora_rank = 32
    m.qk_nope_head_dim = 16
    m.qk_rope_head_dim = 8
    m.v_head_dim = 16
    m.n_routed_experts = 4
    m.num_experts_per_tok = 2
    # 150 pretraining steps: at DeepSeek-V3's 1e-3 the bias never catches up and every token
    # routes to 2 of the 4 experts (load_imbalance 2.00); 1e-2 balances it within ~30 steps
    m.bias_update_rate = 1e-2
    m.n_group = 1
    m.topk_group = 1
    m.num_mtp_layers = 1
    m.max_position_embeddings = 256  # the pretraining context; longctx extends it 8x with YaRN
    m.rope_scaling.original_max_position_embeddings = 256
    m.dtype = "float32"  # CPUs have no fast bfloat16 matmul

    c.data.seq_len = 256
    c.data.batch_size = 4
    c.data.tokenizer_vocab_size = 2048

    c.train.steps = 150
    c.train.lr = 3e-3
    c.train.warmup_steps = 10
    c.train.log_every = 10
    c.train.ckpt_every = 50

    # A toy-task transcript is ~1.8k tokens (tool outputs included): SFT packs whole
    # conversations, so the context is extended to 2048 first.
    c.longctx.seq_len = 2048
    c.longctx.steps = 40
    c.longctx.lr = 3e-3

    c.sft.steps = 25
    c.sft.lr = 1e-3
    c.sft.seq_len = 2048
    c.sft.batch_size = 1
    c.sft.toy_tasks = 24

    # MTP self-distillation: the trunk is frozen, the MTP module learns the main head's
    # distribution (its held-out acceptance rate is logged).
    c.mtp.steps = 30
    c.mtp.eval_batches = 2

    # GRPO on the env's toy tasks in the bwrap sandbox: a few steps to show the loop runs; the
    # three tools a toy task needs keep the system prompt short.
    c.rl.tools = ("read_file", "edit_file", "submit")
    c.rl.context_budget = 2048
    c.rl.group_size = 2
    c.rl.tasks_per_step = 1
    c.grpo.steps = 3
    c.rl.eval_num_tasks = 2
    c.rl.eval_samples = 2

    c.eval.batches = 8
    c.eval.agent_tasks = 2  # pass@k of the final model on held-out toy tasks
    return c
