"""Stage `realtime`: learn from production, cycle after cycle (docs/serve.md; the math in
coder/rl/realtime.py).

    python main.py --config=configs/quickstart.py --config.stage=realtime \\
        --config.serve.weight_store=/data/weights

One cycle, once `realtime.window` seconds of serving have passed:
  1. read the window's completions from the trajectory log (`serve.log_store`, the server's) and
     the feedback received since the window began; the window ends `serve.flush_seconds` before
     now, so the servers have written every record of it;
  2. join them: completions without a signal are dropped (counted), rewards from the registry
     (`realtime.signals`);
  3. keep the tokens of the version v the learner holds and published (the stale rest counted);
  4. advantages from the leave-one-out baseline over the window;
  5. train `realtime.steps` steps of GRPO's policy loss against the logged behaviour logprobs,
     KL to v (`grpo.kl_coef`);
  6. the agent eval (coder.rl.eval.run_agent_eval) of the candidate on the held-out tasks
     (`rl.eval_tasks`) and the regression gate: refused when its pass@1 is below v's by more
     than `rl.eval_regression_margin` (v's own eval runs once, when v is first gated);
  7. passed: a checkpoint, then version v + 1 published to `serve.weight_store` (servers apply
     it in flight); refused: the learner returns to v's weights and optimizer state, nothing is
     published, and the record says why.
With `rl.eval_num_tasks = 0` the gate is off (every trained cycle is published).

The first start publishes the learner's weights (`init_from`, else the newest checkpoint of
workdir's chain, as stage serve picks it) as version 0 of an empty store (latest + 1 of a store
that has versions), and its first window is the `realtime.window` seconds before now: start the
server and this stage from the same checkpoint. `realtime.cycles` cycles (0 = forever).

Files in `{workdir}/realtime/`: `metrics.jsonl` (one record per cycle: `step` = the cycle,
`loss`, `reward`, `trajectories`, `with_signal`, `dropped_no_signal`, `broken_no_signal`, `stale`, `signals_{name}`,
`trained`, the loss metrics, `gate` = pass | fail | skipped | off, `gate_reason`,
`baseline_pass@1`, `candidate_pass@1`, `version_served`, `version_published` (-1: none),
`versions_published`), `state.json` (the committed cycle, version, learner step and the next
window's start; what a restart resumes from), `learner/checkpoints/` (the published versions'
trainer states) and `cycles/{cycle}/agent_eval/` (the gate's eval reports).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import time

import jax
import numpy as np
from etils import epath
from flax import nnx

from coder.env import transcripts
from coder.rl import actor as actor_lib
from coder.rl import eval as eval_lib
from coder.rl import realtime as realtime_lib
from coder.rl import weight_channel, weight_sync
from coder.serve import trajectory_log
from coder.stages import inherit_model_config
from coder.stages import serve as serve_stage
from coder.train.checkpoint import stage_tokenizer
from coder.train.metrics import MetricsWriter

STATE = "state.json"


def realtime_config(config):
    """The learner trains at the constant `realtime.lr` (no warmup, no decay): a cycle is a few
    steps of a loop that runs for as long as the server does."""
    c = copy.deepcopy(config)
    c.train.lr = float(c.realtime.lr)
    c.train.warmup_steps = 0
    c.train.min_lr_ratio = 1.0
    return c


def validate(config) -> None:
    """Stops at start-up on realtime keys that cannot work, naming them."""

    serve_stage.check(config)
    r = config.realtime
    if not config.serve.weight_store:
        raise ValueError("stage realtime publishes to the weight store the servers follow: set "
                         "serve.weight_store (a local path or gs://...)")
    if serve_stage.log_store(config) is None:
        raise ValueError("stage realtime reads the trajectory log: serve.log_store='none' turns it off")
    if int(r.cycles) < 0 or float(r.window) <= 0 or int(r.steps) < 1 or int(r.tokens_per_completion) < 0:
        raise ValueError(f"realtime.cycles={r.cycles} (>= 0), realtime.window={r.window} (> 0 s), "
                         f"realtime.steps={r.steps} (>= 1), realtime.tokens_per_completion="
                         f"{r.tokens_per_completion} (>= 0)")
    realtime_lib.check_signals(r.signals)
    if float(config.rl.temperature) <= 0:
        raise ValueError("rl.temperature must be > 0 (the gate's agent eval samples with it)")
    check_gate_layout(config, jax.process_count())


def check_gate_layout(config, processes: int) -> None:
    """Stops at start-up when the eval gate's engine (rl.eval_num_tasks > 0, `Loop._evaluate`)
    cannot be held, naming the keys; `processes` is the learner's process count
    (jax.process_count()). The gate's engine is `coder.rl.actor.make_engine` on this process's
    devices, given the learner's whole state (`set_weights`): over several processes every host
    would gather the whole learner onto its own devices, so that is refused; on one process the
    engine is checked against its devices' memory (coder.rl.actor.check_engine_memory)."""

    n = int(config.rl.eval_num_tasks)
    if n <= 0:
        return
    if processes > 1:
        raise ValueError(f"rl.eval_num_tasks={n} turns on the eval gate, whose engine is built on each process's own "
                         f"devices and takes the learner's whole state: on a learner of {processes} processes every "
                         "host would gather the whole model from all of them onto its devices. Set "
                         "rl.eval_num_tasks=0 (0 turns the gate off: every trained cycle is published), or run "
                         "stage realtime on one process")
    actor_lib.check_engine_devices(config, jax.local_devices())


