"""Real-time RL: rewards from the signals of real users on the tokens the server served.

Composer 2's last loop: the deployed checkpoint serves, users react (they keep an edit, or send
a dissatisfied follow-up), those reactions become rewards, the served checkpoint is trained on
its own tokens, evaluated against the benchmark, and shipped. Because the served weights are
the ones trained, the data is on-policy up to the cycle's length. Stage `realtime`
(coder/stages/realtime.py) runs the cycles; this module holds the pieces that need no I/O:

**Signals -> rewards** (`realtime.signals`: name -> weight, 0 = off). A registry like the
auxiliary rewards of coder/rl/reward.py: each signal is one function `fn(value) -> float`
registered with `@signal("name")`; a completion's reward is the sum over its signals of
`weight * fn(value)`. Registered:
- `edit_kept`: the user kept the edit the completion made (value 1; a fraction in [0, 1] for a
  partly kept edit; 0 = reverted): reward `value`;
- `dissatisfied_followup`: the user's next message complained or asked again (value 1):
  reward `-value`;
- `rating`: an explicit rating in [-1, 1] (thumbs down -1, up +1): reward `value`.

**Join** (`join`). Feedback names a completion (`completion_id`, optionally a `choice`) or a
conversation (`conversation_id`). A conversation's feedback credits *every* completion of the
conversation logged at or before it (every choice of each), with equal weight: the outcome a
user reports (an edit kept at the end, a complaint) is the product of all the turns that led
to it, as GRPO's outcome reward applies to every turn of a rollout, not only to its last
reply. Equal rather than discounted credit: no discount factor to tune, and the same rule as a
rollout's chain. For each (completion, signal), the latest feedback wins (a client may
correct itself; a later verdict on a conversation replaces an earlier one on its earlier turns
too). Completions without any signal are dropped (counted); feedback that matches no
completion of the window is counted.

**Version** (`select`). The cycle trains the version v the server served and the learner holds:
a completion keeps loss only on the tokens v sampled (a completion that began under v - 1 and
continued under v after an in-flight update keeps its v tokens); one with no v token is stale
and dropped (counted). The PPO ratio is against the logged behaviour logprob, as in GRPO.

**Baseline** (`leave_one_out`): no groups of the same prompt exist in production, so each
completion's baseline is the mean reward of the *other* N - 1 completions of the window:

    A_i = r_i - mean_{j != i} r_j = N / (N - 1) * (r_i - mean_j r_j)

unbiased (the baseline does not depend on completion i) and zero when every reward is equal.
Fewer than two completions with a signal: no baseline, the cycle trains nothing.

**Loss** (`loss_fn`): coder.rl.grpo.policy_loss (PPO clip at `grpo.clip_low / clip_high`,
truncated IS at `grpo.tis_cap`) with the k1 KL to the *served version* (`grpo.kl_coef`) folded
into the advantage. Every trained token was sampled by v, so the served version's logprob of
it is the behaviour logprob the engine logged: `ref_logp = behaviour_logp`, no reference
forward. Each completion's logits are divided by its own request's temperature (0, greedy, is
logged as `log_softmax(logits)`: T = 1), so on-policy ratios are 1. The normaliser is a
constant per step: `realtime.tokens_per_completion` (0 = `serve.max_tokens`) times the
completions of the step, never a completion's own length.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coder.rl import grpo
from coder.train.trainer import Trainer

SIGNALS: dict[str, Callable[[float], float]] = {}


def signal(name: str):
    """Registers `fn(value) -> float` as the production signal `name`."""

    def register(fn):
        if name in SIGNALS:
            raise ValueError(f"signal {name!r} is registered twice")
        SIGNALS[name] = fn
        return fn

    return register


@signal("edit_kept")
def edit_kept(value: float) -> float:
    """The edit was kept (1), partly kept (the fraction), or reverted (0)."""
    return float(np.clip(value, 0.0, 1.0))


@signal("dissatisfied_followup")
def dissatisfied_followup(value: float) -> float:
    """The user's next message complained or asked again (1)."""
    return -float(np.clip(value, 0.0, 1.0))


