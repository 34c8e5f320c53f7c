"""The model schema: every key of `config.model`, with its default and what it does.

The names follow Hugging Face's DeepseekV3Config, so a checkpoint's config.json maps onto them
(coder.model.hf_import). `configs/base.py` puts this section into the run config; the model code
reads only this section, never the run config. `default_rules` is the logical-axis -> mesh-axis
table that `config.mesh.rules` starts from (coder.model.sharding).
"""
import ml_collections


def model_config() -> ml_collections.ConfigDict:
    """DeepSeek-V3 / Kimi-K2 architecture. Names follow Hugging Face's DeepseekV3Config."""
    m = ml_collections.ConfigDict()
    m.vocab_size = 4096  # tokenizer vocabulary (padded up to a multiple of 128 by the tokenizer)
    m.hidden_size = 256  # residual stream width
    m.intermediate_size = 768  # SwiGLU width of the dense (first_k_dense_replace) layers
    m.moe_intermediate_size = 128  # SwiGLU width of each routed / shared expert
    m.num_hidden_layers = 4  # transformer blocks in the trunk
    m.num_attention_heads = 4  # MLA query heads
    m.q_lora_rank = 0  # 0 = no query compression (DeepSeek-V3: 1536)
    m.kv_lora_rank = 64  # compressed KV latent width (what the KV cache stores)
    m.qk_nope_head_dim = 32  # per-head query/key width without RoPE
    m.qk_rope_head_dim = 16  # decoupled RoPE width (one RoPE key shared by all heads)
    m.v_head_dim = 32  # per-head value width
    m.n_routed_experts = 8  # routed experts per MoE layer
    m.n_shared_experts = 1  # always-on shared experts per MoE layer
    m.num_experts_per_tok = 2  # top-k routed experts per token
    m.n_group = 2  # expert groups for group-limited routing (1 = off)
    m.topk_group = 1  # groups each token may route into
    m.routed_scaling_factor = 1.0  # multiplier on the routed experts' combined output
    m.norm_topk_prob = True  # renormalise the top-k sigmoid weights to sum to 1
    m.first_k_dense_replace = 1  # the first k layers use a dense SwiGLU instead of MoE
    # aux-loss-free balancing: bias += rate * sign(mean_load - load) after every step. The bias
    # must move by up to the sigmoid scores' range within the run: DeepSeek-V3's 1e-3 suits its
    # ~10^5 steps; a short run from scratch needs more (coder.model.routing.balancing_warning,
    # logged at start-up when rate x steps < 1; configs/quickstart.py uses 1e-2)
    m.bias_update_rate = 1e-3
    # 0 = dropless (DeepSeek-V3): grouped matmuls over the routed pairs (megablox gmm/tgmm on
    # TPU, forward and backward cost the routed work only). c > 0: each expert takes at most
    # ceil(c * pairs / experts) (token, expert) pairs of the tokens a device sees, in token order,
    # and drops the rest (GShard): a fixed [experts, capacity] buffer, c x the routed work
    m.moe_capacity_factor = 0.0
    # dropless expert parallelism: "auto" (ragged_all_to_all on TPU/GPU, all-gather on CPU, which
    # has no ragged-all-to-all) | "all_gather" | "ragged_all_to_all" (coder.model.expert_dispatch)
    m.moe_dispatch = "auto"
    # ragged_all_to_all receive buffer, in units of a device's own pairs (tokens x k): 0 = the
    # worst case, all of the expert group's pairs on one device (expert-parallel size x the
    # average: memory-heavy at scale); f > 0 = f x, pairs past it dropped (stats["dropped"])
    m.moe_a2a_buffer_factor = 0.0
    # the shared experts: False = tensor-parallel over `mlp` (each chip gathers its sequence
    # shard's tokens and reduce-scatters the output); True = on the residual stream's own tokens
    # (`res_seq`) with the weights gathered whole at use, far fewer bytes when the stream is
    # split over the mlp axis too and the experts are small (DeepSeek-V3, Kimi K2: 2048 units).
    # A training layout: decoding a few tokens per row, the whole-weight gathers cost more
    # (stage compile's engine programs are lowered without it)
    m.moe_shared_data_parallel = False
    m.rms_norm_eps = 1e-6  # RMSNorm epsilon
    m.rope_theta = 10000.0  # RoPE base
    m.max_position_embeddings = 1024  # longest sequence the RoPE tables are built for
    m.rope_scaling = ml_collections.ConfigDict(
        dict(
            type="none",  # "none" | "yarn"
            factor=1.0,  # YaRN context extension factor
            original_max_position_embeddings=1024,  # context length before extension
            beta_fast=32.0,  # YaRN high-frequency boundary (rotations)
            beta_slow=1.0,  # YaRN low-frequency boundary (rotations)
            mscale=1.0,  # YaRN attention temperature coefficient (DeepSeek-V3: 1.0)
            mscale_all_dim=1.0,  # YaRN mscale applied to all dims (softmax scale correction)
        )
    )
    m.num_mtp_layers = 1  # DeepSeek-V3 multi-token-prediction modules (0 = none)
    m.tie_word_embeddings = False  # share the embedding and the output head
    m.attention_backend = "dense"  # "dense" | "nsa"
    # how the dense attention meets its keys where the mesh splits a row over `seq`
    # (coder.model.context_parallel): "gather" them whole on every device, or pass them around
    # a "ring" (no device holds more than its share and one visiting block)
    m.context_parallel = "gather"
    m.nsa = ml_collections.ConfigDict(
        dict(
            compress_block=32,  # l: compression block length
            compress_stride=16,  # d: stride between compression blocks
            select_block=64,  # l': selection block length
            select_topk=16,  # n: selected blocks per query (incl. initial and local blocks)
            window=512,  # w: sliding-window width
        )
    )
    m.dtype = "bfloat16"  # compute dtype of activations and matmuls
    m.param_dtype = "float32"  # master weights
    # activation rematerialisation: "none" | "full" | "save_dots" | "save_qkv_proj" |
    # "save_attention" (full, keeping the attention kernel's output: coder.model.transformer)
    m.remat = "none"
    # run the MoE layers as one lax.scan over stacked weights ([layers, ...] leaves named
    # moe_stack.*): XLA compiles one layer instead of ~60 (minutes, not an hour, for a full-size
    # config); same numbers as the unrolled loop, a different checkpoint layout
    m.scan_layers = False
    m.initializer_range = 0.02  # std of the normal initialiser
    return m


