"""Agent eval: pass@1 and pass@k on held-out tasks, one report per checkpoint, regression flag.

For each task, n = `rl.eval_samples` rollouts (one engine group, same sampling as training) of
which c are correct (all hidden tests pass). The unbiased estimator of Chen et al. (2021),

    pass@k = 1 - C(n - c, k) / C(n, k)       averaged over tasks,

is computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i) (no huge binomials). Rollouts lost to an
infrastructure failure are left out of n for their task; a task with fewer than k valid
rollouts does not count towards pass@k.

best-of-K (`best_of_k`): the mean over tasks of the best test reward (fraction of hidden tests
passed) among K attempts. Both are also reported per task category (coder.env.suite: feature,
bug, noisy-context, ...), the CursorBench-like suite's breakdown.

Memory (the memory_read / memory_write tools, when rl.tools offers them): every eval runs in a
memory session of its own (coder.env.tools.memory.in_session, named in the report's `memory_session`):
it starts from an empty memory, its rollouts' notes carry from one task to the next within it,
and no later eval and no training rollout reads them, so the evals before and after training
(and realtime's gate cycles) compare agents that start from the same memory.

Reports: `{stage_dir}/agent_eval/step_{step:08d}.json` (local or an fsspec URL) with the summary,
the per-category summaries, and every task's counts, finish reasons, broken calls and the text of its first rollout
(`transcript_text`). A checkpoint whose pass@1 is below the previous report's by more than
`rl.eval_regression_margin` is flagged (`regressed` in the report and the returned dict, and a
warning in the log).
"""
from __future__ import annotations

import json
import logging
import os
import time

import fsspec
import jax
import numpy as np

from coder.env.tools import memory as memory_lib
from coder.env.suite import category_of
from coder.rl import actor as stage_lib


def _gather(records: list) -> list:
    """Every process's JSON-able records, concatenated (the records themselves when alone)."""
    if jax.process_count() == 1:
        return records
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(records).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(data.size))
    padded = np.zeros((int(np.max(sizes)),), np.uint8)
    padded[:data.size] = data
    everyone = multihost_utils.process_allgather(padded)
    return [r for row, n in zip(everyone, sizes) for r in json.loads(bytes(row[:int(n)]).decode())]


def memory_session(name: str, step: int, alone: bool) -> str:
    """A fresh memory session for one eval (module docstring): `{name}-step_{step}-{nonce}`, the
    nonce process 0's when the job's processes evaluate together (one session for all)."""
    nonce = np.frombuffer(os.urandom(4), np.uint32)
    if jax.process_count() > 1 and not alone:
        from jax.experimental import multihost_utils

        nonce = multihost_utils.broadcast_one_to_all(nonce)
    return f"{name}-step_{int(step):08d}-{int(np.asarray(nonce)[0]):08x}"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (requires k <= n)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def summarize(counts: list[tuple[int, int]], ks) -> dict:
    """counts [(n valid, c correct)] per task -> {"pass@k": mean over tasks with n >= k}."""
    out = {}
    for k in ks:
        vals = [pass_at_k(n, c, k) for n, c in counts if n >= k]
        out[f"pass@{k}"] = float(np.mean(vals)) if vals else float("nan")
    return out


def best_of_k(rewards: list[list[float]], k: int) -> float:
    """Mean over tasks of the best test reward (the fraction of hidden tests passed) among
    each task's first k valid rollouts: what picking the best of k attempts would score with
    partial credit (pass@k counts a task only when one attempt passes every test). Tasks with
    fewer than k rollouts do not count; nan when none has k."""
    vals = [max(r[:k]) for r in rewards if len(r) >= k]
    return float(np.mean(vals)) if vals else float("nan")


def by_category(per_task: list[dict], ks) -> dict:
    """{category: {"num_tasks", "pass@k"..., "best_of_k"...}} of per-task report entries
    (each with "category", "n", "correct", "rewards")."""
    out = {}
    for cat in sorted({t["category"] for t in per_task}):
        ts = [t for t in per_task if t["category"] == cat]
        out[cat] = {"num_tasks": len(ts), **summarize([(t["n"], t["correct"]) for t in ts], ks),
                    **{f"best_of_{k}": best_of_k([t["rewards"] for t in ts], k) for k in ks}}
    return out


