"""N sandboxed episodes in parallel worker processes, so rollouts do not queue behind one.

Batch commands (scripted agents, checks, SFT transcripts):

    pool = EpisodePool(4, token_count=count_fn, limits=...)   # Episode keyword arguments
    obs = pool.reset([(key, task, snapshot_or_None), ...])     # new episodes, by caller's keys
    outs = pool.step([(key, model_text), ...])                # [(observation, done, info), ...]
    pool.map(fn, items)                                       # any picklable fn, spread over workers
    pool.close()

A batch is sent to all workers at once and each worker runs its share in order, so a batch of G
steps takes about G / N sandbox commands of wall time.

Per-call commands (the RL agent, one thread per rollout; `PooledEpisode` wraps them in the
episode interface of coder/rl/agent.py):

    pool.open(key, task)                        # a new episode on the least loaded worker
    out = pool.call(key, tool_call)             # one protocol.ToolCall -> output text
    outs = pool.call_many(key, tool_calls)      # one turn: Episode.call_many in the worker
    pool.done(key); pool.lint_count(key); reward, info = pool.score(key)
    pool.close_episode(key)

They are thread-safe: a call goes to the worker that owns the episode; calls from different
threads to different workers run in parallel, calls to one worker are serialized (each worker
runs one command at a time). A harness failure raises `InfraError`; so does every call of an
episode whose worker died (the worker is restarted for new episodes), and a command that takes
longer than `timeout_s` (the worker is then killed).

Each episode lives in one worker (the least loaded when it starts). Workers are started with
`spawn`: the parent may be a JAX process, and forking a process that runs threads is unsafe. In
the batch commands a worker that dies turns its episodes' results into `infra_error` infos (the
RL loop masks them), never into zero rewards.

Where the workers run is the backend, `env.workers_backend` (checked by `check_config`; RL
builds either with `coder.rl.actor.EpisodeFactory.pool`): "local", processes of this host (this
module); "ray", Ray actors on the cluster's CPU nodes (coder/env/ray_pool.py, this pool over
another worker transport). Both run `run_command`, the worker's side of every command, so an
episode behaves the same in either.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import traceback
import uuid

from coder.env.runtime import installed
from coder.env.episode import Episode, select_tools
from coder.env.runtime.sandbox import InfraError
from coder.env.scoring.verdicts import Claim, SharedVerdicts

BACKENDS = ("local", "ray")  # env.workers_backend


def check_config(env_cfg) -> None:
    """Stops at start-up on env worker keys that cannot work, naming them."""
    if env_cfg.workers_backend not in BACKENDS:
        raise ValueError(
            f"env.workers_backend={env_cfg.workers_backend!r}: choose one of {BACKENDS} ('local': "
            "processes of this host; 'ray': Ray actors on the cluster's CPU nodes)"
        )
    if float(env_cfg.ray_num_cpus_per_worker) <= 0:
        raise ValueError(
            f"env.ray_num_cpus_per_worker={env_cfg.ray_num_cpus_per_worker} must be > 0 (the "
            "CPUs Ray reserves for each env worker actor)"
        )


def run_command(episodes: dict, episode_kwargs: dict, cmd: str, batch: list) -> list:
    """The worker's side of one pool command over a batch of items, in order.

    `episodes` (key -> Episode) is the worker's state, updated in place; each item's result, or
    a `Failure` in its slot (one broken episode does not fail the others of the batch). Run by
    the local worker processes here and by the Ray actors of coder/env/ray_pool.py.
    """
    out = []
    for item in batch:
        try:
            if cmd in ("reset", "open"):
                key, task, snap = item
                if key in episodes:
                    episodes.pop(key).close()
                ep = Episode(**episode_kwargs)
                episodes[key] = ep
                out.append(ep.reset(task, snap))
            elif cmd == "step":
                key, text = item
                ep = episodes[key]
                obs, done, info = ep.step(text)
                if done:
                    episodes.pop(key).close()
                    info["messages"] = ep.messages
                out.append((obs, done, info))
            elif cmd == "call":
                key, call = item
                ep = episodes[key]
                out.append((ep.call(call), ep.done))
            elif cmd == "calls":
                key, calls = item
                ep = episodes[key]
                out.append((ep.call_many(calls), ep.done))
            elif cmd == "lint":
                out.append(episodes[item].lint_count())
            elif cmd == "score":
                out.append(episodes[item].score())
            elif cmd == "digest":
                out.append(episodes[item].scoring_digest())
            elif cmd == "score_with":  # (key, verdict or None) -> (reward, info, the verdict)
                key, verdict = item
                ep = episodes[key]
                out.append((*ep.score(verdict), ep.verdict))
            elif cmd == "map":
                fn, x = item
                out.append(fn(x))
            elif cmd in ("drop", "close"):
                if item in episodes:
                    episodes.pop(item).close()
                out.append(None)
            else:
                raise ValueError(f"unknown pool command {cmd!r}")
        except Exception as e:  # noqa: BLE001 - reported in the item's slot, the worker lives on
            out.append(Failure(traceback.format_exc(limit=8), f"{type(e).__name__}: {e}"))
    return out


def warm_up() -> None:
    """Fills the per-process caches every episode's sandbox reads (the library directories,
    `installed.library_dirs`: a walk of /usr, 0.2 s on a quiet machine and seconds on a loaded
    one) before a new worker takes commands, so a command's `timeout_s` measures the command,
    not the worker's first-use costs."""
    installed.library_dirs()


