"""GRPO's toy environment, shared by the GRPO tests (a helper module: no tests of its own).

The environment (shared with tests/rl/test_grpo_actors.py, tests/rl/test_router_replay.py and
tests/rl/test_grpo_preemption.py, which run the learning tests on it) is light and in-process so a
learning run takes a few minutes on CPU: the task is "submit the lucky number from 1 to 4" (in
many phrasings, each used once) with one tool, `submit(answer)`, and the reward is 1 when the
answer is 3. It goes through exactly the code a sandboxed run uses (the actor's agent loop,
protocol parsing, score_groups, Learner with coder.rl.grpo's loss, engine weight updates,
metrics.jsonl); only the episode is in-process instead of a bwrap sandbox. What it does not test
is conditioning on the prompt: a 2-layer, 64-wide model did not learn that within a CPU test's
budget (tried: copy a number from the prompt; smallest vs largest), so the answer is the same for
every task.

Starting point (`sft_format`): a tiny model briefly SFT-ed on the call format with a uniformly
random answer, so its reward starts near 0 (a quarter right, minus the length penalty; wrong
answers score -max_penalty); GRPO must concentrate it on 3 (and on well-formed calls: broken ones
are negative examples). A wrong loss sign, misaligned targets, masks that miss the sampled tokens,
or weights that never reach the engine leave the reward at chance or lower: each fails the
learning tests.

The fitted weights are committed (tests/fits.py: tests/data/fits, `python -m tests.fits`
refreshes them after a change to the toy, its tokenizer, the model or the fit): every machine
starts the learning tests from the same model, and the suite skips two 200-step fits.
`fitted_policy` falls back to fitting when the committed fit was made by another recipe, and
checks the call format once per session either way.

A resumed stage continuing the single epoch where it stopped is tests/rl/test_grpo_preemption.py.
The real sandboxed toy tasks of coder.env run through the same loop in tests/test_quickstart.py.

`FILE_TOY` is the same task as a sandboxed coding task (lucky.py must set `lucky` to 3, pytest
checks it in a bwrap sandbox, the one tool is the env's write_file): the stage's own episodes,
tool and scorer, with its own fitted model (`fitted_policy(dir, FILE_TOY)`); the sync learning
test of tests/rl/test_grpo_actors.py runs on it.
"""
import dataclasses
import functools
import inspect
import json
import os
import random

import jax
import numpy as np
import optax
from flax import nnx

from coder.data import tokenizer as tokenizer_lib
from coder.env import protocol
from coder.env.episode import select_tools
from coder.env import tasks as tasks_lib
from coder.model import Transformer
from coder.train import losses
from configs import base
from tests import fits

SUBMIT = protocol.ToolSpec(
    "submit", "Submit your answer.",
    {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
     "additionalProperties": False})
ANSWERS = "1234"
NAMES = ["Ada", "Alan", "Grace", "Linus", "Guido", "Barbara", "Donald", "Edsger", "Ken", "Dennis",
         "Frances", "John", "Margaret", "Niklaus", "Tony", "Leslie", "Radia", "Sophie", "Bjarne", "Yukihiro"]
OPENERS = ["Hi", "Hello", "Dear", "Hey"]
CLOSERS = ["Thanks.", "Please.", "Quickly.", "Now."]
LUCKY = "3"


def phrasings(n, seed, request: str) -> list[str]:
    """n distinct prompts "{opener} {name}, {request}. {closer}", in an order drawn from seed."""
    combos = [(o, name, c) for o in OPENERS for name in NAMES for c in CLOSERS]
    random.Random(seed).shuffle(combos)
    return [f"{o} {name}, {request}. {c}" for o, name, c in combos[:n]]


def make_tasks(n, seed):
    """n distinct toy tasks (distinct prompts: single epoch); the right answer is always LUCKY."""
    return [(tasks_lib.Task(id=prompt, prompt=prompt, files={}, tests={}, source="toy-inproc"), LUCKY)
            for prompt in phrasings(n, seed, "submit the lucky number from 1 to 4")]


class SubmitEpisode:
    """In-process episode: one tool, reward 1 when the submitted answer is the task's."""

    def __init__(self, expected):
        self.tools = [SUBMIT]
        self.expected, self.answer, self.done = expected, None, False

    def call(self, call):
        self.answer, self.done = call.arguments["answer"], True
        return "submitted"

    def score(self):
        return float(self.answer == self.expected), {}

    def close(self):
        pass


