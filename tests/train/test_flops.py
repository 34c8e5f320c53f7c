"""Model FLOPs (coder.train.metrics.model_flops_per_token): a hand count on a tiny config, and
one definition behind the training log's MFU and stage `compile`'s report."""
import jax
import numpy as np
import pytest
from flax import nnx

from coder.model import Transformer
from coder.stages import compile as C
from coder.train import losses
from coder.train import metrics as M
from coder.train.balancing import router_balancing
from coder.train.trainer import Trainer
from configs import base


def tiny(**kw):
    m = base.get_config().model
    m.update(dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                  num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2,
                  q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
                  v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                  n_group=1, topk_group=1, num_mtp_layers=1, tie_word_embeddings=False,
                  dtype="float32", max_position_embeddings=128))
    m.rope_scaling.original_max_position_embeddings = 128
    m.update(kw)
    return m


# The hand count of tiny(): D=16, V=64, H=2, q_lora 8, r=8, dn=4, dr=2 (dq=6), dv=4, E=4, k=2.
ATTN = (16 * 8          # q_a_proj   D x q_lora
        + 8 * 2 * 6     # q_b_proj   q_lora x H x dq
        + 16 * (8 + 2)  # kv_a_proj  D x (r + dr)
        + 8 * 2 * (4 + 4)  # kv_b_proj  r x H x (dn + dv)
        + 2 * 4 * 16)   # o_proj     H x dv x D
assert ATTN == 640
DENSE = 3 * 16 * 24  # gate, up, down of the dense SwiGLU (layer 0)
MOE = (16 * 4             # router D x E
       + 3 * 16 * 8       # the shared expert's SwiGLU
       + 2 * (3 * 16 * 8))  # 2 of the 4 routed experts
assert (DENSE, MOE) == (1152, 1216)
TRUNK = 3 * ATTN + DENSE + 2 * MOE  # layer 0 dense, layers 1-2 MoE
HEAD = 16 * 64  # lm_head D x V (the input embedding is a lookup: not counted)
MTP = 2 * 16 * 16 + ATTN + MOE  # eh_proj 2D x D, its MoE block
N_TRAIN = TRUNK + HEAD + MTP + HEAD  # the MTP module uses the shared head too
assert (TRUNK, MTP, N_TRAIN) == (5504, 2368, 9920)
T = 32
ATTN_LAYER = 2 * 2 * (6 + 4) * (T / 2)  # 2 H (dq + dv) FLOPs per key, T/2 keys (causal)
FLOPS_TRAIN = 6 * N_TRAIN + 3 * 4 * ATTN_LAYER  # 4 layers: 3 trunk + 1 MTP
assert FLOPS_TRAIN == 67200


def test_model_flops_match_a_hand_count():
    m = tiny()
    assert M.matmul_params(m) == dict(trunk=TRUNK, head=HEAD, mtp=MTP)
    assert M.active_matmul_params(m) == N_TRAIN
    assert M.attention_flops_per_token(m, T) == 4 * ATTN_LAYER
    assert M.model_flops_per_token(m, T) == FLOPS_TRAIN
    # forward only, trunk alone (an inference program without MTP): 2 N + A over 3 layers
    assert M.model_flops_per_token(m, T, training=False, mtp_modules=0) == 2 * (TRUNK + HEAD) + 3 * ATTN_LAYER
    # decoding against a cache of 100 tokens: every query attends to all 100 keys
    assert M.model_flops_per_token(m, 1, training=False, mtp_modules=0, context=100) == (
        2 * (TRUNK + HEAD) + 3 * 2 * 2 * (6 + 4) * 100)


def test_model_flops_layouts_and_tied_head():
    # tied: the embedding is the head (counted once per use, as lm_head would be)
    assert M.model_flops_per_token(tiny(tie_word_embeddings=True), T) == FLOPS_TRAIN
    # stacked MoE layers: the same weights with a leading layer axis
    assert M.matmul_params(tiny(scan_layers=True)) == dict(trunk=TRUNK, head=HEAD, mtp=MTP)
    # a model's own Param state (the trainer's path for a custom model) gives the same count
    model = Transformer(tiny(), rngs=nnx.Rngs(0))
    assert M.model_flops_per_token(tiny(), T, params=nnx.state(model, nnx.Param)) == FLOPS_TRAIN
    # no query compression: q_proj D x H x dq replaces q_a_proj + q_b_proj
    q = 16 * 2 * 6 - (16 * 8 + 8 * 2 * 6)
    assert M.active_matmul_params(tiny(q_lora_rank=0)) == N_TRAIN + 4 * q


def test_nsa_attention_term():
    m = tiny(attention_backend="nsa")
    m.nsa.update(dict(compress_block=8, compress_stride=4, select_block=8, select_topk=3, window=16))
    width = 2 * 8 + 2  # absorbed: QK over r + dr, AV over r
    t = 64
    cmp = (t / 2) / 4  # causal compressed blocks: T / (2 stride)
    slc = 24 - 24 ** 2 / (2 * t)  # min(position, 3 x 8) averaged over the row
    win = 16 - 16 ** 2 / (2 * t)
    assert M.attention_flops_per_token(m, t) == pytest.approx(2 * 4 * 2 * width * (cmp + slc + win))
    # matmuls: + gates D x H x 3 per layer; compressors (w1 l*w x w, w2 w x w) once per 4 tokens
    comp = ((8 * 10 * 10 + 10 * 10) + (8 * 8 * 8 + 8 * 8)) / 4
    assert M.active_matmul_params(m) == pytest.approx(N_TRAIN + 4 * (16 * 2 * 3 + comp))


@pytest.mark.slow
def test_trainer_log_and_compile_report_use_one_definition(tmp_path):
    config = base.get_config()
    config.model = tiny()
    config.data.batch_size, config.data.seq_len = 4, T
    trainer = Trainer(config, str(tmp_path), losses.lm_loss_fn(config.train),
                      post_update=router_balancing(config.model))
    try:
        fpt = trainer._flops_per_token(T)  # what fit() multiplies tokens/s by for `mfu`
    finally:
        trainer.close()
    assert fpt == FLOPS_TRAIN
    assert C.model_flops_per_step(config.model, 4, T) == 4 * T * FLOPS_TRAIN
    assert C.active_params(config.model) == N_TRAIN
    setup = dict(rows=2, prefill_len=T, cache_slots=100, speculative_k=1)
    e = C.engine_model_flops(config.model, setup)
    assert e["prefill"] == 2 * T * (2 * N_TRAIN + 4 * ATTN_LAYER)
    assert e["decode"] == 2 * 2 * (2 * N_TRAIN + 4 * 2 * 2 * (6 + 4) * 100)


def test_load_imbalance_is_the_one_definition():
    load = np.array([[0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.5, 0.5]])
    assert float(M.load_imbalance(load)) == pytest.approx(2.0)  # E/k: every token on 2 experts
    assert float(jax.jit(M.load_imbalance)(load[:1])) == pytest.approx(1.0)