@signal("rating")
def rating(value: float) -> float:
    """An explicit rating in [-1, 1]."""
    return float(np.clip(value, -1.0, 1.0))


def check_signals(weights) -> None:
    """ValueError naming the unknown signals of `realtime.signals`."""
    unknown = sorted(set(dict(weights)) - set(SIGNALS))
    if unknown:
        raise ValueError(f"realtime.signals: unknown signals {unknown}; registered: {sorted(SIGNALS)}")


@dataclasses.dataclass
class Joined:
    """A completion record with the signals it received and its reward."""

    record: dict
    signals: dict  # signal name -> value (the latest feedback of that signal)
    reward: float
    advantage: float = 0.0


def join(completions: list[dict], feedback: list[dict], weights,
         broken_call_reward: float = -1.0) -> tuple[list[Joined], dict]:
    """Completions with at least one signal (time order) and the counts of what was dropped.

    A completion whose reply held a malformed tool call (`broken_calls` > 0 in the log) and got
    no feedback is kept with reward `broken_call_reward` (realtime.broken_call_reward): dropping
    it would let a broken call vanish from training, the hack the seeds report for RL (a broken
    call discarded the rollout instead of counting as a negative).

    Counts: `trajectories` (completions read), `feedback`, `feedback_unmatched` (no completion
    of the window), `feedback_off` (a signal whose weight is 0 or that is not configured),
    `dropped_no_signal`, `broken_no_signal` (kept as negatives), `with_signal`,
    `signals_{name}` (feedback matched, per signal).
    """
    weights = {k: float(v) for k, v in dict(weights).items()}
    check_signals(weights)
    completions = sorted(completions, key=lambda c: c["time"])
    by_id = collections.defaultdict(dict)  # completion_id -> {choice: record}
    by_conv = collections.defaultdict(list)  # conversation_id -> records in time order
    for c in completions:
        by_id[c["completion_id"]][int(c["choice"])] = c
        if c["conversation_id"]:
            by_conv[c["conversation_id"]].append(c)
    counts = collections.Counter(trajectories=len(completions), feedback=len(feedback), feedback_unmatched=0,
                                 feedback_off=0, dropped_no_signal=0, broken_no_signal=0)
    got: dict[tuple, dict] = collections.defaultdict(dict)  # (completion_id, choice) -> {signal: value}
    for f in sorted(feedback, key=lambda f: f["time"]):
        name = f["signal"]
        if not weights.get(name):
            counts["feedback_off"] += 1
            continue
        targets = []
        if f["completion_id"]:
            choices = by_id.get(f["completion_id"], {})
            targets = [choices[f["choice"]]] if f["choice"] >= 0 and f["choice"] in choices else (
                list(choices.values()) if f["choice"] < 0 else [])
        elif f["conversation_id"]:  # every turn the user saw before reacting, equal credit
            targets = [c for c in by_conv.get(f["conversation_id"], []) if c["time"] <= f["time"]]
        if not targets:
            counts["feedback_unmatched"] += 1
            continue
        counts[f"signals_{name}"] += 1
        for c in targets:
            got[(c["completion_id"], int(c["choice"]))][name] = float(f["value"])
    joined = []
    for c in completions:
        sig = got.get((c["completion_id"], int(c["choice"])))
        if not sig:
            if int(c.get("broken_calls") or 0) > 0:
                joined.append(Joined(c, {}, float(broken_call_reward)))
                counts["broken_no_signal"] += 1
            else:
                counts["dropped_no_signal"] += 1
            continue
        joined.append(Joined(c, sig, sum(weights[k] * SIGNALS[k](v) for k, v in sig.items())))
    counts["with_signal"] = len(joined) - counts["broken_no_signal"]
    return joined, dict(counts)