PREAMBLE = "Answer with the submit tool."


# --- the sandboxed variant ------------------------------------------------------------------------
# The same lucky number as a coding task in a real bwrap sandbox: the workspace holds lucky.py
# (`lucky = 0`) and test_lucky.py (asserts lucky == 3); the one tool is the env's own write_file
# (coder.env.tools.registry) and the episode has one turn (rl.max_turns=1), so the reward is pytest's verdict
# on the written file, run by coder.env.episode in the sandbox: the production episode, tool and
# scorer (EpisodeFactory, as stage grpo builds them), with a task the 2-layer model can learn.
FILE_TOOLS = ("write_file",)
FILE_PREAMBLE = "Answer with the write_file tool."
FILE_TEST = "from lucky import lucky\n\n\ndef test_lucky():\n    assert lucky == 3\n"


def file_content(answer: str) -> str:
    return f"lucky = {answer}"


def file_tasks(n, seed):
    """n distinct sandboxed toy tasks (distinct prompts) -> [(Task, LUCKY)]."""
    files = {"lucky.py": file_content("0"), "test_lucky.py": FILE_TEST}
    return [(tasks_lib.Task(id=prompt, prompt=prompt, files=dict(files), tests={"test_lucky.py": FILE_TEST},
                            source="toy-sandboxed"), LUCKY)
            for prompt in phrasings(n, seed, "set lucky in lucky.py to the lucky number from 1 to 4")]


class FileEpisode:
    """In-process stand-in of the sandboxed episode for the fit's format check only: one
    write_file call; `answer` is the digit it wrote as `lucky` to lucky.py (None for anything else)."""

    def __init__(self, expected):
        self.tools = select_tools(FILE_TOOLS)
        self.expected, self.answer, self.done = expected, None, False

    def call(self, call):
        content, path = call.arguments.get("content"), call.arguments.get("path")
        ok = path == "lucky.py" and content in [file_content(a) for a in ANSWERS]
        self.answer, self.done = (content[-1] if ok else None), True
        return "written"

    def score(self):
        return float(self.answer == self.expected), {}

    def close(self):
        pass


@dataclasses.dataclass(frozen=True)
class Toy:
    """One toy format: its tools, preamble, tasks, the call that answers, the in-process episode
    that checks the fit, the file stem its fitted weights are cached under, and its `rl` keys
    over tiny_config's."""

    name: str
    tools: tuple
    preamble: str
    make_tasks: object  # (n, seed) -> [(Task, expected answer)]
    call: object  # answer -> the rendered tool call
    episode: object  # expected answer -> an in-process episode
    room: int  # stage length past the system prompt and 24 prompt tokens: the prompt's rest, rl.summary_reserve, a turn
    rl: dict = dataclasses.field(default_factory=dict)

    @property
    def system_prompt(self) -> str:
        return protocol.render_system_prompt(list(self.tools), self.preamble)


SUBMIT_TOY = Toy("toy_policy", (SUBMIT,), PREAMBLE, make_tasks,
                 lambda a: protocol.render_tool_call("submit", {"answer": a}), SubmitEpisode, 64)
# the write_file call is longer than submit's; the sandboxed episode ends after the write
FILE_TOY = Toy("file_policy", tuple(select_tools(FILE_TOOLS)), FILE_PREAMBLE, file_tasks,
               lambda a: protocol.render_tool_call("write_file", {"path": "lucky.py", "content": file_content(a)}),
               FileEpisode, 112, dict(tools=FILE_TOOLS, max_turns=1, max_turn_tokens=48, max_rollout_tokens=48))


def tokenizer(toy: Toy = SUBMIT_TOY):
    """A small tokenizer fitted to the toy prompts (the submit toy's system prompt is ~175 tokens)."""
    import json.decoder
    import json.encoder

    code = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    prompts = [t.prompt for t, _ in toy.make_tasks(200, 1)]
    calls = [toy.call(k) for k in ANSWERS]
    return tokenizer_lib.train_tokenizer([toy.system_prompt] * 20 + prompts + calls * 20 + [code], 600)


