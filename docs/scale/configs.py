"""The settings behind every report in docs/scale/: model x topology -> mesh, remat, batch.

    python main.py --config=docs/scale/configs.py:deepseek_v3_671b,v5p-512 --config.stage=compile

`get_config("MODEL,TOPOLOGY")` takes configs/MODEL.py unchanged (the architecture) and sets what
a 32k-token training step on that slice needs; docs/scale/regenerate.sh runs every pair and
writes docs/scale/MODEL_TOPOLOGY/report.{json,md}. Only the parallelism table, the batch shape,
remat, the experts' capacity (MOE_CAPACITY_FACTOR) and the engine's shapes change here,
never the architecture.

Layout for the full-size MoE models (why, in numbers, in docs/scale/README.md):
  * every parameter and its optimizer state is sharded over all chips: experts over `expert`
    (32-way) x the embedding dimension over `fsdp` x `sequence` (ZeRO-3 / FSDP, also over the
    sequence-parallel groups, which otherwise would hold copies);
  * attention heads, the dense layers' hidden units and the vocabulary are tensor-parallel over
    the same `expert` axis, so no chip repeats attention or dense work while experts are split;
  * a 32k row is split over `sequence` (queries; keys/values are gathered), which with the head
    split bounds the dense attention's per-chip T x T scores;
  * tokens are split over data x fsdp (x sequence); the micro-batch is one row per
    data x fsdp group, and grad_accum micro-batches make the step's batch.
"""
import importlib

SEQ_LEN = 32768

# (model, topology) -> overrides. Mesh sizes multiply to the slice's chips x num_slices.
MOE_RULES = (
    ("batch", ("data", "fsdp")),
    ("seq", "sequence"),
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

# remat "full": only each block's input is kept for the backward pass (what a 32k step of these
# models needs; the remat=none compiles of the first session needed several times the HBM).
REMAT = "full"

# Each expert takes at most 2x its balanced share of the (token, expert) pairs a chip sees
# (model.moe_capacity_factor; the released models are dropless). XLA:TPU's gradient of the
# dropless grouped matmul (ragged_dot) w.r.t. the expert weights is a masked dense product of
# every local expert with every pair the chip sees: 80% of the step's FLOPs for DeepSeek-V3 on
# v5p-512 (docs/scale/README.md); the capacity buffer costs 2x the routed work instead.
MOE_CAPACITY_FACTOR = 2.0

# The RL engine's programs compiled beside the step (coder.stages.compile.lower_engine): rows
# decoded together, cache slots (a 32k context), tokens per prefill chunk.
ENGINE = dict(engine_batch=8, engine_max_len=SEQ_LEN, engine_prefill_len=1024)

# Heads x query tokens are split over the chips of a slice (expert x sequence), which bounds
# the dense attention's per-chip scores to 1/chips of the T x T x heads total; further slices
# (DCN) are data-parallel, one row each per micro-batch.
def _mesh(slices: int, expert: int = 32) -> dict:
    return dict(data=slices, fsdp=1, expert=expert, tensor=1, sequence=8, num_slices=slices)


# topology -> slices, batch (rows of SEQ_LEN tokens per step), micro-batches, optimizer offload
SETTINGS = {
    "v5p-512": dict(slices=1, batch_size=16, grad_accum=16, offload_optimizer=False),
    # Kimi K2's parameters, gradients and Adam moments (20 bytes per parameter with the gradient
    # accumulator) are 75 GiB per chip over 256 chips. A second slice does not divide them (the
    # slices are data-parallel replicas: 118 GiB per chip); one 512-chip slice with experts and
    # heads over 64 chips does
    "v5p-512x2": dict(slices=2, batch_size=16, grad_accum=8, offload_optimizer=False),
    "v5p-1024": dict(slices=1, batch_size=16, grad_accum=16, offload_optimizer=False, expert=64),
    # 32 GB chips: the f32 parameters, gradient and accumulator alone are 12 bytes per parameter
    # (31 GiB per chip for DeepSeek-V3 over 256 chips), so two slices (512 chips) and the Adam
    # moments in host memory between steps
    "v6e-256x2": dict(slices=2, batch_size=16, grad_accum=8, offload_optimizer=True),
}


def get_config(arg: str = "deepseek_v3_671b,v5p-512"):
    model, setting = arg.split(",")
    c = importlib.import_module(f"configs.{model}").get_config()
    c.stage = "compile"
    c.compile.topology = setting.split("x")[0]  # "v6e-256x2" -> two v6e-256 slices
    c.compile.report_dir = f"docs/scale/{model}_{setting}"
    if model == "quickstart":  # the tiny config: its own mesh (data parallel), bf16 as on TPU
        c.stages = ()
        c.model.dtype = "bfloat16"
        return c
    s = SETTINGS[setting]
    c.mesh.update(_mesh(s["slices"], s.get("expert", 32)))
    c.mesh.rules = MOE_RULES
    c.data.seq_len = SEQ_LEN
    c.data.batch_size = s["batch_size"]
    c.train.grad_accum = s["grad_accum"]
    c.model.remat = REMAT
    c.model.moe_capacity_factor = MOE_CAPACITY_FACTOR
    c.model.scan_layers = True  # one compiled MoE layer (an unrolled 61-layer step: ~45 min here)
    c.compile.offload_optimizer = s["offload_optimizer"]
    c.compile.update(ENGINE)
    return c