def close_episodes(episodes: dict) -> None:
    """Closes a worker's episodes (their sandboxes) when it stops."""
    for ep in episodes.values():
        ep.close()
    episodes.clear()


def _worker(conn, episode_kwargs: dict) -> None:
    warm_up()
    episodes: dict = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        cmd, batch = msg
        if cmd == "stop":
            break
        conn.send(run_command(episodes, episode_kwargs, cmd, batch))
    close_episodes(episodes)
    conn.close()


class Failure:
    """An item's command failed in its worker: its slot in the batch's results."""

    def __init__(self, tb: str, message: str = ""):
        self.tb, self.message = tb, message or tb


class WorkerLost(Exception):
    """A worker is gone (its process exited, its Ray actor died): the command's result is lost."""


class _Worker:
    """One local worker process and its pipe: a worker as the pool drives it.

    The pool's side of a worker (the Ray backend's `coder.env.ray_pool._RayWorker` has the same):
    `name` (in errors), `lock` (serializes its commands), `epoch` (incremented at each (re)start:
    episodes of an older epoch are lost), `dead`; `start()`, `kill()`, `alive()`, `send(cmd,
    batch)` and `recv(timeout_s)` (raise `WorkerLost`; `recv` raises TimeoutError when no result
    came in `timeout_s`, None = wait), `stop()` then `join()` at close.
    """

    def __init__(self, ctx, episode_kwargs: dict, index: int):
        self.ctx, self.episode_kwargs = ctx, episode_kwargs
        self.name = f"env worker {index}"
        self.lock = threading.Lock()
        self.epoch = 0
        self.conn = self.proc = None
        self.start()

    def start(self) -> None:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(child, self.episode_kwargs), daemon=True)
        p.start()
        child.close()
        self.conn, self.proc = parent, p
        self.epoch += 1
        self.dead = False

    def kill(self) -> None:
        """Marks the worker dead and makes sure its process is gone (under `lock`)."""
        self.dead = True
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(timeout=10)
        try:
            self.conn.close()
        except OSError:
            pass

    def alive(self) -> bool:
        return self.proc.is_alive()

    def send(self, cmd: str, batch: list) -> None:
        try:
            self.conn.send((cmd, batch))
        except (OSError, ValueError) as e:
            raise WorkerLost(f"{type(e).__name__}: {e}") from e

    def recv(self, timeout_s: float | None) -> list:
        try:
            ready = timeout_s is None or self.conn.poll(timeout_s)
            out = self.conn.recv() if ready else None
        except (EOFError, OSError, ValueError) as e:
            raise WorkerLost(f"{type(e).__name__}: {e}") from e
        if not ready:
            raise TimeoutError(f"{self.name}: no result in {timeout_s} s")
        return out

    def stop(self) -> None:
        try:
            self.conn.send(("stop", None))
        except (OSError, ValueError):
            pass

    def join(self) -> None:
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