def tiny_config(tok, stage_len, toy: Toy = SUBMIT_TOY):
    """The toy runs' config: the tiny MoE, GRPO's group and turn budgets, `toy`'s preamble and
    `rl` keys."""
    c = base.get_config()
    c.model.update(dict(vocab_size=tok.padded_vocab_size, hidden_size=64, intermediate_size=128,
                        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, num_mtp_layers=0, max_position_embeddings=stage_len,
                        dtype="float32"))
    c.rl.update(dict(group_size=8, tasks_per_step=8, temperature=1.0, max_turns=2, max_turn_tokens=28,
                     max_rollout_tokens=56, context_budget=stage_len, summary_reserve=32, max_summaries=0,
                     system_prompt=toy.preamble))
    c.rl.update(toy.rl)
    # no agent eval before the first step: the learning tests read the rollouts' rewards
    c.grpo.update(dict(kl_coef=0.0, clip_low=0.2, clip_high=0.28, eval_at_start=False))
    c.train.update(dict(lr=1.5e-3, warmup_steps=3, min_lr_ratio=1.0, weight_decay=0.0, grad_clip=1.0,
                        log_every=1, ckpt_every=1000))
    return c


def sft_format(cfg, tok, steps=200, seed=0, lr=3e-3, toy: Toy = SUBMIT_TOY):
    """Teaches `toy`'s call format with a uniformly random answer from 1 to 4 -> (model, last loss).

    Adam with a short warmup and global-norm clipping: at a constant 5e-3 from the first step
    the fit sat on an edge where another CPU's float rounding sent it to a model that never
    emitted its call (a fresh machine's learning tests failed at reward -0.3 throughout)."""
    model = Transformer(cfg.model, rngs=nnx.Rngs(seed))
    schedule = optax.linear_schedule(0.0, lr, 10)
    opt = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule)), wrt=nnx.Param)
    rng = random.Random(seed)
    system = toy.system_prompt
    tasks = toy.make_tasks(300, 99)  # prompts for the format only
    T = cfg.model.max_position_embeddings

    def batch():
        toks, masks = np.zeros((16, T), np.int32), np.zeros((16, T), np.float32)
        seg = np.zeros((16, T), np.int32)
        for i in range(16):
            task, _ = rng.choice(tasks)
            answer = rng.choice(ANSWERS)
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": task.prompt},
                    {"role": "assistant", "content": toy.call(answer)}]
            ids, mask = tok.render_conversation(msgs)
            toks[i, :len(ids)], masks[i, :len(ids)], seg[i, :len(ids)] = ids, mask, 1
        pos = np.broadcast_to(np.arange(T, dtype=np.int32), (16, T))
        return dict(tokens=toks, positions=pos, segment_ids=seg, loss_mask=masks)

    # -O2: 200 steps in 52 s instead of 95 s; the fit is checked right after (fitted_policy)
    return model, train_steps(model, opt, batch, steps, xla_opt_level=2)


def call_format(model, cfg, tok, tasks: int = 8, seed: int = 0, toy: Toy = SUBMIT_TOY) -> dict:
    """How the model answers the toy tasks through the actor's own agent loop and engine
    (rl.group_size rollouts per task at rl.temperature) -> {"submitted": fraction of rollouts
    that submitted through a well-formed call, "lucky": fraction that submitted LUCKY}."""
    import jax

    from coder.rl.actor import make_engine, sampling_params
    from coder.rl.agent import Agent

    engine = make_engine(model, cfg)
    try:
        agent = Agent(engine, tok, cfg.rl, sampling_params(cfg.rl))
        episodes = []
        for i, (task, answer) in enumerate(toy.make_tasks(tasks, seed + 1000)):
            group = [toy.episode(answer) for _ in range(int(cfg.rl.group_size))]
            agent.run_group(task.id, task.prompt, group, jax.random.key(seed + i))
            episodes += group
    finally:
        engine.close()
    return dict(submitted=float(np.mean([ep.answer is not None for ep in episodes])),
                lucky=float(np.mean([ep.answer == LUCKY for ep in episodes])))


def train_steps(model, opt, batch, steps: int, *, xla_opt_level: int | None = None, **model_kw) -> float:
    """`steps` next-token-loss updates of `model` with `opt` on `batch()` each (the tests' small
    fits of a call format); `model_kw` goes to the model's call. Returns the last loss.

    `xla_opt_level`: XLA:CPU's optimisation level for this one program (None: the suite's -O0,
    tests/conftest.py). -O2 halves the time of each of a long fit's steps; it also changes the
    fit's last bits, so a fit tuned at one level keeps it (test_serve's exact call lost its tool
    name when its fit ran at -O2)."""
    graphdef, state = nnx.split((model, opt))
    options = None if xla_opt_level is None else {"xla_backend_optimization_level": int(xla_opt_level)}

    @functools.partial(jax.jit, donate_argnums=0, compiler_options=options)
    def step(state, b):
        model, opt = nnx.merge(graphdef, state)

        def loss_fn(m):
            logits, _ = m(b["tokens"], b["positions"], b["segment_ids"], **model_kw)
            return losses.next_token_loss(logits, b)[0]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    for _ in range(steps):
        state, loss = step(state, batch())
    nnx.update((model, opt), state)
    return float(loss)


