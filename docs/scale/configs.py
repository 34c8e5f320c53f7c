"""The settings behind every report in docs/scale/: model x topology -> mesh, remat, batch.

    python main.py --config=docs/scale/configs.py:deepseek_v3_671b,v5p-512 --config.stage=compile

`get_config("MODEL,TOPOLOGY")` takes configs/MODEL.py unchanged (the architecture) and sets what
a 32k-token training step on that slice needs; docs/scale/regenerate.sh runs every pair and
writes docs/scale/MODEL_TOPOLOGY/report.{json,md}. Only the parallelism table, the batch shape
and remat change here, never the model.

Layout for the full-size MoE models (why, in numbers, in docs/scale/README.md):
  * every parameter and its optimizer state is sharded over all chips: experts over `expert`
    (32-way) x the embedding dimension over `fsdp` x `sequence` (ZeRO-3 / FSDP, also over the
    sequence-parallel groups, which otherwise would hold copies);
  * attention heads, the dense layers' hidden units and the vocabulary are tensor-parallel over
    the same `expert` axis, so no chip repeats attention or dense work while experts are split;
  * a 32k row is split over `sequence` (queries; keys/values are gathered), which with the head
    split bounds the dense attention's per-chip T x T scores;
  * tokens are split over data x fsdp (x sequence); the micro-batch is one row per
    data x fsdp group, and grad_accum micro-batches make the step's batch;
  * remat=full keeps only each block's input between the forward and backward passes.
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

SETTINGS = {
    "v5p-512": dict(mesh=dict(data=1, fsdp=4, expert=32, tensor=1, sequence=2, num_slices=1),
                    batch_size=64, grad_accum=16, remat="full", offload_optimizer=False),
    "v6e-256": dict(mesh=dict(data=1, fsdp=4, expert=32, tensor=1, sequence=2, num_slices=1),
                    batch_size=64, grad_accum=16, remat="full", offload_optimizer=True),
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
    c.model.remat = s["remat"]
    c.compile.offload_optimizer = s["offload_optimizer"]
    return c
