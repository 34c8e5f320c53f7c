"""The settings behind every report in docs/scale/: model x topology -> mesh, remat, batch.

    python main.py --config=docs/scale/configs.py:deepseek_v3_671b,v5p-512 --config.stage=compile
    python main.py --config=docs/scale/configs.py:moe_1b,h100 --config.stage=compile   # a GPU (GPU_SETTINGS)

`get_config("MODEL,TOPOLOGY")` takes configs/MODEL.py unchanged (the architecture) and sets what
a 32k-token training step on that slice needs; docs/scale/regenerate.sh runs every pair and
writes docs/scale/MODEL_TOPOLOGY/report.{json,md}. Only the parallelism table, the batch shape,
remat, the MoE dispatch buffer, the optimizer placement and the engine's and GRPO step's
shapes change here, never the architecture.

Layout for the full-size MoE models (why, in numbers, in docs/scale/README.md):
  * every parameter is sharded over all chips of a slice: experts over `expert` (32-way) x the
    embedding dimension over `sequence` (FSDP; on v6e also over the slices, `data`); the Adam
    moments like their parameter, or also over the slices (train.optimizer_over_data) or in
    host memory (train.offload_optimizer, as the trainer runs it);
  * attention heads, the dense layers' hidden units and the vocabulary are tensor-parallel over
    the same `expert` axis, so no chip repeats attention or dense work while experts are split;
  * a 32k row is split over `sequence` (queries in zigzag order for the splash kernel; keys
    and values are gathered);
  * the MoE layers route each chip's share of the tokens and move the routed pairs with
    ragged_all_to_all (dropless, megablox grouped matmuls);
  * the residual stream between blocks splits its tokens over expert x sequence (sequence
    parallelism), so no chip repeats another's norms, router or residual adds, and remat keeps
    1/256 of each layer's input per chip;
  * the MoE layers' shared expert (2048 units) runs on each chip's own residual-stream
    tokens with its weights gathered whole (model.moe_shared_data_parallel): tensor-parallel
    over `expert` it gathered a sequence shard's hidden states onto every chip and
    reduce-scattered its output, forward and backward, 5x the bytes of its weights;
  * the weights are cast to bf16 once per step and differentiated as that copy
    (train.cast_params_once); a micro-batch is batch / grad_accum rows; the gradient sum is
    bfloat16.
"""
import importlib

# The mesh, rules and step settings of the pod layout (shared with the recipes,
# configs/composer_k2.py and configs/composer_dsv3.py)
from configs import pod_layout

SEQ_LEN = 32768

REMAT = pod_layout.REMAT

# The RL engine's programs compiled beside the step (coder.stages.compile.lower_engine): rows
# decoded together, cache slots (a 32k context), tokens per prefill chunk.
ENGINE = dict(engine_batch=8, engine_max_len=SEQ_LEN, engine_prefill_len=1024)

# topology -> slices, batch (rows of SEQ_LEN tokens per step), micro-batches, optimizer
# placement. 128 rows of 32k = 4.2M tokens per step (DeepSeek-V3 trained with 15M-token steps);
# a micro-batch is batch / grad_accum rows, each row split over the `sequence` axis
SETTINGS = {
    # 11 rows per micro-batch (132 rows: 4.3M tokens): every micro-batch re-gathers each layer's
    # weights over `sequence` (FSDP) and reduce-scatters its gradient, so more rows amortise
    # that (sequence parallelism left the memory for them: 3 rows needed 85.1 GiB without it)
    "v5p-512": dict(slices=1, batch_size=132, grad_accum=12, grpo_batch=96),
    # Kimi K2 over two slices: the float32 parameters and their Adam moments split over both
    # (train.params_over_data: ZeRO across DCN, the bf16 copy gathered across slices once per
    # step), a bf16 gradient sum per slice reduced across the slices once per step
    # (train.reduce_grads_once); the memory that frees pays for 16 rows per slice per
    # micro-batch (4 micro-batches: each re-gathers the expert weights over `sequence`)
    "v5p-512x2": dict(slices=2, batch_size=128, grad_accum=4, params_over_data=True,
                      reduce_grads_once=True, engine=False, grpo=False),
    "v5p-1024": dict(slices=1, batch_size=128, grad_accum=32, expert=64),
    # 32 GB chips: parameters, gradients and the gradient sum shard over both slices too
    # (`embed` over data x fsdp x sequence: ZeRO-3 across DCN, whose weight gathers then cross
    # DCN every micro-batch) and the Adam moments live in host memory between steps
    "v6e-256x2": dict(slices=2, batch_size=128, grad_accum=16, offload_optimizer=True,
                      embed=("data", "fsdp", "sequence"), engine=False, grpo=False),
    # the same over four slices (1024 chips): parameters, gradients and the update's moments
    # (brought in from host memory) are a quarter of a slice's share each
    "v6e-256x4": dict(slices=4, batch_size=128, grad_accum=16, offload_optimizer=True,
                      embed=("data", "fsdp", "sequence"), engine=False, grpo=False),
}
# GPU targets ("MODEL,h100"): the step of the model's own config (configs/MODEL.py: its batch, its
# mesh; configs/moe_1b.py is bench/accelerator.py's ~1B MoE on one GPU, 8 x 2048 tokens) compiled
# by XLA:GPU for that topology (coder/train/aot/hardware.py: "h100", "h100-8", "h100-8x32"), the
# training step alone. The TPU pod layout is not applied.
GPU_SETTINGS = ("h100", "h200", "b200")