# The fitted policy's format check: the learning tests measure GRPO moving the answer, which
# needs a model that already submits. Measured over 64 rollouts on the developers' machine:
# 1.0 after 200 steps (0.92 after 120); the answer stays near chance (0.30 "3", chance 0.25).
MIN_SUBMITTED = 0.85


@dataclasses.dataclass(frozen=True)
class ToyPolicy:
    """The GRPO tests' starting point: the tokenizer, the stage length the model was fitted at
    (system prompt + task + room for a turn), the SFT-ed weights and their `call_format`."""

    tokenizer: object
    stage_len: int
    state: object
    format: dict


def _setup(toy: Toy):
    tok = tokenizer(toy)
    head = len(tok.turn_ids("system", toy.system_prompt)) + 24
    stage_len = -(-(head + toy.room) // 16) * 16
    return tok, stage_len, tiny_config(tok, stage_len, toy)


@dataclasses.dataclass(frozen=True)
class ToyRecipe:
    """A toy's committed fit (tests/fits.py): sft_format on the toy's tokenizer and config, saved
    with its stage length. `python -m tests.fits` refreshes the committed ones (tests/data/fits)."""

    toy: Toy

    def key(self, tok, cfg) -> str:
        return fits.key(tok, sft_format, toy=self.toy.name, model=cfg.model.to_dict())

    def current_key(self) -> str:
        tok, _, cfg = _setup(self.toy)
        return self.key(tok, cfg)

    def write(self, directory: str) -> dict:
        tok, stage_len, cfg = _setup(self.toy)
        model, loss = sft_format(cfg, tok, toy=self.toy)
        return fits.save(directory, self.toy.name, self.key(tok, cfg), nnx.state(model), loss=loss,
                         stage_len=stage_len)


SUBMIT_RECIPE, FILE_RECIPE = ToyRecipe(SUBMIT_TOY), ToyRecipe(FILE_TOY)


def fitted_policy(cache_dir: str, toy: Toy = SUBMIT_TOY) -> ToyPolicy:
    """The SFT-ed `toy` (sft_format): the committed fit (tests/fits.py) when it was made by this
    recipe and tokenizer, else fitted by the first process of the session that asks into `cache_dir` and
    loaded from there by the others. Its call format (`call_format`) is measured once per
    session, right after the weights are at hand, and the fixture fails at once, saying so, when
    the model does not submit (every learning test would otherwise fail at reward -0.3)."""
    import filelock

    tok, stage_len, cfg = _setup(toy)
    report = os.path.join(cache_dir, f"{toy.name}.format.json")
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    template = nnx.state(model)
    with filelock.FileLock(os.path.join(cache_dir, f"{toy.name}.lock")):
        recipe, source = ToyRecipe(toy), fits.FITS_DIR
        meta = fits.committed(toy.name, recipe.key(tok, cfg))
        if meta is None:  # fitted once per session, by the first process that asks
            source = cache_dir
            meta_path = os.path.join(cache_dir, f"{toy.name}.json")
            if not os.path.exists(meta_path):
                recipe.write(cache_dir)
            with open(meta_path) as f:
                meta = json.load(f)
        assert meta["stage_len"] == stage_len, (meta, stage_len)
        state = fits.load(source, toy.name, template)
        if not os.path.exists(report):
            nnx.update(model, state)
            with open(report, "w") as f:
                json.dump(dict(call_format(model, cfg, tok, toy=toy), loss=meta["loss"], source=source), f)
        with open(report) as f:
            fmt = json.load(f)
    assert fmt["submitted"] >= MIN_SUBMITTED, (
        f"the toy SFT fit ({fmt['source']}, tests/rl_toy.py sft_format: loss {fmt['loss']:.3f}) submits "
        f"in only {fmt['submitted']:.0%} of its rollouts (needs {MIN_SUBMITTED:.0%}): the GRPO learning "
        f"tests would start from a model that never calls its tool. The fit, not GRPO, broke.")
    return ToyPolicy(tok, stage_len, state, fmt)
