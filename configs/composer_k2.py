"""Composer 2's recipe on Kimi K2.5 (1.04T total, 32B activated), the whole chain, on a TPU pod.

The recipe of ../shared/seeds/002 (Cursor's Composer 2), stage by stage (`stages`):
  pretrain  continued pretraining at 32k tokens a row on a code-heavy mixture (data.sources);
  longctx   the long-context extension to 256k (YaRN 64 over K2's original 4096: K2.5's window);
  mtp       MTP layers trained from scratch by self-distillation (trunk frozen): the drafts of
            speculative decoding in the actors and in serve (rl.speculative_k, serve.speculative_k);
  sft       a short SFT on agent transcripts at 128k;
  grpo      asynchronous single-epoch GRPO on real repositories' tasks with self-summarization
            chains, in-flight weight updates through the store, router replay.
The architecture is configs/kimi_k2_1t.py's (K2.5's text model is K2's, with a 256k window) plus
`model.num_mtp_layers = rl.speculative_k` fresh MTP modules.

Plan it first (compiles every program of every stage for its TPU layout on this CPU, runs nothing):

    python main.py --config=configs/composer_k2.py --config.plan=True --config.workdir=/tmp/plan_k2

It writes plan.json / plan.md (chips, step seconds, tokens/s, hours per stage; the actor slices
that keep the learner fed, the weight sync against the learner's step, the slots that fit).
What the plan measured is in docs/scale/README.md ("Plans") and docs/scale/composer_k2/plan.md
(aaccc5d, the whole chain planned in 47 minutes on a 2-core CPU; 225 h, 179k chip-hours): every
program of every stage fits on 2 x v5p-512 (the learner) and a v5p-256 actor (the engine at 256
rows of 256k, 2 drafts: decode 0.179 s a step, 76.0 GiB a chip); the values marked "plan:" come
from it, the ones marked "guess" do not.

Layout (docs/scale/README.md, configs/pod_layout.py): the learner's stages run on 2 x v5p-512
(512 chips: the float32 parameters and Adam moments split over both slices, experts 32-way x
FSDP 8-way in a slice); `rl.topology.actors` actors, each a JAX job of `rl.topology.actor_processes` hosts on a
v5p-256 slice (128 chips, 32 hosts) with the engine laid out as DeepSeek-V3 serves (experts over
all 128 chips, attention data-parallel, rows and their MLA caches over the chips), placed by Ray;
weights through the store on GCS, each host reading only its own slices; env workers as Ray
actors on CPU nodes that declare the `env_node` resource.

    huggingface-cli download moonshotai/Kimi-K2.5 --local-dir /data/Kimi-K2.5   # or gs://...
    launch/ray_cluster.sh gke -- --config=configs/composer_k2.py \
        --config.init_from=gs://BUCKET/Kimi-K2.5 --config.rl.tasks=gs://BUCKET/tasks/*.jsonl \
        --config.workdir=gs://BUCKET/runs/composer_k2

The importer reads K2.5's checkpoint as shipped: the `kimi_k25` multimodal wrapper (the text
model under `text_config`; the vision tower skipped, logged) and its routed experts in INT4
compressed-tensors (`pack-quantized`, group-wise scales), dequantized on import
(coder/model/hf_import.py). Step counts and learning rates are the seed's shape with guessed
sizes (marked "guess"): nothing at this size has run on this project's machines.
"""
from configs import pod_layout
from configs.kimi_k2_1t import get_config as kimi_k2_config

LEARNER_TOPOLOGY, LEARNER_SLICES = "v5p-512", 2
ACTOR_TOPOLOGY, ACTOR_CHIPS, ACTOR_HOSTS = "v5p-256", 128, 32


def get_config():
    return recipe(kimi_k2_config(), draft_depth=2)