# GPU clusters for the full-size MoE models ("MODEL,h200-8x32": 32 nodes of 8 GPUs): the GPU
# cluster layout (configs/pod_layout.py gpu_cluster: tensor parallelism inside a node, rows and
# experts over the nodes); 128 rows of 32k a step in micro-batches of `rows` rows
GPU_CLUSTER_SETTINGS = {
    # an H100's 63.7 GB pool: each block recomputed in the backward (save_attention: 95.1 GiB of
    # 59.3) and an all-to-all receive buffer of 1.5x the balanced share (2x: 63.3 GiB)
    "h100-8x32": dict(rows=32, remat="full", a2a_buffer_factor=1.5),
    "h200-8x32": dict(rows=32),
    "b200-8x32": dict(rows=32),
    # Kimi K2: 384 experts, one a GPU over 48 nodes (over 16 nodes, 3 a GPU: 150.5 GiB of
    # 105.8); 7168 does not divide over 48 nodes, so the embedding dimension of the dense weights
    # splits over a node's GPUs only; 144 rows (a row per node per micro-batch). No optimizer
    # offload on GPUs: the compile-only CUDA devices place host-memory arguments on the device
    # (their memory stats count none on the host), so it is neither claimed nor counted
    "h200-8x48": dict(rows=48, batch=144, embed="tensor"),
    "b200-8x48": dict(rows=48, batch=144, embed="tensor"),
}

# the GRPO learner's step compiled beside the training step (and the engine's programs; the
# DeepSeek-V3 v5p-512 report has both, the others compile the training step only, for time):
# rows of SEQ_LEN-token rollouts
GRPO_BATCH = 64


# Disaggregated RL: an actor's engine on a slice of its own ("MODEL,SETTING,ACTOR_TOPOLOGY"): the
# serving weights in bf16 split over all of the actor's chips by experts (and attention heads /
# vocabulary over the same axis), rows over nothing else; the rollout batch of one actor. The
# learner's step is compiled as in SETTING's report (the GRPO step is in that report already).
# MLA's latent cache has no head axis, so with rows over no mesh axis every chip holds every
# row's cache (2.2 GB per 32k row for DeepSeek-V3): 128 rows needed 1.12 TB of temporaries per
# chip; 16 rows is what one v5p-128 actor decodes together in this layout.
# The actor slice's engine is laid out as DeepSeek-V3 serves (rl.engine_attention="data_parallel"):
# 128 rows of 32k slots split over the 64 chips (2 rows' latent caches each), the non-expert
# weights whole on every chip, the experts 64-way; prefill in chunks of 256 tokens per row
# (1024 needed 117 GiB of temporaries for 128 rows)
ACTOR_ENGINE = dict(engine_batch=128, engine_max_len=SEQ_LEN, engine_prefill_len=256)

