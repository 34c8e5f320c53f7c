"""The TPU pod layout of the full-size MoE models (DeepSeek-V3, Kimi K2): one place for the mesh,
the logical rules and the training-step settings that docs/scale's compiled reports found, used
by those reports (docs/scale/configs.py) and by the recipes (configs/composer_k2.py,
configs/composer_dsv3.py). Why each choice, in numbers: docs/scale/README.md.

  * every parameter is sharded over all chips of a slice: experts over `expert` (32-way) x the
    embedding dimension over `sequence` (FSDP); over several slices the float32 parameters and
    their Adam moments split over the slices too (`train.params_over_data`);
  * attention heads, the dense layers' hidden units and the vocabulary are tensor-parallel over
    the same `expert` axis; a row is split over `sequence` (queries in zigzag order for splash);
  * the residual stream between blocks splits its tokens over expert x sequence;
  * dropless MoE (megablox, ragged all-to-all with a receive buffer of 2x the balanced share);
  * weights cast to bf16 once per step; bf16 gradient sum and Adam first moment.
"""
from __future__ import annotations

MOE_RULES = (
    ("batch", ("data", "fsdp")),
    ("seq", "sequence"),
    # sequence parallelism: the residual stream (norms, residual adds, router, the MoE's
    # tokens, the layer inputs remat keeps) splits its tokens over every chip of a slice; MLA
    # gathers its low-rank q / kv latents over `expert` for the head-parallel attention and
    # reduce-scatters its output back (coder.model.attention._gather_latent)
    ("res_seq", ("sequence", "expert")),
    ("embed", ("fsdp", "sequence")),
    ("heads", "expert"),
    ("kv_lora", None),
    ("q_lora", None),
    ("head_dim", None),
    ("mlp", "expert"),
    ("exp", "expert"),
    ("exp_mlp", None),
    ("vocab", "expert"),
    ("layers", None),
)

# remat "save_attention": only each block's input and the attention kernel's output and
# log-sum-exp are kept for the backward pass; "full" (256k rows) keeps only each block's input
REMAT = "save_attention"

# Dropless MoE (model.moe_capacity_factor = 0, as the released models); a device's all-to-all
# receive buffer holds A2A_BUFFER_FACTOR x its balanced share of pairs (pairs past it dropped and
# counted; the aux-loss-free balancing keeps them near zero)
MOE_CAPACITY_FACTOR = 0.0
A2A_BUFFER_FACTOR = 2.0


def mesh(slices: int, expert: int = 32, sequence: int = 8) -> dict:
    """The learner's mesh over `slices` TPU slices: expert x sequence inside a slice, the slices
    data-parallel (DCN)."""
    return dict(data=slices, fsdp=1, expert=expert, tensor=1, sequence=sequence, num_slices=slices)


def apply(c, *, slices: int, expert: int = 32, embed=None, params_over_data: bool = False,
          reduce_grads_once: bool = False, offload_optimizer: bool = False):
    """Set `c`'s mesh, rules and training-step settings to the pod layout; returns `c`.

    embed: the mesh axes of the embedding dimension (default fsdp x sequence); the rest as the
    module docstring."""
    c.mesh.update(mesh(slices, expert))
    rules = dict(MOE_RULES)
    if embed is not None:
        rules["embed"] = embed
    c.mesh.rules = tuple(rules.items())
    c.train.grad_accum_dtype = "bfloat16"
    c.train.mu_dtype = "bfloat16"  # as DeepSeek-V3 trained (its report, section 3.3)
    c.train.params_over_data = params_over_data
    c.train.reduce_grads_once = reduce_grads_once
    c.train.cast_params_once = True
    c.train.offload_optimizer = offload_optimizer
    m = c.model
    m.remat = REMAT
    m.moe_capacity_factor = MOE_CAPACITY_FACTOR
    m.moe_a2a_buffer_factor = A2A_BUFFER_FACTOR
    m.moe_shared_data_parallel = True  # the shared expert on each chip's own tokens
    m.scan_layers = True  # one compiled MoE layer (an unrolled 61-layer step: ~45 min to compile)
    return c


def actor_engine(c, *, actor_chips: int):
    """The rollout engine laid out as DeepSeek-V3 serves (rl.engine_attention="data_parallel"):
    bf16 weights, the experts split over every chip of the actor's slice (at most one expert
    group per chip), the non-expert weights whole on every chip, rows (and their MLA latent
    caches, which have no head axis) split over the chips."""
    c.rl.engine_dtype = "bfloat16"
    c.rl.engine_attention = "data_parallel"
    c.rl.engine_mesh.update(dict(expert=min(actor_chips, int(c.model.n_routed_experts)), tensor=1, sequence=1))
    return c


# GPU clusters (nodes of 8 GPUs on NVLink, nodes on InfiniBand): the pod layout above puts the
# heads, the vocabulary and the dense hidden units over `expert`, which spans nodes there, so its
# tensor parallelism crossed InfiniBand every layer (DeepSeek-V3 on 32 x 8 H200s, compiled:
# 5.2 TB a GPU a step over InfiniBand, 113 s). Here tensor parallelism stays in a node and the
# rows and experts split across nodes:
GPU_RULES = (
    ("batch", ("data", "expert")),  # rows split over the nodes (data parallel across InfiniBand)
    ("seq", None),
    ("res_seq", "tensor"),  # the residual stream's tokens over a node's GPUs (sequence parallel)
    ("embed", "expert"),  # the float32 parameters and moments split over the nodes too (ZeRO-3)
    ("heads", "tensor"),
    ("kv_lora", None),
    ("q_lora", None),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("exp", ("expert", "tensor")),  # one expert group per GPU (DeepSeek-V3: 1 of 256 experts)
    ("exp_mlp", None),
    ("vocab", "tensor"),
    ("layers", None),
)


def gpu_cluster(c, *, nodes: int, gpus_per_node: int = 8, embed="expert"):
    """Set `c`'s mesh, rules and step settings to the GPU cluster layout (GPU_RULES): `expert`
    over the nodes, `tensor` over a node's GPUs (the mesh takes the devices in node order, so its
    last split axis is a node's); otherwise `apply`'s settings. embed: the mesh axes of the
    embedding dimension (default: over the nodes; "tensor" where the node count does not divide
    the hidden size). Returns `c`."""
    apply(c, slices=1)
    c.mesh.update(dict(data=1, fsdp=1, expert=nodes, tensor=gpus_per_node, sequence=1, num_slices=1))
    rules = dict(GPU_RULES)
    rules["embed"] = embed
    c.mesh.rules = tuple(rules.items())
    return c