def recipe(c, *, draft_depth: int):
    """The chain (module docstring) over `c`, a full-size MoE model's config (Kimi K2 here,
    DeepSeek-V3 in configs/composer_dsv3.py), decoding with `draft_depth` MTP drafts."""
    c.stage = ""
    c.stages = ("pretrain", "longctx", "mtp", "sft", "grpo")
    # c.init_from = "gs://BUCKET/Kimi-K2.5"  # the released weights + tokenizer (docstring)
    m = c.model
    m.max_position_embeddings = 262144  # K2.5: 256k tokens (YaRN 64 x 4096; the longctx stage derives the same)
    m.rope_scaling.factor = 64.0
    m.num_mtp_layers = draft_depth  # = rl.speculative_k: one MTP module per drafted token (fresh: K2.5 ships none)
    pod_layout.apply(c, slices=LEARNER_SLICES, params_over_data=True, reduce_grads_once=True)
    c.compile.topology = LEARNER_TOPOLOGY  # the plan's learner pod (x mesh.num_slices)
    c.mesh.num_slices = LEARNER_SLICES
    # MTP modules are trained by the mtp stage alone (from scratch, seed 002): no MTP loss before it
    c.train.mtp_loss_weight = 0.0

    # pretrain: continued pretraining at 32k. 128 rows x 32k = 4.2M tokens a step in 4
    # micro-batches of 16 rows per slice (docs/scale/kimi_k2_1t_v5p-512x2); 12k steps = 50B
    # tokens (guess); lr 2e-5 continues a released model without undoing it (guess)
    c.data.seq_len = 32768
    c.data.batch_size = 128
    c.train.grad_accum = 4
    c.train.steps = 12000
    c.train.lr = 2e-5
    c.train.warmup_steps = 200
    c.train.ckpt_every = 250

    # longctx: 256k rows, 16 a step (the same 4.2M tokens), one row per slice per micro-batch,
    # remat full (docs/scale/kimi_k2_1t_v5p-512x2_long256k); 1500 steps = 6.3B tokens (guess)
    lc = c.longctx
    lc.seq_len = 262144
    lc.batch_size = 16
    lc.grad_accum = 8
    lc.remat = "full"
    lc.steps = 1500
    lc.lr = 1e-5

    # mtp: the modules distil the frozen trunk at 32k (pretrain's rows); 2000 steps (guess)
    c.mtp.steps = 2000
    c.mtp.lr = 3e-4
    c.mtp.fresh = True

    # sft: 128k rows of agent transcripts, 32 a step in 8 micro-batches (2 rows per slice each:
    # docs/scale/kimi_k2_1t_v5p-512x2_long128k); 500 steps = 2.1B tokens (a short SFT; guess)
    c.sft.data = "gs://BUCKET/sft/*.jsonl"  # agent transcripts (coder.data.sft conversations JSONL)
    c.sft.seq_len = 131072
    c.sft.batch_size = 32
    c.sft.grad_accum = 8
    c.sft.steps = 500
    c.sft.lr = 5e-6

    rl = c.rl
    rl.tasks = "gs://BUCKET/tasks/train-*.jsonl"  # real repositories' tasks (coder.env.tasks JSONL)
    rl.eval_tasks = "gs://BUCKET/tasks/heldout-*.jsonl"
    rl.group_size = 8  # G rollouts per task
    # B: 16 tasks = 128 rollouts a step. The learner makes one row per generation, padded to the
    # longest generation's bucket (coder.rl.learner.Learner.batch), so a step trains 128 rows of
    # 256k whatever the rollouts' real lengths (plan: the GRPO step below); more rollouts a step
    # cost the learner in proportion
    rl.tasks_per_step = 16
    rl.context_budget = 262144  # one generation's context: the model's window
    rl.summary_reserve = 8192  # room for the summary request and the model's summary
    rl.max_summaries = 4  # hard tasks summarize several times (seed 002)
    rl.max_turns = 96  # assistant turns over the whole summary chain
    rl.max_turn_tokens = 16384
    # policy tokens over the chain at most; a rollout's rows hold compile.rollout_tokens in all
    # (guess: 64k tokens of prompt, files read and tool outputs around 32k sampled)
    rl.max_rollout_tokens = 32768
    c.compile.rollout_tokens = 65536
    rl.tool_timeout_s = 300.0
    # every env tool but semantic_search: its default encoder is the policy itself, which env
    # workers cannot hold at 1T (coder.infer.embedding refuses it); install an encoder, set
    # env.semantic_encoder to its 'package.module:factory' and add the tool to offer it
    rl.tools = ("shell", "read_file", "write_file", "edit_file", "grep", "search", "lint", "diagnostics",
                "run_tests", "repo_history", "memory_write", "memory_read", "think", "ask_user", "submit")
    pod_layout.actor_engine(c, actor_chips=ACTOR_CHIPS)
    rl.speculative_k = draft_depth  # MTP drafts a decode step (seed 002: 2-3x faster inference)
    # rows one actor decodes together, 2 per chip. plan: 384 fit K2's decode (93.8 GiB a chip), 256
    # take 76.0 and leave room for the group copy beside the weights (82.3 GiB); DeepSeek-V3: 256 fit
    rl.engine_slots = 256
    rl.decode_steps = 32
    rl.eval_num_tasks = 64
    rl.eval_samples = 4
    rl.topology.actors = 4  # actor slices (plan: actor_slices_per_learner, 4 for K2.5 and for DeepSeek-V3)
    rl.topology.actor_processes = ACTOR_HOSTS  # hosts per actor: a v5p-256 slice
    c.compile.engine_topology = ACTOR_TOPOLOGY
    c.compile.engine_prefill_len = 256  # tokens a row per prefill chunk (1024 x 128 rows needed 117 GiB)
    rl.topology.actor_timeout_s = 300.0
    rl.env_workers = 256  # sandboxes per actor, one per decoding row
    rl.weight_store = ""  # {workdir}/grpo/weights: on GCS with a gs:// workdir
    rl.anchor_every = 10
    rl.broken_call_penalty = 0.1  # a broken tool call scores below a failure (seed 002)
    # The final message says what changed and why (coder/rl/communication.py: -1 / 0 / +1). At
    # 0.05 a clear final is worth 0.1 over an empty one: half the length penalty's ceiling
    # (max_penalty 0.2) and a tenth of a solved task, so it never turns a failure into a win but
    # decides between correct rollouts of like length; a ~50-token summary costs far less on these
    # tasks (cost in the thousands: at most 0.2 * 50 / scale_hard 2048 = 0.005). Small because
    # the rules are easy to satisfy without meaning it (name a file, write "because"): a reward
    # model registered with coder.rl.reward.communication_scorer may take its place.
    rl.aux_rewards.communication = 0.05
    # Style: minus each lint diagnostic the change adds (ruff on the edited files, before the
    # first and after the last action). At 0.01 ten new findings cost 0.1, what a clear final
    # message earns: a correct but sloppy patch still beats a failure, and among correct
    # rollouts of like length the cleaner one wins (style is among the auxiliary rewards the
    # seeds describe).
    rl.aux_rewards.lint_introduced = 0.01
    # Clarifying questions (the `ask_user` tool: a simulated user answers from the task's hidden
    # specification when the prompt was underspecified): each question a task did not need costs
    # 0.05, what a clear final message earns, so asking to dodge a risky edit never pays, while
    # the one question an underspecified task needs is free and its answer lets the outcome pay.
    rl.aux_rewards.clarification = 0.05

    rl.topology.asynchronous = True  # in-flight weight updates: actors run ahead of the learner
    g = c.grpo
    # tokens more than 8 versions old carry no loss (TIS corrects the rest). plan (docs/scale,
    # "Plans"): a rollout's 32k sampled tokens take ~1 h on an actor (0.179 s a decode step at 256
    # rows of 256k, 2.19 tokens a step with 2 drafts) while the learner steps every ~450 s, so
    # its first tokens are 8 versions old when it trains; at 2 most of every rollout was dropped
    g.max_staleness = 8
    g.tis_cap = 2.0
    g.lr = 1e-6
    g.steps = 1000
    g.kl_coef = 0.0
    g.router_replay = True  # the learner routes as the bf16 engine did
    g.eval_every = 50
    g.ckpt_every = 10
    # the learner's step: 128 rows of 256k (one per rollout) in 64 micro-batches of one row per
    # slice, remat full, as the longctx stage
    g.grad_accum = 64
    g.remat = "full"
    # plan: on the chips the step needed 97.6 of 95.0 GiB (K2); the Adam moments wait in pinned
    # host memory between steps (train.offload_optimizer), as DeepSeek-V3's 256k pretraining does
    g.offload_optimizer = True
    c.compile.grpo_batch = 128
    c.compile.grpo_seq_len = 262144

    c.serve.speculative_k = draft_depth  # serve decodes with the same drafts
    c.env.workers_backend = "ray"  # sandboxes on CPU nodes, not the accelerator hosts
    c.env.ray_resource = "env_node"
    c.env.ray_num_cpus_per_worker = 2.0
    return c