def is_regression(previous: dict, current: dict, margin: float) -> bool:
    """pass@1 fell by more than `margin` (absolute) from the previous report."""
    a, b = previous.get("pass@1", float("nan")), current.get("pass@1", float("nan"))
    return bool(np.isfinite(a) and np.isfinite(b) and a - b > margin)


def previous_report(report_dir: str, step: int) -> dict | None:
    """The latest report of a step before `step` in `report_dir` (a local path or fsspec URL),
    or None."""
    fs, root = fsspec.core.url_to_fs(report_dir)
    paths = sorted(fs.glob(root.rstrip("/") + "/step_*.json"))
    best = None
    for p in paths:
        s = int(p.rsplit("/", 1)[-1][5:-5])
        if s < step:
            best = p
    if best is None:
        return None
    return json.loads(fs.cat_file(best))


def transcript_text(rollout, tokenizer, limit: int = 4000) -> str:
    """What a person reads of a rollout: each context window's text from its first sampled token
    on (the agent's turns and the tool results), windows separated by a marker, cut to `limit`
    characters (the head and the tail kept)."""
    parts = []
    for g in rollout.generations:
        first = next((i for i, p in enumerate(g.policy) if p), None)
        if first is not None:
            # ids past the tokenizer's vocabulary (the embedding's padding rows) have no text
            parts.append(tokenizer.decode([int(t) for t in g.tokens[first:] if int(t) < tokenizer.vocab_size]))
    text = "\n[... new context window ...]\n".join(parts)
    if len(text) > limit:
        text = text[:limit // 2] + "\n[...]\n" + text[-limit // 2:]
    return text


def report_path(report_dir: str, step: int) -> str:
    return os.path.join(report_dir, f"step_{step:08d}.json")


def write_report(report_dir: str, step: int, report: dict) -> str:
    """Writes `report` to `{report_dir}/step_{step:08d}.json` (a local path or fsspec URL: a
    `gs://` stage dir writes to the bucket, not to a local directory named `gs:`); its path."""
    fs, root = fsspec.core.url_to_fs(report_dir)
    fs.makedirs(root, exist_ok=True)
    with fs.open(report_path(root.rstrip("/"), step), "w") as f:
        json.dump(report, f, indent=1)
    return report_path(report_dir, step)


def run_agent_eval(config, model, tokenizer, stage_dir: str, *, step: int = 0, tasks=None,
                   make_episode=None, engine=None, actor=None, name: str = "agent_eval",
                   alone: bool = False, policy_checkpoint: str = "") -> dict:
    """Evaluates `model` as an agent on held-out tasks; writes the report; returns the summary.

    Args:
      config: the run config (`rl` section: eval_tasks, eval_num_tasks, eval_samples, eval_k,
        eval_regression_margin, and the rollout keys).
      model: the nnx model to evaluate (not modified).
      tokenizer: coder.data.tokenizer.Tokenizer.
      stage_dir: reports go to `{stage_dir}/{name}/` (`agent_eval`: the held-out tasks;
        stage grpo's `agent_eval_trained`: its own training tasks, rl.eval_trained).
      step: the checkpoint's step (names the report).
      tasks: held-out `Task`s (default: `coder.rl.actor.eval_tasks(config)`).
      make_episode: `task -> episode` (default: `coder.rl.actor.episode_factory(config)`, a
        sandboxed coder.env Episode with config.env's limits and the agent memory of
        `{stage_dir}/memory`, every task of the eval split, and semantic_search embedding with
        `policy_checkpoint`'s trunk when env.semantic_encoder is "policy").
      engine: an existing Engine holding `model`'s weights (default: a new one).
      actor: an existing coder.rl.actor.Actor over that engine (its env workers reused; default:
        one made here and closed after). It rolls out this process's tasks together, each task's
        n samples one engine group (concurrently with rl.concurrent, as training does).
      alone: this process evaluates every task (the leader of an engine over the job's
        processes: a colocated GRPO run's process 0); default: each process of the job its share.
    Returns:
      {"pass@k" for k in rl.eval_k, "num_tasks", "infra_failures", "regressed", "report"}.
    """
    rl = config.rl
    ks = tuple(sorted({1, *(int(k) for k in rl.eval_k)}))  # pass@1 always: the regression check
    if max(ks) > int(rl.eval_samples):
        raise ValueError(f"rl.eval_k={ks} needs rl.eval_samples >= {max(ks)}")
    tasks = stage_lib.eval_tasks(config) if tasks is None else tasks
    own_actor = actor is None
    if own_actor:
        engine = engine or stage_lib.make_engine(model, config)
        # the default episodes keep their memory in {stage_dir}/memory, all of it the eval split
        make_episode = make_episode or stage_lib.episode_factory(
            config, memory_dir=os.path.join(stage_dir, "memory"), eval_ids=[t.id for t in tasks],
            policy_checkpoint=policy_checkpoint)
        actor = stage_lib.Actor(engine, tokenizer, config, make_episode)
    rng = jax.random.fold_in(jax.random.key(int(config.seed) + 1), step)
    t0 = time.perf_counter()
    processes, pid = (1, 0) if alone else (jax.process_count(), jax.process_index())
    mine = [i for i in range(len(tasks)) if i % processes == pid]  # each process evaluates its share
    # the eval's own memory, empty at its start (module docstring); a task that names a session
    # is prepared again (its key changes), so only when the agent has the memory tools
    session = memory_session(name, step, alone) if stage_lib.offers(rl, "memory_read", "memory_write") else ""
    rolled = memory_lib.in_session(tasks, session) if session else tasks
    try:
        groups = actor.collect([rolled[i] for i in mine], rng, group_size=int(rl.eval_samples),
                               keys=[jax.random.fold_in(rng, i) for i in mine])
    finally:
        if own_actor:
            actor.close()
    per_task = []
    for i, rollouts in zip(mine, groups):
        valid = [r for r in rollouts if not r.infra_error]
        per_task.append({"index": i, "id": tasks[i].id, "category": category_of(tasks[i]),
                         "n": len(valid), "correct": int(sum(r.correct for r in valid)),
                         "rewards": [float(r.test_reward) for r in valid],
                         "mean_test_reward": float(np.mean([r.test_reward for r in valid])) if valid else None,
                         "infra_failures": len(rollouts) - len(valid),
                         "finish": [r.finish for r in rollouts], "broken_calls": [r.broken_calls for r in rollouts],
                         "sample": transcript_text(rollouts[0], tokenizer) if rollouts else ""})
    per_task = sorted(per_task if alone else _gather(per_task), key=lambda t: t.pop("index"))
    counts = [(t["n"], t["correct"]) for t in per_task]
    infra = sum(t["infra_failures"] for t in per_task)
    summary = summarize(counts, ks)
    summary.update({f"best_of_{k}": best_of_k([t["rewards"] for t in per_task], k) for k in ks})
    categories = by_category(per_task, ks)
    report_dir = os.path.join(stage_dir, name)
    prev = previous_report(report_dir, step)
    margin = float(rl.eval_regression_margin)
    regressed = prev is not None and is_regression(prev["summary"], summary, margin)
    if regressed:
        logging.warning("agent eval at step %d: pass@1 %.3f regressed from %.3f (step %d) by more than %.3f",
                        step, summary["pass@1"], prev["summary"]["pass@1"], prev["step"], margin)
    path = report_path(report_dir, step)
    if jax.process_index() != 0:  # every process has the same summary; process 0 writes it
        return {**summary, "num_tasks": len(tasks), "infra_failures": infra, "regressed": regressed, "report": path}
    report = {"step": step, "summary": summary, "categories": categories, "num_tasks": len(tasks),
              "samples": int(rl.eval_samples), "memory_session": session or None,
              "infra_failures": infra, "regressed": regressed,
              "previous_step": None if prev is None else prev["step"], "tasks": per_task,
              "time_s": time.perf_counter() - t0}
    write_report(report_dir, step, report)
    return {**summary, "num_tasks": len(tasks), "infra_failures": infra, "regressed": regressed, "report": path}