def default_rules() -> tuple:
    """Logical axis name -> mesh axes. Changing parallelism is a change of this table."""
    return (
        ("batch", ("data", "fsdp")),
        ("seq", "sequence"),  # attention's queries (and the MLPs' tokens)
        # the residual stream between blocks (norms, residual adds, the router, the MoE's tokens,
        # the activations remat keeps): splitting it over more axes than `seq` (e.g. the axes of
        # `heads`) is sequence parallelism: XLA gathers it for attention and scatters it back
        ("res_seq", "sequence"),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv_lora", None),
        ("q_lora", None),
        ("head_dim", None),
        ("mlp", "tensor"),
        ("exp", "expert"),
        ("exp_mlp", "tensor"),
        ("vocab", "tensor"),
        ("layers", None),
    )


def routing_errors(cfg) -> list[str]:
    """Settings under which `route` cannot pick num_experts_per_tok allowed experts (each names
    the keys to change); coder.model.sharding.validate and coder.model.moe.MoE refuse them."""
    e, k, g, tg = cfg.n_routed_experts, cfg.num_experts_per_tok, max(1, cfg.n_group), cfg.topk_group
    errors = []
    if not 0 < k <= e:
        errors.append(f"model.num_experts_per_tok={k} must be in 1..model.n_routed_experts={e}")
    if g > 1 and e % g == 0:
        if e // g < 2:  # a group's score is the sum of its top-2 experts
            errors.append(f"model.n_group={g} leaves {e // g} expert per group (group-limited "
                          "routing scores a group by its top-2 experts): lower model.n_group")
        if tg * (e // g) < k:  # top-k would take experts of groups the token may not use
            errors.append(f"model.topk_group={tg} groups of {e // g} experts (model.n_group={g}) "
                          f"hold fewer than model.num_experts_per_tok={k} experts: raise "
                          "model.topk_group or lower model.n_group")
    return errors