def policy_tokens(record: dict, version: int) -> np.ndarray:
    """bool `[len(completion)]`: the completion's tokens sampled by `version`."""
    return np.asarray(record["versions"], np.int64) == int(version)


def select(joined: list[Joined], version: int, max_len: int) -> tuple[list[Joined], dict]:
    """The completions with a token of `version` that fit a `max_len` row; counts of the others
    (`stale`: no token of `version`; `too_long`)."""
    kept, counts = [], collections.Counter(stale=0, too_long=0)
    for j in joined:
        r = j.record
        if not policy_tokens(r, version).any():
            counts["stale"] += 1
        elif len(r["prompt_ids"]) + len(r["completion_ids"]) > max_len:
            counts["too_long"] += 1
        else:
            kept.append(j)
    return kept, dict(counts)


def leave_one_out(rewards) -> np.ndarray:
    """A_i = r_i - mean_{j != i} r_j (module docstring); zeros for fewer than 2 rewards."""
    r = np.asarray(rewards, np.float64)
    n = r.size
    if n < 2:
        return np.zeros_like(r)
    return r - (r.sum() - r) / (n - 1)


def completions_batch(items: list[Joined], version: int, seq_len: int, rows: int, normalizer: float,
                      routing: bool = False) -> dict:
    """The training batch of `items` (one completion per row, prompt + completion; rows padded
    to `rows`): tokens, positions, segment_ids int32 `[R, T]`; loss_mask (the completion's
    `version` tokens), behaviour_logp = ref_logp (the logged logprob, at the target index)
    float32 `[R, T]`; advantages, temperature (logits divisor: the request's, 1 for greedy and
    padding), normalizer float32 `[R]`; with `routing`, expert_ids int32 `[moe_layers, R, T,
    top_k]` (the logged routing of every token; 0 on padding)."""
    if len(items) > rows:
        raise ValueError(f"{len(items)} completions do not fit in {rows} rows")
    b = dict(tokens=np.zeros((rows, seq_len), np.int32), positions=np.zeros((rows, seq_len), np.int32),
             segment_ids=np.zeros((rows, seq_len), np.int32), loss_mask=np.zeros((rows, seq_len), np.float32),
             behaviour_logp=np.zeros((rows, seq_len), np.float32), advantages=np.zeros((rows,), np.float32),
             temperature=np.ones((rows,), np.float32), normalizer=np.full((rows,), normalizer, np.float32))
    experts = None
    for i, j in enumerate(items):
        r = j.record
        p, c = list(r["prompt_ids"]), list(r["completion_ids"])
        n = len(p) + len(c)
        b["tokens"][i, :n] = p + c
        b["positions"][i, :n] = np.arange(n)
        b["segment_ids"][i, :n] = 1
        b["loss_mask"][i, len(p):n] = policy_tokens(r, version)
        b["behaviour_logp"][i, len(p):n] = np.asarray(r["logprobs"], np.float32)
        b["advantages"][i] = j.advantage
        t = float(r["temperature"])
        b["temperature"][i] = t if t > 0 else 1.0
        if routing and r["moe_layers"] > 0:
            e = np.frombuffer(r["expert_ids"], np.dtype(r["expert_dtype"])).reshape(n, r["moe_layers"], r["top_k"])
            if experts is None:
                experts = np.zeros((e.shape[1], rows, seq_len, e.shape[2]), np.int32)
            experts[:, i, :n] = e.transpose(1, 0, 2)
    b["ref_logp"] = b["behaviour_logp"].copy()
    if experts is not None:
        b["expert_ids"] = experts
    return b