class Loop:
    """The realtime stage's cycles (module docstring): state, learner, eval engine, store."""

    def __init__(self, config, stage_dir: str, init_from: str, *, tokenizer, model_fn=None, held_out=None,
                 make_episode=None, clock=time.time):

        validate(config)
        self.config, self.stage_dir, self.tok, self.clock = config, stage_dir, tokenizer, clock
        self.init_from = init_from  # the eval's semantic_search embeds with this policy (frozen)
        self.held_out, self.make_episode = held_out, make_episode
        self.log_url = serve_stage.log_store(config)
        self.store = config.serve.weight_store
        self.lag = float(config.serve.flush_seconds)
        self.dtype = config.serve.dtype or None
        self.state_path = epath.Path(stage_dir) / STATE
        state = self._read_state()
        learner_dir = os.path.join(stage_dir, "learner")
        if state is not None:
            _drop_uncommitted(os.path.join(learner_dir, "checkpoints"), state["step"])
        self.learner = realtime_lib.RealtimeLearner(config, learner_dir, init_from, model_fn, tokenizer)
        self.publisher = weight_channel.ModelPublisher(self.store, dtype=self.dtype)
        if state is None:  # first start: the learner's weights are the first version
            latest = weight_sync.latest_version(self.store)
            version = 0 if latest is None else latest + 1
            self._publish(version)
            state = {"cycle": 0, "version": version, "step": self.learner.step, "baseline": None,
                     "window_start": clock() - self.lag - float(config.realtime.window), "published": 0}
            self._write_state(state)
        elif state["step"] != self.learner.step:
            raise ValueError(f"[realtime] {self.state_path} says the learner is at step {state['step']} but "
                             f"its checkpoints hold step {self.learner.step}: restore that checkpoint or "
                             f"delete {stage_dir} to start over")
        self.state = state
        self.writer = MetricsWriter(stage_dir, "realtime", resume_step=state["cycle"])
        self._engine = None

    # ------------------------------------------------------------------ state and store
    def _read_state(self):
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else None

    def _write_state(self, state: dict) -> None:
        if jax.process_index() != 0:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        if "://" in str(self.state_path):  # an object store's single write is atomic
            self.state_path.write_text(json.dumps(state, indent=1))
            return
        tmp = self.state_path.parent / (STATE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.state_path)

    def _publish(self, version: int) -> dict:
        return self.publisher.publish(self.learner.trainer.model, version)

    # ------------------------------------------------------------------ the gate's eval
    def _evaluate(self, model, cycle: int, step: int) -> dict:
        if self._engine is None:
            self._engine = actor_lib.make_engine(model, self.config)
            self.held_out = actor_lib.eval_tasks(self.config) if self.held_out is None else self.held_out
            # the eval split's memory; each cycle's eval runs in a memory session of its own (coder/rl/eval.py)
            self.make_episode = self.make_episode or actor_lib.episode_factory(
                self.config, memory_dir=os.path.join(self.stage_dir, "memory"),
                eval_ids=[t.id for t in self.held_out], policy_checkpoint=self.init_from)
        self._engine.set_weights(nnx.state(model))
        return eval_lib.run_agent_eval(self.config, model, self.tok, os.path.join(self.stage_dir, "cycles", f"{cycle:06d}"),
                                       step=step, tasks=self.held_out, make_episode=self.make_episode,
                                       engine=self._engine)

    # ------------------------------------------------------------------ one cycle
    def wait(self) -> None:
        """Sleeps until the next window is complete (its end `serve.flush_seconds` in the past)."""
        end = self.state["window_start"] + float(self.config.realtime.window)
        delay = end + self.lag - self.clock()
        if delay > 0:
            logging.info("[realtime] next cycle in %.0f s", delay)
            time.sleep(delay)

    def cycle(self) -> dict:
        """One cycle over the window after `state.window_start`; returns its metrics record."""

        cfg, st = self.config, self.state
        cycle, v = st["cycle"] + 1, int(st["version"])
        start = st["window_start"]
        end = start + float(cfg.realtime.window)
        now = self.clock()
        completions = list(trajectory_log.read_completions(self.log_url, start, end))
        feedback = list(trajectory_log.read_feedback(self.log_url, start, now))
        joined, counts = realtime_lib.join(completions, feedback, cfg.realtime.signals,
                                           float(cfg.realtime.broken_call_reward))
        items, dropped = realtime_lib.select(joined, v, self.learner.seq_len)
        adv = realtime_lib.leave_one_out([j.reward for j in items])
        for j, a in zip(items, adv):
            j.advantage = float(a)
        record = {**{k: counts.get(k, 0) for k in ("trajectories", "feedback", "with_signal", "dropped_no_signal",
                                                  "broken_no_signal", "feedback_unmatched", "feedback_off")},
                  **{k: v_ for k, v_ in counts.items() if k.startswith("signals_")}, **dropped,
                  "trained": len(items), "version_served": v, "version_published": -1,
                  "window_start": start, "window_end": end,
                  "reward": float(np.mean([j.reward for j in items])) if items else float("nan"),
                  "loss": float("nan")}
        if len(items) < 2:
            record.update(gate="skipped", gate_reason=f"{len(items)} completion(s) of version {v} with a signal: "
                          "a leave-one-out baseline needs 2")
        else:
            gated = int(cfg.rl.eval_num_tasks) > 0
            t_eval = time.perf_counter()
            if gated and st["baseline"] is None:  # version v's own eval, once
                st["baseline"] = _summary(self._evaluate(self.learner.model, cycle, 0))
            t_eval = time.perf_counter() - t_eval
            t0 = time.perf_counter()
            snapshot = self.learner.snapshot()
            batches = self.learner.batches(items, v, int(cfg.seed) * 1000003 + cycle)
            metrics = self.learner.train(batches)
            record.update({k: metrics[k] for k in metrics if k not in ("skipped",)}, train_steps=len(batches))
            record["train_time_s"] = time.perf_counter() - t0
            passed, reason = True, "the gate is off (rl.eval_num_tasks = 0)"
            if gated:
                t1 = time.perf_counter()
                cand = _summary(self._evaluate(self.learner.model, cycle, 1))
                t_eval += time.perf_counter() - t1
                base = st["baseline"]
                margin = float(cfg.rl.eval_regression_margin)
                passed = not eval_lib.is_regression(base, cand, margin)
                reason = (f"pass@1 {cand['pass@1']:.3f} vs version {v}'s {base['pass@1']:.3f} "
                          f"(margin {margin:.3f})")
                record.update({"baseline_pass@1": base["pass@1"], "candidate_pass@1": cand["pass@1"],
                               "eval_time_s": t_eval})
            if passed:
                self.learner.trainer.save(force=True)
                self.learner.trainer.ckpt.wait()
                info = self._publish(v + 1)
                st.update(version=v + 1, step=self.learner.step, published=st["published"] + 1)
                if gated:
                    st["baseline"] = cand
                record.update(gate="pass" if gated else "off", gate_reason=reason, version_published=v + 1,
                              publish_bytes=info["bytes"])
                logging.info("[realtime] cycle %d: version %d published (%s)", cycle, v + 1, reason)
            else:
                self.learner.restore(snapshot)
                record.update(gate="fail", gate_reason=f"refused: {reason}; version {v} stays served")
                logging.warning("[realtime] cycle %d: the gate refused the update: %s", cycle, record["gate_reason"])
        st.update(cycle=cycle, window_start=end)
        self._write_state(st)
        record["versions_published"] = st["published"]
        self.writer.write(cycle, record)
        return record

    def close(self) -> None:
        self.learner.trainer.close()
        self.writer.close()
        if self._engine is not None:
            self._engine.close()


