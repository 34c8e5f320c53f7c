"""Every configuration key of coder, with its default and what it does.

Named configs (quickstart.py, deepseek_v3_671b.py, ...) start from `get_config()` here and
override what they need. Command-line overrides: `--config.train.lr=1e-4`. The config returned
is locked: a key that is not defined here cannot be set anywhere, in a named config or on the
command line (ml_collections raises naming the key and the keys that exist), so this file is the
schema. Only `rl.aux_rewards` and `realtime.signals` stay open: their names are checked against
the registries of coder/rl/reward.py and coder/rl/realtime.py when the grpo / realtime stage is
validated.

Sections are owned by the part of the code that reads them:
  model -> coder/model, mesh -> coder/model/sharding.py, data -> coder/data,
  train -> coder/train, longctx/sft/mtp/grpo/eval/compile/serve/realtime -> the stage of that name.
"""
import ml_collections

from coder.model.config import default_rules, model_config  # noqa: F401  (re-exported)


# Keys that moved, old name -> new (main.py names the new one when a config file or an override sets an old one).
MOVED = {
    "rl.num_actors": "rl.topology.actors",
    "rl.actor_processes": "rl.topology.actor_processes",
    "rl.colocated": "rl.topology.colocated",
    "rl.offload_optimizer": "rl.topology.offload_optimizer",
    "rl.actor_timeout_s": "rl.topology.actor_timeout_s",
    "rl.ray_address": "rl.topology.ray_address",
    "grpo.async": "rl.topology.asynchronous",
}


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.stage = ""  # one stage of coder/stages/__init__.py (set this or `stages`, not both)
    c.stages = ()  # several stages run in order, each starting from the previous checkpoint
    c.workdir = "runs/default"  # run directory: {workdir}/{stage}/ holds checkpoints + metrics
    c.seed = 0  # every random key derives from this and the step
    # checkpoint directory to take params from (fresh optimizer): a coder checkpoint, or a Hugging
    # Face DeepSeek-V3 / Kimi-K2 directory (config.json + safetensors, local or gs://), whose
    # config.json sets the model's architecture and whose tokenizer the stage uses
    c.init_from = ""
    # True: compile (never run) every program of every chosen stage for compile.topology's TPU
    # slice in the layout the runtime builds, and write {workdir}/plan/plan.{json,md} with each
    # stage's chips, step time, tokens/s and hours (coder/stages/plan.py)
    c.plan = False

    c.model = model_config()

    # Device mesh: the product of the axes must equal the device count; -1 = all remaining.
    c.mesh = ml_collections.ConfigDict(
        dict(data=-1, fsdp=1, expert=1, tensor=1, sequence=1, num_slices=1)
    )
    # Logical axis name -> mesh axes (coder/model/config.py). Changing parallelism is a
    # change of this table.
    c.mesh.rules = default_rules()

    # Input data (coder/data).
    c.data = ml_collections.ConfigDict()
    c.data.sources = ()  # tuple of dicts: path (glob or fsspec URL), weight, format, text_field
    c.data.corpus = "python_stdlib"  # bundled corpus used when sources is empty
    # sentencepiece .model, or a pretrained tokenizer (a tokenizer.json / tiktoken.model file or a
    # directory holding one); "" = train one from the corpus, cached (a checkpoint's wins: its own)
    c.data.tokenizer = ""
    # The chat / tool template's special tokens as strings of a pretrained (Hugging Face /
    # tiktoken) tokenizer, by name: a string the base tokenizer has as a special token is used
    # (e.g. --config.data.chat_tokens.user='<｜User｜>'), a missing one is added as a new token
    # (the embedding and output head grow; new rows = mean of the checkpoint's). Defaults:
    # coder's own tokens (coder.data.chat_template.SPECIAL_TOKENS). Read when a stage starts from a
    # Hugging Face checkpoint; later stages take the tokenizer stored in the checkpoint.
    c.data.chat_tokens = ml_collections.ConfigDict(dict(
        system="<|system|>", user="<|user|>", assistant="<|assistant|>", tool="<|tool|>",
        end="<|end|>", tool_call="<tool_call>", tool_call_end="</tool_call>",
        tool_result="<tool_result>", tool_result_end="</tool_result>", summary="<summary>",
        summary_end="</summary>"))
    c.data.tiktoken_pattern = ""  # pre-tokenizer regex of a tiktoken.model tokenizer ("" = Kimi K2's)
    c.data.tokenizer_vocab_size = 4096  # vocabulary of a tokenizer trained by coder
    # a tokenizer trained by coder also learns the agent's format: the toy transcripts' system
    # prompt and replies (rl.tools, sft.toy_*), each tool call's fixed text one piece
    c.data.tokenizer_agent_text = False
    c.data.seq_len = 256  # packed row length
    c.data.batch_size = 8  # global batch (rows), split over data-parallel hosts
    c.data.max_bad_fraction = 0.01  # fail if more than this fraction of records is bad
    c.data.bad_check_min_records = 1000  # records of a source read before the bad check applies
    c.data.heldout_fraction = 0.05  # documents kept out of training for eval
    c.data.num_workers = 0  # grain worker processes (0 = in-process)
    # Repository-length documents (coder/data/repo_docs.py): globs (local or fsspec URLs) of
    # repository directories, each one document of its .py files in dependency order; a
    # data.heldout_fraction of them (at least one of two or more) is held out for the long eval.
    c.data.repos = ()
    # their mixture weight beside the short sources' (the corpus's is 1): a share of documents,
    # not tokens; 0 = not read (the long eval still uses the held-out ones)
    c.data.repo_weight = 0.0
    # > 0: a repository is cut at file boundaries into documents of at most this many characters
    # (its files still in dependency order), so they shuffle apart (coder.data.repo_docs.RepoSource)
    c.data.repo_part_chars = 0
    # Held-out code kept out of pretraining and SFT data (coder/data/decontaminate.py): a training
    # document sharing >= exclude_min_matches distinct runs of exclude_ngram words with the code
    # of these tasks is left out (data/heldout_dropped counts them). "eval" = rl.eval_tasks' tasks
    # (nothing for "toy"), "" = off, or a Task JSONL path/glob; each task's repository counts as
    # a whole (every version it holds)
    c.data.exclude_tasks = "eval"
    c.data.exclude_ngram = 13
    c.data.exclude_min_matches = 20

    # Optimisation and the training loop (coder/train).
    c.train = ml_collections.ConfigDict()
    c.train.steps = 100  # optimizer steps of this stage
    c.train.optimizer = "adamw"  # "adamw" | "muon"
    c.train.lr = 3e-3  # peak learning rate
    c.train.warmup_steps = 10  # linear warmup
    c.train.min_lr_ratio = 0.1  # cosine decays to lr * min_lr_ratio
    c.train.b1 = 0.9  # Adam beta1
    c.train.b2 = 0.95  # Adam beta2
    c.train.weight_decay = 0.1  # decoupled weight decay
    c.train.grad_clip = 1.0  # global-norm gradient clipping (0 = off)
    # dtype of the optimizer's first moment (Adam's m, Muon's momentum): "float32" | "bfloat16"
    # (DeepSeek-V3 keeps its AdamW moments in bf16: a quarter less optimizer memory here)
    c.train.mu_dtype = "float32"
    c.train.grad_accum = 1  # micro-batches per optimizer step
    # dtype of the micro-batch gradient sum: "float32" | "bfloat16" (half the accumulator's
    # memory, a parameter-sized buffer; each micro-batch's gradient is rounded once when added)
    c.train.grad_accum_dtype = "float32"
    # also shard the optimizer moments over the `data` mesh axis (ZeRO-1 across data-parallel
    # replicas, e.g. TPU slices over DCN): each replica updates its share of the parameters and
    # the new parameters are all-gathered over `data` once per step
    c.train.optimizer_over_data = False
    # also shard the float32 parameters over `data` (with their optimizer moments): each step
    # gathers the copy the micro-batches differentiate over `data` once, before the loop, in
    # model.dtype with cast_params_once (half the bytes across DCN of ZeRO-1's float32 gather
    # after the update, and half the float32 parameter memory per chip)
    c.train.params_over_data = False
    # sum each data-parallel replica's micro-batch gradients on its own devices and reduce them
    # over `data` once per step (else once per micro-batch inside the accumulation loop: across
    # DCN when replicas are TPU slices); parameters must not be sharded over `data`
    c.train.reduce_grads_once = False
    # cast the matrices the model multiplies in model.dtype to it once per step, before the
    # micro-batch loop, and take gradients w.r.t. that copy: weight gathers, gradient reductions
    # and the gradient sum move model.dtype (no per-micro-batch float32 round trip); costs a
    # model.dtype copy of those parameters
    c.train.cast_params_once = False
    # keep the optimizer state in pinned host memory between steps: each step moves it to the
    # devices for the update and back (its HBM is free while the forward and backward run, at the
    # cost of two host <-> device copies of it per step; stage compile's reports say which)
    c.train.offload_optimizer = False
    c.train.mtp_loss_weight = 0.3  # weight of the MTP cross-entropy in the loss
    # the LM losses' output head in this many parts of each row's tokens, forward and backward
    # (coder.train.losses.chunked_cross_entropy_sum): at most [rows, T / loss_chunks, vocab]
    # float32 logits live at once; 1 = the whole logits
    c.train.loss_chunks = 1
    c.train.z_loss_weight = 0.0  # router z-loss weight (0 = off)
    c.train.max_nonfinite_steps = 5  # this many NaN/Inf steps in a row stop the run
    c.train.log_every = 10  # steps between metric lines
    c.train.heldout_batches = 4  # held-out batches an LM stage scores before and after training (0 = off)
    c.train.ckpt_every = 50  # steps between checkpoints (and always at the end)
    c.train.keep_checkpoints = 3  # checkpoints kept on disk
    c.train.peak_flops = 0.0  # per-device peak FLOP/s for MFU (0 = TPU table, else a measured matmul)

    # Long-context extension (coder/stages/lm.py): continue pretraining at a longer
    # seq_len with YaRN; factor = seq_len / the checkpoint's context, derived, not set.
    c.longctx = ml_collections.ConfigDict()
    c.longctx.seq_len = 1024  # packed row length of this stage
    c.longctx.steps = 100  # optimizer steps of this stage
    c.longctx.lr = 1e-3  # peak learning rate of this stage
    c.longctx.batch_size = 0  # rows per step (0 = same tokens per step as data.batch_size x seq_len)
    c.longctx.repo_weight = 0.0  # data.repo_weight of this stage (0 = data.repo_weight)
    c.longctx.grad_accum = 0  # micro-batches per step of this stage (0 = train.grad_accum)
    c.longctx.remat = ""  # model.remat of this stage ("" = model.remat): longer rows keep less

    # Supervised fine-tuning on conversations (coder/stages/lm.py).
    c.sft = ml_collections.ConfigDict()
    c.sft.data = ""  # conversations JSONL (path/glob/URL); "" = transcripts of the env's toy tasks
    c.sft.toy_tasks = 24  # toy tasks transcribed (real tool runs) when sft.data is ""
    c.sft.toy_edit_tool = "edit_file"  # how those transcripts fix a file: "edit_file" (old -> new) or "write_file" (whole)
    c.sft.steps = 100  # optimizer steps of this stage
    c.sft.lr = 1e-3  # peak learning rate of this stage
    c.sft.seq_len = 0  # packed row length (0 = data.seq_len)
    c.sft.batch_size = 0  # rows per step (0 = data.batch_size)
    c.sft.grad_accum = 0  # micro-batches per step (0 = train.grad_accum)
    c.sft.remat = ""  # model.remat of this stage ("" = model.remat)

    # Evaluation stage (coder/stages/lm.py): held-out loss / perplexity, agent pass@k.
    c.eval = ml_collections.ConfigDict()
    c.eval.batches = 16  # held-out batches of data.batch_size rows (0 = the whole held-out split)
    c.eval.agent_tasks = 0  # > 0: also run coder.rl.eval.run_agent_eval on this many tasks
    # The long-context eval (coder/train/long_eval.py) on the held-out repositories of data.repos,
    # run by stage eval and before / after stage longctx (at longctx.seq_len)
    c.eval.long_len = 0  # tokens per row (0 = model.max_position_embeddings)
    c.eval.long_rows = 8  # rows scored for the loss by position bucket (0 = off)
    c.eval.long_buckets = 4  # equal position buckets over long_len
    c.eval.retrieval_examples = 8  # far-retrieval rows, each scored with and without its callees (0 = off)

    # Agent rollouts and rewards (coder/rl/agent.py, actor.py, reward.py, eval.py).
    c.rl = ml_collections.ConfigDict()
    c.rl.tasks = "toy"  # task source: "toy" (coder.env toy tasks) or a Task JSONL path/glob
    c.rl.eval_tasks = "toy"  # held-out tasks of the agent eval: "toy" or a Task JSONL path/glob
    c.rl.group_size = 4  # G: rollouts per task
    # GRPO's training tasks: the first rl.train_num_tasks of rl.tasks (0 = all), rl.epochs passes
    # over them (each pass in its own seeded order); rl.eval_trained: the agent eval also runs on
    # those tasks before the first step and after the last ({stage_dir}/agent_eval_trained/), the
    # measure of learning where the held-out tasks cannot move (a model too small to generalise)
    c.rl.train_num_tasks = 0
    c.rl.epochs = 1
    c.rl.eval_trained = False
    c.rl.speculative_k = 0  # the engine drafts this many tokens per step with the MTP modules (<= model.num_mtp_layers)
    # The rollout engine (coder/infer/engine.py): continuous batching over a pool of cache slots.
    c.rl.engine_slots = 0  # rows decoded together at most (0 = tasks_per_step * group_size)
    # slots a released row's KV stays in as a cached prefix (a self-summary window's next one starts
    # from its system prompt and task; new weights flush them): -1 = every slot but one, 0 = none
    c.rl.prefix_cache_slots = -1
    # rows waiting on tools move their KV cache to host memory when other rows need the slot, and
    # come back before they decode (same tokens; more rollouts open than slots; one-process
    # engines only: coder/infer/engine.py). Serving needs none: a request's rows close with it.
    c.rl.offload_idle_rows = False
    c.rl.decode_steps = 16  # decode steps per host call, run on device in one lax.while_loop
    c.rl.engine_dtype = ""  # serving weights' dtype ("" = model.dtype; "bfloat16": bf16 engine, f32 learner)
    # weights the engine holds quantized (coder/infer/quantize.py; weight-only, the learner keeps
    # its masters): "" none, "int8" / "fp8" every matmul weight, "int8_experts" / "int4_experts" the
    # routed experts only (read narrow on TPU by coder/pallas/quantized_matmul.py)
    c.rl.engine_quantization = ""
    # The engine's model-parallel axes (coder.rl.actor.engine_mesh; 0 = the training mesh's): an
    # actor's slice is often smaller than the learner's, so its engine splits the weights its own
    # way (e.g. expert=64 on a 64-chip actor slice beside a learner with expert 32 x sequence 8);
    # rows go over the remaining devices. Used by the RL actors, stage serve and realtime.
    c.rl.engine_mesh = ml_collections.ConfigDict(dict(expert=0, tensor=0, sequence=0))
    # "training": the engine places weights and caches by mesh.rules; "data_parallel": rows
    # split over the expert axes too, each chip caching and attending its own rows with the
    # non-expert weights whole, experts reached by all-to-all (DeepSeek-V3's serving layout;
    # coder.model.sharding.data_parallel_attention). MLA's cache has no head axis to split.
    c.rl.engine_attention = "training"
    c.rl.concurrent = True  # the actor runs all B x G rollouts at once (False: group by group)
    c.rl.env_workers = 0  # env worker processes running the sandboxes' tool calls (0 = one per rollout, at most 16)
    # GRPO's deployment, one value (coder/rl/topology.py: Topology.from_config reads this section and
    # names the kind it makes: in-process, colocated, Ray actors, Ray actor groups). 0 actors = one
    # inside the learner's process (no Ray start-up, no second JAX runtime: tests, quickstart, one
    # small machine).
    c.rl.topology = ml_collections.ConfigDict(
        dict(
            actors=0,  # actor processes (Ray actors, each an engine + env workers); 0 = in the learner's process
            actor_processes=1,  # processes of one Ray actor (>1: one JAX job spanning them, e.g. the hosts of a slice)
            colocated=False,  # sync, actor in the learner's process: weights reach its engine on device (no store)
            offload_optimizer=False,  # colocated: the optimizer state waits in host memory while the actor rolls out
            # True: actors run ahead of the learner (<= grpo.max_staleness versions); False: lockstep, reproducible
            asynchronous=False,
            actor_timeout_s=120.0,  # a member of a multi-process actor silent this long breaks its group (restarted)
            ray_address="",  # Ray cluster of the actors ("" = a local Ray instance; "HOST:6379" or "ray://HOST:10001")
        )
    )
    # an actor that cannot get the weights it needs for this long stops the run with an error naming the
    # store, the version and the leaf: its first version, the version a group waits for, or a store whose
    # reads keep failing (a corrupt leaf, a missing version); never a hang, never a rollout on old weights
    c.rl.weight_timeout_s = 600.0
    c.rl.weight_store = ""  # URL of the weight store the learner publishes to ("" = {stage_dir}/weights; gs://...)
    c.rl.anchor_every = 10  # the store writes every this many versions in full (the others as XOR deltas)
    c.rl.tasks_per_step = 2  # B: tasks per optimizer step (each task used once: single epoch)
    c.rl.temperature = 1.0  # sampling temperature (the learner's logprobs use the same one)
    c.rl.top_p = 1.0  # nucleus sampling (1 = off)
    c.rl.top_k = 0  # top-k sampling (0 = off)
    c.rl.tools = ("read_file", "write_file", "edit_file", "run_tests", "submit")  # () = all env tools
    c.rl.system_prompt = ""  # preamble of the system prompt ("" = coder.env.protocol's default)
    c.rl.max_turns = 8  # assistant turns per rollout, over the whole summary chain
    c.rl.max_turn_tokens = 192  # tokens one assistant turn may sample
    c.rl.max_rollout_tokens = 1024  # policy tokens per rollout over the whole chain
    c.rl.context_budget = 1024  # tokens one generation's context may hold (the system prompt with
    # the default tools is ~650 tokens with the default tokenizer; <= model.max_position_embeddings)
    c.rl.summary_reserve = 128  # tokens kept free for the summary request and the summary
    c.rl.max_summaries = 2  # self-summaries per rollout before it is cut off
    c.rl.tool_timeout_s = 20.0  # wall-clock limit of one tool call in the sandbox
    c.rl.length_penalty = ml_collections.ConfigDict(
        dict(
            max_penalty=0.2,  # the saturating penalty's ceiling (< 1: correctness dominates)
            scale_easy=64.0,  # cost scale of a task every rollout solves (steep curve)
            scale_hard=2048.0,  # cost scale of a task no rollout solves (flat curve)
            weights=dict(thinking=1.0, tool_io=0.25, output=1.0, tool_call=8.0, turn=16.0),
        )
    )  # see coder/rl/reward.py for the curve
    c.rl.broken_call_penalty = 0.1  # a rollout with a broken tool call scores this below a failure
    c.rl.aux_rewards = ml_collections.ConfigDict(
        dict(lint_introduced=0.0, unanswered_question=0.0, communication=0.0, clarification=0.0)
    )  # auxiliary reward name -> weight (0 = off); registry in coder/rl/reward.py
    c.rl.eval_samples = 4  # n samples per held-out task for pass@k
    c.rl.eval_k = (1, 2)  # k values of the unbiased pass@k estimator (each <= eval_samples)
    c.rl.eval_num_tasks = 8  # held-out tasks per agent eval
    c.rl.eval_regression_margin = 0.05  # flag a checkpoint whose pass@1 drops by more than this

    # Coding environment (coder/env): sandbox limits per command, tool output, reward.
    c.env = ml_collections.ConfigDict()
    c.env.timeout_s = 60.0  # wall time of one sandbox command (its whole process tree is killed)
    c.env.cpu_s = 60  # RLIMIT_CPU seconds per process
    c.env.memory_mb = 2048  # RLIMIT_AS per process
    c.env.nproc = 64  # RLIMIT_NPROC of the sandbox's own uid (processes + threads)
    c.env.fsize_mb = 64  # largest file a sandboxed process may write
    c.env.tmp_mb = 64  # size of the sandbox's private /tmp and /dev/shm (tmpfs, each)
    c.env.output_kb = 64  # command output kept per stream (head + tail; the rest is dropped)
    # commits of a repository task's history copied into its workspace (>= 1: the task's commit
    # itself; more lets the repo_history tool show why code is the way it is); never a later one
    c.env.history_depth = 1
    # where tasks' Python environments (Task.environment: a venv per spec, coder/env/runtime/environments.py)
    # are built and kept: a local directory; "" = $XDG_CACHE_HOME/coder/environments (~/.cache/...)
    c.env.environments_dir = ""
    # a task's `setup` commands run with the host's network (pip installs, downloads); the
    # agent's commands and scoring never have one
    c.env.setup_network = False
    # agent memory (memory_write / memory_read, coder/env/tools/memory.py): notes per run, split and
    # repository; a write past the cap is refused
    c.env.memory_max_notes = 64  # notes kept per (split, repository) of a run
    c.env.memory_max_chars = 2000  # characters of one note
    # semantic_search (coder/env/tools/semantic_search.py): "policy" = the starting policy's own trunk
    # (mean-pooled hidden states, run in the env worker's CPU), "package.module:factory" = an
    # encoder you install, "" = the tool answers that it is off
    c.env.semantic_encoder = "policy"
    c.env.semantic_checkpoint = ""  # "policy": checkpoint whose trunk embeds ("" = the stage's init_from)
    c.env.semantic_cache_dir = ""  # embeddings per repository snapshot ("" = <tempdir>/coder-semantic)
    c.env.semantic_max_tokens = 256  # "policy": a chunk's first tokens embedded
    c.env.max_output_chars = 8000  # one tool result is cut to this many characters
    c.env.max_tool_output_tokens = 32768  # an episode ends when its tool outputs reach this
    # "fraction" of hidden (FAIL_TO_PASS) tests passed | "all" (all-or-nothing; on repository tasks
    # SWE-bench's resolution rule, also named "resolved"): coder.env.scoring.score.REWARD_MODES
    c.env.reward_mode = "fraction"
    c.env.test_timeout_s = 300.0  # wall time of the scoring test run
    # pooled episodes whose prepared workspaces are identical (same task scoring fields, same
    # tree: coder.env.scoring.score.scoring_digest) share one test run's verdict (coder/env/scoring/verdicts.py);
    # False runs the tests for every rollout (e.g. to see how flaky a task's tests are)
    c.env.share_verdicts = True
    # where the env workers (rl.env_workers) run: "local" = processes of the actor's host; "ray" =
    # Ray actors (coder/env/ray_pool.py) on the cluster at rl.topology.ray_address, e.g. its CPU nodes
    c.env.workers_backend = "local"
    c.env.ray_num_cpus_per_worker = 1.0  # "ray": CPUs Ray reserves for each env worker actor
    c.env.ray_resource = ""  # "ray": custom Ray resource the workers' nodes declare ("" = any node)

    # GRPO learner (coder/rl/grpo.py, coder/stages/grpo.py).
    c.grpo = ml_collections.ConfigDict()
    c.grpo.steps = 20  # optimizer steps of the grpo stage (fewer if the tasks run out: single epoch)
    c.grpo.lr = 3e-4  # peak learning rate of the grpo stage
    c.grpo.clip_low = 0.2  # ratio clipped below at 1 - clip_low
    c.grpo.clip_high = 0.28  # ratio clipped above at 1 + clip_high (asymmetric, DAPO)
    c.grpo.kl_coef = 0.001  # k1 KL penalty folded into the per-token advantage (0 = off)
    c.grpo.tokens_per_group = 0  # loss normalizer per group (0 = group_size * max_rollout_tokens)
    c.grpo.router_replay = False  # train with the engine's expert ids (routing=) for MoE
    # shared-prefix packing (coder.rl.trajectory.shared_prefix_rows): the learner computes a group's
    # shared prompt once, its rollouts' continuations attending to it; the value is the packed rows'
    # length in tokens (>= rl.context_budget; 0 = off: one generation per row). Dense attention only:
    # the GPU flash kernel takes the prefix mask; on TPU and CPU it is XLA's [B,H,T,T] scores (splash
    # has no such mask); no NSA, no MTP refresh.
    c.grpo.shared_prefix_len = 0
    c.grpo.eval_every = 0  # steps between agent evals during grpo (0 = only at the end)
    c.grpo.eval_at_start = True  # also before the first step: the baseline the stage's pass@1 gain is read against
    c.grpo.warmup_steps = 0  # linear warmup of the grpo stage (0 = train.warmup_steps)
    c.grpo.min_lr_ratio = 0.0  # its cosine decays to grpo.lr * this (0 = train.min_lr_ratio; 1 = constant lr)
    c.grpo.grad_accum = 0  # the learner's micro-batches per step (0 = train.grad_accum)
    c.grpo.remat = ""  # model.remat of the learner ("" = model.remat)
    c.grpo.offload_optimizer = False  # train.offload_optimizer of the learner (Adam moments in host memory)
    c.grpo.ckpt_every = 5  # steps between grpo checkpoints (-> train.ckpt_every): an RL step is minutes of rollouts
    # MTP refresh: the MTP modules keep distilling the current policy on its sampled tokens (trunk
    # held fixed; 0 = off: the drafts go stale as the policy moves). Small because the global-norm
    # clip (train.grad_clip) sees the MTP gradients beside the policy's; Adam's step size is
    # scale-free, so the MTP modules still learn at grpo.lr.
    c.grpo.mtp_weight = 0.1
    c.grpo.max_staleness = 4  # tokens sampled more than this many learner versions ago carry no loss
    # truncated importance weight min(pi_learner/pi_engine, cap) on each token's loss (0 = off). Without
    # it PPO's min() never bounds ratio x A for a negative advantage, so a stale token whose
    # probability rose since sampling weighs without limit (async mode); 2 is verl's default cap.
    # On-policy tokens have rho ~ 1: unaffected.
    c.grpo.tis_cap = 2.0

    # MTP self-distillation (coder/stages/mtp.py, stage "mtp"): trunk frozen, MTP modules trained.
    c.mtp = ml_collections.ConfigDict()
    c.mtp.steps = 100  # optimizer steps of the mtp stage
    c.mtp.lr = 3e-3  # peak learning rate of the MTP modules
    c.mtp.ce_weight = 0.0  # mix in cross-entropy on the data (0 = pure distillation)
    c.mtp.fresh = True  # re-initialise the MTP modules instead of continuing init_from's
    c.mtp.eval_batches = 8  # held-out batches for KL / agreement / acceptance at the end
    c.mtp.grad_accum = 0  # micro-batches per step (0 = train.grad_accum)

    # Ahead-of-time compilation for a TPU topology (coder/stages/compile.py, stage "compile").
    c.compile = ml_collections.ConfigDict()
    c.compile.topology = "v5e-4"  # target slice: "v5e-4", "v5p-512", "v6e-256" or "v5p:4x8x8"
    c.compile.report_dir = ""  # where report.json / report.md go ("" = {workdir}/compile)
    # the RL engine's prefill and decode programs (coder/infer/engine.py), compiled beside the
    # training step on the same mesh: rows decoded together (0 = rl.group_size), cache slots
    # (0 = rl.context_budget), tokens per prefill chunk (0 = min(2048, cache slots))
    c.compile.engine = True
    c.compile.engine_batch = 0
    c.compile.engine_max_len = 0
    c.compile.engine_prefill_len = 0
    # the engine's own slice, an RL actor's ("" = the learner's mesh above), e.g. "v5p-128": its
    # mesh keeps the expert / tensor / sequence axes with the rest over rows (coder.rl.actor.engine_mesh)
    c.compile.engine_topology = ""
    c.compile.grpo = True  # also the GRPO learner's step (coder.rl.learner: GRPO loss and batch, grad_accum as train)
    c.compile.grpo_batch = 0  # rows of its batch (0 = data.batch_size)
    c.compile.grpo_seq_len = 0  # tokens per row (0 = rl.context_budget if set, else data.seq_len)
    # What the plan (config.plan, coder/stages/plan.py) assumes of a rollout, stated in plan.json:
    # tokens a rollout's rows hold over its chain (prompt, tool outputs, policy; 0 =
    # rl.context_budget), and the probability that an MTP draft is accepted, per depth
    c.compile.rollout_tokens = 0
    c.compile.draft_acceptance = 0.7

    # Serving (coder/serve, stage "serve"): the OpenAI-compatible server over the engine.
    c.serve = ml_collections.ConfigDict()
    c.serve.host = "127.0.0.1"  # address the server listens on ("0.0.0.0": every interface)
    c.serve.port = 8000  # port the server listens on
    c.serve.model_name = "coder"  # the model id of GET /v1/models (a request naming another gets a 404)
    c.serve.max_len = 0  # tokens of prompt + reply per sequence (0 = model.max_position_embeddings)
    c.serve.max_slots = 32  # sequences the engine decodes at once (more requests wait for a slot)
    # of those, slots that keep finished requests' caches as prefixes: a conversation's next turn
    # (the same prompt + the reply + new messages) prefills only what is new (0 = off, -1 = a
    # quarter of serve.max_slots; a new weights version flushes them; requests evict them when
    # every other slot is busy)
    c.serve.prefix_cache_slots = -1
    c.serve.decode_steps = 8  # decode steps per engine call (a stream sends tokens this often)
    # speculative decoding: each decode step drafts this many tokens with the MTP modules and the
    # model verifies them in one forward (exact: replies are distributed as plain decoding's);
    # 0 = off, at most model.num_mtp_layers
    c.serve.speculative_k = 0
    c.serve.dtype = ""  # serving weights' dtype ("" = model.dtype); the weight store holds this dtype
    c.serve.max_tokens = 512  # a request's default max_tokens
    c.serve.system_prompt = ""  # preamble of the tools' system prompt when a request has no system message
    c.serve.log_store = ""  # trajectory log URL ("" = {workdir}/serve/trajectories; "none" = no log)
    c.serve.flush_seconds = 30.0  # a served completion reaches the log within this many seconds
    c.serve.retention_days = 30.0  # days of trajectories and feedback kept (0 = forever)
    c.serve.weight_store = ""  # weight store URL the server follows and the realtime stage publishes to
    c.serve.poll_seconds = 10.0  # seconds between two polls of the weight store

    # Real-time RL from production signals (coder/rl/realtime.py, stage "realtime").
    c.realtime = ml_collections.ConfigDict()
    c.realtime.cycles = 0  # cycles to run (0 = forever)
    c.realtime.window = 18000.0  # seconds of served trajectories per cycle (5 hours)
    c.realtime.steps = 4  # optimizer steps per cycle (the window's completions in as many minibatches)
    c.realtime.lr = 1e-6  # constant learning rate of the stage
    c.realtime.tokens_per_completion = 0  # loss normaliser per completion (0 = serve.max_tokens)
    # the reward of a served reply with a malformed tool call that got no feedback: a negative
    # sample, not dropped (coder.rl.realtime.join; the seeds' broken-call hack)
    c.realtime.broken_call_reward = -1.0
    c.realtime.signals = ml_collections.ConfigDict(
        dict(edit_kept=1.0, dissatisfied_followup=1.0, rating=1.0)
    )  # production signal name -> reward weight (0 = off); registry in coder/rl/realtime.py

    c.lock()  # setting an unknown key (a typo) raises instead of adding a key nothing reads
    c.rl.aux_rewards.unlock()  # a registered auxiliary reward may be added (checked by grpo)
    c.realtime.signals.unlock()  # a registered signal may be added (checked by realtime)
    return c
