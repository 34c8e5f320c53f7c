"""Composer-2-style asynchronous GRPO of Kimi K2.5 (1.04T total, 32B activated) on a TPU pod.

The recipe of ../shared/seeds/002 (Cursor's Composer 2): start from Kimi K2.5, RL on real coding
tasks, asynchronous, in-flight weight updates, self-summarization chaining generations past the
context window, a nonlinear length penalty, broken tool calls scored below failures. The
architecture is configs/kimi_k2_1t.py's (K2.5's text model is K2's, with a 256k context).

Layout (disaggregated; docs/rl.md section 7, docs/scale): the learner is the multi-host JAX job
of the launcher (e.g. v5p-512, launch/tpu_pod.sh or the learner JobSet of launch/ray_cluster.sh);
`rl.num_actors` actors, each a JAX job of `rl.actor_processes` hosts placed by Ray (one process
per host: a v5p-128 slice is 16 hosts x 4 chips = 6 TB of HBM for 2.05 TB of bf16 weights plus
the KV caches), weights through the store on GCS, each host reading only its own slices; env
workers as Ray actors on CPU nodes that declare the `env_node` resource.

    huggingface-cli download moonshotai/Kimi-K2.5 --local-dir /data/Kimi-K2.5   # or gs://...
    launch/ray_cluster.sh gke -- --config=configs/composer_k2.py \
        --config.init_from=gs://BUCKET/Kimi-K2.5 --config.rl.tasks=gs://BUCKET/tasks/*.jsonl \
        --config.workdir=gs://BUCKET/runs/composer_k2

The importer reads K2.5's checkpoint as shipped: the `kimi_k25` multimodal wrapper (the text
model under `text_config`; the vision tower skipped, logged) and its routed experts in INT4
compressed-tensors (`pack-quantized`, group-wise scales), dequantized on import
(coder/model/hf_import.py). The values below are a starting point, not tuned here: nothing at
this size has run on this project's machines (what has: docs/scale).
"""
from configs.kimi_k2_1t import get_config as kimi_k2_config


def get_config():
    c = kimi_k2_config()
    c.stage = "grpo"
    # c.init_from = "gs://BUCKET/Kimi-K2.5"  # the released weights + tokenizer (docstring)
    m = c.model
    m.max_position_embeddings = 262144  # K2.5: 256k tokens (YaRN 64 x 4096)
    m.rope_scaling.factor = 64.0

    rl = c.rl
    rl.tasks = "gs://BUCKET/tasks/train-*.jsonl"  # real repositories' tasks (coder.env.tasks JSONL)
    rl.eval_tasks = "gs://BUCKET/tasks/heldout-*.jsonl"
    rl.group_size = 8  # G rollouts per task
    rl.tasks_per_step = 64  # B: 512 rollouts per learner step
    rl.context_budget = 262144  # one generation's context: the model's window
    rl.summary_reserve = 8192  # room for the summary request and the model's summary
    rl.max_summaries = 4  # hard tasks summarize several times (seed 002)
    rl.max_turns = 96  # assistant turns over the whole summary chain
    rl.max_turn_tokens = 16384
    rl.max_rollout_tokens = 262144  # policy tokens over the chain
    rl.tool_timeout_s = 300.0
    # every env tool but semantic_search: its default encoder is the policy itself, which env
    # workers cannot hold at 1T (coder.infer.embedding refuses it); install an encoder, set
    # env.semantic_encoder to its 'package.module:factory' and add the tool to offer it
    rl.tools = ("shell", "read_file", "write_file", "edit_file", "grep", "search", "lint", "diagnostics",
                "run_tests", "repo_history", "memory_write", "memory_read", "think", "ask_user", "submit")
    rl.engine_dtype = "bfloat16"
    rl.engine_slots = 256  # rows one actor decodes together (32 groups)
    rl.decode_steps = 32
    rl.eval_num_tasks = 64
    rl.eval_samples = 4
    rl.num_actors = 4  # actor slices
    rl.actor_processes = 16  # hosts per actor: a v5p-128 slice
    rl.actor_timeout_s = 300.0
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

    g = c.grpo
    g["async"] = True  # in-flight weight updates: actors run ahead of the learner
    g.max_staleness = 2  # tokens more than 2 versions old carry no loss
    g.tis_cap = 2.0
    g.lr = 1e-6
    g.steps = 1000
    g.kl_coef = 0.0
    g.router_replay = True  # the learner routes as the bf16 engine did
    g.eval_every = 50
    g.ckpt_every = 10

    c.env.workers_backend = "ray"  # sandboxes on CPU nodes, not the accelerator hosts
    c.env.ray_resource = "env_node"
    c.env.ray_num_cpus_per_worker = 2.0
    return c