# Colocated RL on the learner's slice ("MODEL,SETTING,colocated"; rl.topology.colocated: the learner's job
# runs the engine in turns with its steps, coder/rl/colocated.py): the engine laid out as on an
# actor slice (bf16, experts split over every chip, rows data-parallel) over the learner's chips,
# one 32k row per chip; the optimizer state in host memory while the engine runs
# (rl.topology.offload_optimizer) and no reference copy (grpo.kl_coef = 0, as Composer 2's recipe,
# configs/composer_k2.py). The report's colocated section adds up each phase's memory.
COLOCATED_ENGINE = dict(engine_max_len=SEQ_LEN, engine_prefill_len=256)


# Long context ("MODEL,SETTING,longNk"): the longctx stage's step at N x 1024 tokens a row, as
# coder.stages.lm.longctx_config builds it (YaRN over the model's original context of 4096,
# factor N*1024 / 4096), in SETTING's layout: a row's queries split over `sequence` (zigzag),
# its keys and values gathered whole per chip, the residual stream over expert x sequence. A
# step keeps 2^22 tokens (32 rows of 128k, 16 of 256k); a micro-batch holds LONG[N]["rows"] rows
# per slice (the 32k report's 11 rows are 360k tokens; per chip a 128k row's residual stream is
# 4x a 32k row's). The GRPO step at that context beside it where LONG[N] and SETTING both compile
# one (the engine's programs are left out: an engine at these lengths is the KV offload's
# question).
LONG_TOKENS = 2 ** 22
LONG = {
    128: dict(rows=2, grpo=True),
    # one row per micro-batch and slice; on one v5p-512 DeepSeek-V3 needed 98.7 of 95 GiB with
    # remat save_attention (71.3 GiB of temporaries) and 95.8 with full remat, which keeps only
    # each block's input
    256: dict(rows=1, grpo=False, remat="full"),
}


