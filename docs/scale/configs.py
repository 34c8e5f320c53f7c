"""The settings behind every report in docs/scale/: model x topology -> mesh, remat, batch.

    python main.py --config=docs/scale/configs.py:deepseek_v3_671b,v5p-512 --config.stage=compile

`get_config("MODEL,TOPOLOGY")` takes configs/MODEL.py unchanged (the architecture) and sets what
a 32k-token training step on that slice needs; docs/scale/regenerate.sh runs every pair and
writes docs/scale/MODEL_TOPOLOGY/report.{json,md}. Only the parallelism table, the batch shape,
remat and the engine's shapes change here, never the model.

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

# The RL engine's programs compiled beside the step (coder.train.compile.lower_engine): rows
# decoded together, cache slots (a 32k context), tokens per prefill chunk.
ENGINE = dict(engine_batch=8, engine_max_len=SEQ_LEN, engine_prefill_len=1024)

# Heads x query tokens are split over all 256 chips (expert x sequence), which bounds the dense
# attention's per-chip scores to 1/256 of the T x T x heads total.
MESH = dict(data=1, fsdp=1, expert=32, tensor=1, sequence=8, num_slices=1)

SETTINGS = {
    "v5p-512": dict(mesh=MESH, batch_size=16, grad_accum=16, offload_optimizer=False),
    # 32 GB chips: the Adam moments of a 671B / 1T model (8 / 12 bytes per parameter over 256
    # chips) alone exceed the HBM, so they live in host memory between steps
    "v6e-256": dict(mesh=MESH, batch_size=16, grad_accum=16, offload_optimizer=True),
}


def get_config(arg: str = "deepseek_v3_671b,v5p-512"):
    model, topology = arg.split(",")
    c = importlib.import_module(f"configs.{model}").get_config()
    c.stage = "compile"
    c.compile.topology = topology
    c.compile.report_dir = f"docs/scale/{model}_{topology}"
    if model == "quickstart":  # the tiny config: its own mesh (data parallel), bf16 as on TPU
        c.stages = ()
        c.model.dtype = "bfloat16"
        return c
    s = SETTINGS[topology]
    c.mesh.update(s["mesh"])
    c.mesh.rules = MOE_RULES
    c.data.seq_len = SEQ_LEN
    c.data.batch_size = s["batch_size"]
    c.train.grad_accum = s["grad_accum"]
    c.model.remat = REMAT
    c.model.scan_layers = True  # one compiled MoE layer (an unrolled 61-layer step: ~45 min here)
    c.compile.offload_optimizer = s["offload_optimizer"]
    c.compile.update(ENGINE)
    return c