class EpisodePool:
    def __init__(self, n_workers: int, timeout_s: float | None = None, *, share_verdicts: bool = True,
                 **episode_kwargs):
        if "token_count" not in episode_kwargs:
            raise TypeError("EpisodePool needs token_count= (a picklable str -> int function)")
        if n_workers < 1:
            raise ValueError(f"EpisodePool: n_workers={n_workers}, need at least one")
        self.tools = select_tools(episode_kwargs.get("tools", ()))  # unknown names fail here
        self.episode_kwargs = episode_kwargs
        self.timeout_s = timeout_s
        self.n = n_workers
        self._workers = [self._new_worker(i) for i in range(n_workers)]
        self._mu = threading.Lock()  # guards the bookkeeping below
        self._owner: dict = {}  # episode key -> worker index
        self._epoch: dict = {}  # episode key -> its worker's epoch when it started
        self._done: dict = {}  # episode key -> the episode reported itself done (per-call path)
        self._rr = 0
        # one test run per distinct workspace (coder/env/scoring/verdicts.py; env.share_verdicts)
        self.verdicts = SharedVerdicts() if share_verdicts else None

    def _new_worker(self, index: int):
        """Worker `index`, started (the backend: a local process here)."""
        return _Worker(mp.get_context("spawn"), self.episode_kwargs, index)

    def _restart_if_dead(self, worker) -> None:
        """Under `worker.lock`: a worker found dead, or gone since its last command, is
        replaced by a fresh one (a new epoch: its episodes stay lost)."""
        if worker.dead or not worker.alive():
            worker.kill()
            worker.start()

    # --- batch commands -------------------------------------------------------------------
    def _run(self, cmd: str, per_worker: dict[int, list]) -> dict[int, list]:
        ws = sorted(w for w, batch in per_worker.items() if batch)
        for w in ws:  # in index order: no deadlock with another batch
            self._workers[w].lock.acquire()
        try:
            sent, out = [], {}
            for w in ws:  # all sent first: the workers run their shares at once
                try:
                    self._workers[w].send(cmd, per_worker[w])
                    sent.append(w)
                except WorkerLost as e:
                    out[w] = [Failure(f"{self._workers[w].name} died: {e}")] * len(per_worker[w])
                    self._workers[w].dead = True
            for w in sent:
                try:
                    out[w] = self._workers[w].recv(None)
                except WorkerLost as e:
                    out[w] = [Failure(f"{self._workers[w].name} died: {e}")] * len(per_worker[w])
                    self._workers[w].dead = True
            return out
        finally:
            for w in ws:
                self._workers[w].lock.release()

    def _scatter(self, cmd: str, items: list, workers: list[int]) -> list:
        per: dict[int, list] = {w: [] for w in range(self.n)}
        slots = []
        for item, w in zip(items, workers, strict=True):
            slots.append((w, len(per[w])))
            per[w].append(item)
        res = self._run(cmd, per)
        return [res[w][i] for w, i in slots]

    def _least_loaded(self, load: list[int]) -> int:
        return min(range(self.n), key=lambda i: (load[i], (i - self._rr) % self.n))

    def _load(self) -> list[int]:
        load = [0] * self.n
        for w in self._owner.values():
            load[w] += 1
        return load

    def reset(self, items: list[tuple]) -> list[str]:
        """items: (key, task, snapshot or None). Returns each episode's first observation."""
        with self._mu:
            load = self._load()
            workers = []
            for key, _, _ in items:
                w = self._owner.get(key)
                if w is None:
                    w = self._least_loaded(load)
                    load[w] += 1
                    self._owner[key] = w
                workers.append(w)
            self._rr = (self._rr + 1) % self.n
        for w in set(workers):
            with self._workers[w].lock:
                self._restart_if_dead(self._workers[w])
        with self._mu:
            for (key, _, _), w in zip(items, workers):
                self._epoch[key] = self._workers[w].epoch
        outs = self._scatter("reset", list(items), workers)
        for o in outs:
            if isinstance(o, Failure):
                raise RuntimeError(f"episode reset failed in a worker:\n{o.tb}")
        return outs

    def step(self, items: list[tuple]) -> list[tuple[str, bool, dict]]:
        """items: (key, model_text). Finished episodes are dropped from their worker."""
        with self._mu:
            workers = [self._owner[k] for k, _ in items]
        outs = self._scatter("step", list(items), workers)
        result = []
        for (key, _), o in zip(items, outs, strict=True):
            if isinstance(o, Failure):
                o = (
                    "",
                    True,
                    {
                        "infra_error": f"pool worker: {o.tb}",
                        "done_reason": "infra_error",
                        "reward": None,
                    },
                )
            if o[1]:
                with self._mu:
                    self._forget(key)
            result.append(o)
        return result

    def drop(self, keys: list) -> None:
        with self._mu:
            workers = [self._owner[k] for k in keys]
            for k in keys:
                self._forget(k)
        self._scatter("drop", list(keys), workers)

    def map(self, fn, items: list) -> list:
        """[fn(x) for x in items] across the workers (fn must be picklable, e.g. top-level)."""
        outs = self._scatter(
            "map", [(fn, x) for x in items], [i % self.n for i in range(len(items))]
        )
        for o in outs:
            if isinstance(o, Failure):
                raise RuntimeError(f"pool map failed in a worker:\n{o.tb}")
        return outs

    # --- per-call commands ----------------------------------------------------------------
    def _forget(self, key) -> None:
        self._owner.pop(key, None)
        self._epoch.pop(key, None)
        self._done.pop(key, None)

    def _request(self, w: int, epoch: int | None, cmd: str, item, what: str):
        """One command to worker `w`, under its lock; `epoch`: the episode's (None: any)."""
        worker = self._workers[w]
        with worker.lock:
            name = worker.name
            if epoch is not None and (worker.dead or worker.epoch != epoch):
                raise InfraError(f"{name} died: {what} is lost")
            try:
                worker.send(cmd, [item])
                (out,) = worker.recv(self.timeout_s)
            except WorkerLost as e:
                worker.kill()
                raise InfraError(f"{name} died during {what}: {e}") from e
            except TimeoutError:
                worker.kill()
                raise InfraError(f"{name}: {what} took more than {self.timeout_s} s "
                                 "(worker killed)") from None
        if isinstance(out, Failure):
            raise InfraError(f"{what} failed in {name}: {out.message}")
        return out

    def _route(self, key) -> tuple[int, int]:
        with self._mu:
            if key not in self._owner:
                raise InfraError(f"no episode {key!r} in the pool")
            return self._owner[key], self._epoch[key]

    def open(self, key, task, snapshot=None) -> str:
        """Starts episode `key` of `task` on the least loaded worker (a dead one is restarted
        first); returns the user prompt. Raises InfraError when the worker fails."""
        with self._mu:
            if key in self._owner:
                raise ValueError(f"episode {key!r} is already open")
            w = self._least_loaded(self._load())
            self._rr = (self._rr + 1) % self.n
            self._owner[key] = w
            self._epoch[key] = -1  # not started yet
        try:
            with self._workers[w].lock:
                self._restart_if_dead(self._workers[w])
                epoch = self._workers[w].epoch
            with self._mu:
                self._epoch[key] = epoch
            return self._request(w, epoch, "open", (key, task, snapshot), f"episode {key!r}: open")
        except BaseException:
            with self._mu:
                self._forget(key)
            raise

    def call(self, key, tool_call) -> str:
        """Runs one parsed `protocol.ToolCall` in episode `key`; returns its output text."""
        w, epoch = self._route(key)
        out, done = self._request(w, epoch, "call", (key, tool_call), f"episode {key!r}: {tool_call.name}")
        with self._mu:
            self._done[key] = bool(done)
        return out

    def call_many(self, key, tool_calls) -> list[str]:
        """Runs one turn's `protocol.ToolCall`s in episode `key` (`Episode.call_many`: the
        independent ones concurrently, in its worker); their outputs in call order."""
        w, epoch = self._route(key)
        what = f"episode {key!r}: {','.join(c.name for c in tool_calls)}"
        out, done = self._request(w, epoch, "calls", (key, list(tool_calls)), what)
        with self._mu:
            self._done[key] = bool(done)
        return out

    def done(self, key) -> bool:
        """The episode ended (`submit`), as its last call reported."""
        with self._mu:
            return self._done.get(key, False)

    def lint_count(self, key) -> int:
        w, epoch = self._route(key)
        return self._request(w, epoch, "lint", key, f"episode {key!r}: lint")

    def score(self, key) -> tuple[float, dict]:
        """`Episode.score()` of episode `key`: (test reward, info). With shared verdicts, an
        episode whose scoring digest was scored already (or is being scored by another thread,
        which it waits for) gets that verdict without a test run; `info["verdict_shared"]` says
        which it was."""
        w, epoch = self._route(key)
        what = f"episode {key!r}: score"
        if self.verdicts is None:
            reward, info, _ = self._request(w, epoch, "score_with", (key, None), what)
            return reward, dict(info, verdict_shared=False)
        digest = self._request(w, epoch, "digest", key, f"episode {key!r}: scoring digest")
        with self.verdicts.slot(digest) as slot:
            reward, info, verdict = self._request(w, epoch, "score_with", (key, slot.verdict), what)
            slot.offer(verdict)
        return reward, dict(info, verdict_shared=slot.claim is Claim.REUSE)

    def close_episode(self, key) -> None:
        """Closes episode `key` (its sandbox); a lost or unknown episode is just forgotten."""
        with self._mu:
            if key not in self._owner:
                return
            w, epoch = self._owner[key], self._epoch[key]
            self._forget(key)
        try:
            self._request(w, epoch, "close", key, f"episode {key!r}: close")
        except InfraError:
            pass  # the worker is gone, and the sandbox with it

    # --- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the workers (each closes its episodes' sandboxes); a second call does nothing."""
        for wk in self._workers:
            wk.stop()
        for wk in self._workers:
            wk.join()
        self._workers = []

    def __enter__(self) -> "EpisodePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PooledEpisode:
    """The episode interface of coder/rl/agent.py over an episode living in a pool worker.

    An episode that cannot start (its worker failed) does not raise here: every later call
    raises `InfraError`, so the rollout is masked, never scored as the agent's failure.
    """

    def __init__(self, pool: EpisodePool, task, key=None, snapshot=None):
        self.pool, self.task = pool, task
        self.key = key if key is not None else uuid.uuid4().hex
        self.tools = pool.tools
        self.error = ""
        try:
            pool.open(self.key, task, snapshot)
        except InfraError as e:
            self.error = str(e)

    def _check(self) -> None:
        if self.error:
            raise InfraError(self.error)

    @property
    def done(self) -> bool:
        return self.pool.done(self.key)

    def call(self, tool_call) -> str:
        self._check()
        return self.pool.call(self.key, tool_call)

    def call_many(self, tool_calls) -> list[str]:
        self._check()
        return self.pool.call_many(self.key, tool_calls)

    def lint_count(self) -> int:
        self._check()
        return self.pool.lint_count(self.key)

    def score(self) -> tuple[float, dict]:
        self._check()
        return self.pool.score(self.key)

    def close(self) -> None:
        self.pool.close_episode(self.key)