def get_config(arg: str = "deepseek_v3_671b,v5p-512"):
    model, setting, *rest = arg.split(",")
    # "", "colocated", "longNk" (+ "-nsa": NSA attention, "-offload": the Adam moments in host
    # memory between steps, which NSA always takes; "-ring": the dense attention's keys passed
    # around a ring over `sequence`, model.context_parallel) or an actor slice's topology
    variant = rest[0] if rest else ""
    c = importlib.import_module(f"configs.{model}").get_config()
    c.stage = "compile"
    if setting in GPU_SETTINGS:
        if rest:
            raise ValueError(f"{arg!r}: a GPU setting takes no variant")
        c.stages = ()
        c.compile.update(topology=setting, report_dir=f"docs/scale/{model}_{setting}", engine=False, grpo=False)
        return c
    if setting in GPU_CLUSTER_SETTINGS:
        # a third part: an RL actor's engine on a node of its own ("MODEL,h200-8x32,h200-8"),
        # laid out as on an actor slice (pod_layout.actor_engine: bf16, experts over every GPU)
        from coder.train.aot import hardware

        if rest and (len(rest) > 1 or hardware.parse_gpu_topology(rest[0]).nodes != 1):
            raise ValueError(f"{arg!r}: a GPU cluster setting takes at most an actor node's topology "
                             "(e.g. h200-8)")
        c.stages = ()
        topo, g = hardware.parse_gpu_topology(setting), GPU_CLUSTER_SETTINGS[setting]
        pod_layout.gpu_cluster(c, nodes=topo.nodes, gpus_per_node=topo.gpus_per_node, embed=g.get("embed", "expert"))
        c.data.seq_len, c.data.batch_size = SEQ_LEN, g.get("batch", 128)
        c.train.grad_accum = c.data.batch_size // g["rows"]
        c.model.remat = g.get("remat", c.model.remat)
        c.model.moe_a2a_buffer_factor = g.get("a2a_buffer_factor", c.model.moe_a2a_buffer_factor)
        c.compile.update(topology=setting, report_dir=f"docs/scale/{model}_{setting}", engine=False, grpo=False)
        if rest:
            c.compile.report_dir += f"_actors-{rest[0]}"
            c.compile.engine_topology = rest[0]
            c.compile.update(ACTOR_ENGINE, engine=True, grpo=False)
            pod_layout.actor_engine(c, actor_chips=hardware_chips(rest[0]))
        return c
    c.compile.topology = setting.split("x")[0]  # "v6e-256x2" -> two v6e-256 slices
    colocated = variant == "colocated"
    long_k, flags = 0, set()
    if variant.startswith("long"):
        head, *rest_flags = variant.split("-")
        long_k, flags = int(head[4:-1]), set(rest_flags)
        if flags - {"nsa", "offload", "ring"} or {"nsa", "ring"} <= flags:
            raise ValueError(f"{variant!r}: a long-context variant is longNk, then -nsa or -ring and/or -offload")
    nsa, offload, ring = "nsa" in flags, "offload" in flags, "ring" in flags
    actor = "" if colocated or long_k else variant
    c.compile.report_dir = f"docs/scale/{model}_{setting}" + (
        "_colocated" if colocated else f"_long{long_k}k" if long_k else f"_actors-{actor}" if actor else "") + (
        "_nsa" if nsa else "_ring" if ring else "") + ("_offload" if offload else "")
    if model == "quickstart":  # the tiny config: its own mesh (data parallel), bf16 as on TPU
        c.stages = ()
        c.model.dtype = "bfloat16"
        return c
    s = SETTINGS[setting]
    pod_layout.apply(c, slices=s["slices"], expert=s.get("expert", 32), embed=s.get("embed"),
                     params_over_data=s.get("params_over_data", False),
                     reduce_grads_once=s.get("reduce_grads_once", False),
                     offload_optimizer=s.get("offload_optimizer", False))
    c.data.seq_len = SEQ_LEN
    c.data.batch_size = s["batch_size"]
    c.train.grad_accum = s["grad_accum"]
    c.train.optimizer_over_data = s.get("optimizer_over_data", False)
    c.compile.update(ENGINE)
    c.compile.engine = s.get("engine", True)
    c.compile.grpo = s.get("grpo", True)
    c.compile.grpo_batch = s.get("grpo_batch", GRPO_BATCH)
    c.compile.grpo_seq_len = SEQ_LEN
    c.grpo.router_replay = True  # the learner routes by the engine's expert ids
    if long_k:
        from coder.stages.lm import longctx_config

        lg = LONG[long_k]
        c.longctx.seq_len = long_k * 1024
        c.longctx.batch_size = LONG_TOKENS // c.longctx.seq_len
        c = longctx_config(c)
        # NSA (its defaults, configs/base.py): the mesh splits the sequence, so each layer runs the
        # XLA path in a shard_map (docs/nsa.md), whose temporaries are the selected blocks gathered
        # per query chunk: one row per micro-batch (DeepSeek-V3 on v5p-512: 121.6 GiB with two,
        # with remat save_attention or full alike; 101.5 with one), and the Adam moments in host
        # memory between steps (train.offload_optimizer; on the device: 101.5 of 95 GiB for
        # DeepSeek-V3 on v5p-512, 95.25 for Kimi K2 on 2 x v5p-512)
        rows = 1 if nsa else lg["rows"]
        c.train.grad_accum = c.data.batch_size // (rows * s["slices"])
        c.model.remat = lg.get("remat", REMAT)
        if nsa:
            c.model.attention_backend = "nsa"
        if ring:
            c.model.context_parallel = "ring"
        c.train.offload_optimizer = bool(c.train.offload_optimizer or nsa or offload)
        c.compile.update(engine=False, grpo=lg["grpo"] and s.get("grpo", True) and not nsa,
                         grpo_batch=c.data.batch_size,
                         grpo_seq_len=c.data.seq_len)
        return c
    if colocated:
        chips = hardware_chips(c.compile.topology)
        c.compile.update(COLOCATED_ENGINE, engine=True, grpo=True, engine_batch=chips)
        pod_layout.actor_engine(c, actor_chips=chips)
        c.rl.topology.update(dict(colocated=True, offload_optimizer=True, asynchronous=False))
        c.grpo.kl_coef = 0.0
    elif actor:
        c.compile.engine_topology = actor
        c.compile.update(ACTOR_ENGINE, engine=True, grpo=False)
        pod_layout.actor_engine(c, actor_chips=hardware_chips(actor))
    return c


def hardware_chips(topology: str) -> int:
    from coder.train.aot import hardware

    return hardware.parse_topology(topology, 1).num_chips