def _summary(result: dict) -> dict:
    return {k: v for k, v in result.items() if k.startswith("pass@")}


def _drop_uncommitted(directory: str, step: int) -> None:
    """Deletes trainer checkpoints past the committed step (a cycle interrupted between its
    checkpoint and its state.json was never published)."""
    d = epath.Path(directory)
    if jax.process_index() != 0 or not d.exists():
        return
    for p in d.iterdir():
        if p.name.isdigit() and int(p.name) > step:
            logging.warning("[realtime] deleting the uncommitted checkpoint %s", p)
            p.rmtree()


def train(config, stage_dir: str, init_from: str, *, tokenizer, model_fn=None, held_out=None, make_episode=None,
          clock=time.time) -> str:
    """`realtime.cycles` cycles (0 = forever); returns the learner's checkpoint directory.

    `held_out` / `make_episode`: the gate's eval tasks and episodes (default `rl.eval_tasks` in
    sandboxes); `model_fn` builds the initial model instead of `init_from`; `clock` is the wall
    clock (tests move it to close a window at once)."""
    loop = Loop(config, stage_dir, init_from, tokenizer=tokenizer, model_fn=model_fn, held_out=held_out,
                make_episode=make_episode, clock=clock)
    cycles = int(config.realtime.cycles)
    try:
        done = 0
        while cycles == 0 or done < cycles:
            loop.wait()
            loop.cycle()
            done += 1
    finally:
        loop.close()
    return loop.learner.trainer.checkpoint_dir


def run(config, stage_dir: str, init_from: str) -> str:
    """Stage `realtime`: from `init_from` (else workdir's newest checkpoint, as stage serve)."""

    path = serve_stage.served_checkpoint(config, init_from)
    if path != init_from:
        config = inherit_model_config(config, path)
    tok = stage_tokenizer(config, path, os.path.join(stage_dir, "learner"),  # a resumed learner's, else path's
                          agent_text=transcripts.tokenizer_agent_text)
    return train(config, stage_dir, path, tokenizer=tok)