def loss_fn(*, clip_low: float, clip_high: float, kl_coef: float, router_replay: bool = False,
            tis_cap: float = 0.0):
    """The trainer loss of a realtime batch (`completions_batch`): GRPO's policy loss with per-row
    temperature and the batch's normaliser (module docstring)."""

    def fn(model, batch, rng):
        del rng
        routing = batch["expert_ids"] if router_replay else None
        logits, _ = model(batch["tokens"], batch["positions"], batch["segment_ids"], routing=routing, mtp=False)
        temperature = batch["temperature"][:, None, None]
        logp, ent, valid = grpo.target_logp(logits, batch["tokens"], batch["segment_ids"], temperature)
        mask = batch["loss_mask"] * valid
        value, metrics = grpo.policy_loss(
            logp, batch["behaviour_logp"], batch["ref_logp"], batch["advantages"], mask,
            clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef,
            normalizer=jnp.max(batch["normalizer"]), entropy=ent, tis_cap=tis_cap)
        return value, metrics

    return fn


class RealtimeLearner:
    """The trainer with the realtime loss (the training side of a cycle): minibatches of the
    window, a snapshot to fall back to when the gate refuses, and the weights for the store.

    `config.realtime.steps` optimizer steps per cycle: the window's completions, put in a
    canonical order (by their prompt and completion ids: concurrent requests reach the log in
    any order, and the split must not depend on it), shuffled with the cycle's seed, split into
    that many minibatches (each used once: single epoch, the first step exactly on-policy). Each
    process trains its share of every minibatch's rows.
    """

    def __init__(self, config, stage_dir: str, init_from: str, model_fn=None, tokenizer=None):
        self.config = config
        g = config.grpo
        self.accum = int(config.train.grad_accum)
        fn = loss_fn(clip_low=float(g.clip_low), clip_high=float(g.clip_high), kl_coef=float(g.kl_coef),
                     router_replay=bool(g.router_replay), tis_cap=float(g.tis_cap))
        self.trainer = Trainer(config, stage_dir, fn, init_from=init_from, model_fn=model_fn,
                               stage="realtime", tokenizer=tokenizer)
        self.seq_len = int(config.serve.max_len) or int(config.model.max_position_embeddings)
        self.tokens_per_completion = int(config.realtime.tokens_per_completion) or int(config.serve.max_tokens)
        self.row_multiple = jax.local_device_count() * self.accum

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def model(self) -> nnx.Module:
        return self.trainer.model

    def batches(self, items: list[Joined], version: int, seed: int) -> list[dict]:
        """This process's batches of the cycle (the class docstring)."""
        items = sorted(items, key=lambda j: (list(j.record["prompt_ids"]), list(j.record["completion_ids"]),
                                             j.record["time"]))
        order = np.random.default_rng(seed).permutation(len(items))
        steps = max(1, min(int(self.config.realtime.steps), len(items)))
        procs, pid = jax.process_count(), jax.process_index()
        out = []
        for part in np.array_split(order, steps):
            mine = [items[i] for i in part[pid::procs]]
            per_proc = -(-len(part) // procs)  # every process feeds the same number of rows
            rows = max(self.row_multiple, 1 << max(0, math.ceil(math.log2(max(per_proc, 1)))))
            rows = -(-rows // self.row_multiple) * self.row_multiple
            normalizer = self.tokens_per_completion * len(part) / self.accum
            out.append(completions_batch(mine, version, self.seq_len, rows, normalizer,
                                routing=bool(self.config.grpo.router_replay)))
        return out

    def train(self, batches: list[dict]) -> dict:
        """One optimizer step per batch; the steps' metrics averaged (host floats)."""
        steps = [self.trainer.train_step(b) for b in batches]
        out = {}
        for k in steps[0]:
            vals = [np.asarray(m[k]) for m in steps]
            if vals[0].ndim == 0:
                out[k] = float(np.mean(vals))
        return out

    def snapshot(self):
        """A copy of the trainer's state (the step donates its arrays) to restore on refusal."""
        st = self.trainer.state
        copy = lambda t: jax.tree.map(jnp.copy, t)
        return dataclasses.replace(st, params=copy(st.params), rest=copy(st.rest), opt_state=copy(st.opt_state))

    def restore(self, snapshot) -> None:
        self.trainer.state = snapshot
