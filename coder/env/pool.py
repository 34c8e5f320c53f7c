"""N sandboxed episodes in parallel worker processes, so rollouts do not queue behind one.

    pool = EpisodePool(4, token_count=count_fn, limits=...)   # Episode keyword arguments
    obs = pool.reset([(key, task, snapshot_or_None), ...])     # new episodes, by caller's keys
    outs = pool.step([(key, model_text), ...])                # [(observation, done, info), ...]
    pool.map(fn, items)                                       # any picklable fn, spread over workers
    pool.close()

Each episode lives in one worker (the least loaded at its reset); a batch is sent to all
workers at once and each worker runs its share in order, so a batch of G steps takes about
G / N sandbox commands of wall time. Workers are started with `spawn`: the parent may be a JAX
process, and forking a process that runs threads is unsafe. A worker that dies turns its
episodes' results into `infra_error` infos (the RL loop masks them), never into zero rewards.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

from coder.env.episode import Episode


def _worker(conn, episode_kwargs: dict) -> None:
    episodes: dict = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        cmd, batch = msg
        if cmd == "stop":
            break
        out = []
        for item in batch:
            try:
                if cmd == "reset":
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
                elif cmd == "map":
                    fn, x = item
                    out.append(fn(x))
                elif cmd == "drop":
                    if item in episodes:
                        episodes.pop(item).close()
                    out.append(None)
            except Exception:
                out.append(_Failure(traceback.format_exc(limit=8)))
        conn.send(out)
    for ep in episodes.values():
        ep.close()
    conn.close()


class _Failure:
    def __init__(self, tb: str):
        self.tb = tb


class EpisodePool:
    def __init__(self, n_workers: int, **episode_kwargs):
        if "token_count" not in episode_kwargs:
            raise TypeError("EpisodePool needs token_count= (a picklable str -> int function)")
        ctx = mp.get_context("spawn")
        self.n = n_workers
        self._conns, self._procs = [], []
        for _ in range(n_workers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, episode_kwargs), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._owner: dict = {}  # episode key -> worker index
        self._rr = 0

    def _run(self, cmd: str, per_worker: dict[int, list]) -> dict[int, list]:
        sent = []
        for w, batch in per_worker.items():
            if batch:
                self._conns[w].send((cmd, batch))
                sent.append(w)
        out = {}
        for w in sent:
            try:
                out[w] = self._conns[w].recv()
            except (EOFError, OSError):
                out[w] = [_Failure(f"worker {w} died")] * len(per_worker[w])
        return out

    def _scatter(self, cmd: str, items: list, workers: list[int]) -> list:
        per: dict[int, list] = {w: [] for w in range(self.n)}
        slots = []
        for item, w in zip(items, workers, strict=True):
            slots.append((w, len(per[w])))
            per[w].append(item)
        res = self._run(cmd, per)
        return [res[w][i] for w, i in slots]

    def reset(self, items: list[tuple]) -> list[str]:
        """items: (key, task, snapshot or None). Returns each episode's first observation."""
        load = [0] * self.n
        for w in self._owner.values():
            load[w] += 1
        workers = []
        for key, _, _ in items:
            w = self._owner.get(key)
            if w is None:
                w = min(range(self.n), key=lambda i: (load[i], (i - self._rr) % self.n))
                load[w] += 1
                self._owner[key] = w
            workers.append(w)
        self._rr = (self._rr + 1) % self.n
        outs = self._scatter("reset", list(items), workers)
        for o in outs:
            if isinstance(o, _Failure):
                raise RuntimeError(f"episode reset failed in a worker:\n{o.tb}")
        return outs

    def step(self, items: list[tuple]) -> list[tuple[str, bool, dict]]:
        """items: (key, model_text). Finished episodes are dropped from their worker."""
        outs = self._scatter("step", list(items), [self._owner[k] for k, _ in items])
        result = []
        for (key, _), o in zip(items, outs, strict=True):
            if isinstance(o, _Failure):
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
                self._owner.pop(key, None)
            result.append(o)
        return result

    def drop(self, keys: list) -> None:
        self._scatter("drop", list(keys), [self._owner.pop(k) for k in keys])

    def map(self, fn, items: list) -> list:
        """[fn(x) for x in items] across the workers (fn must be picklable, e.g. top-level)."""
        outs = self._scatter(
            "map", [(fn, x) for x in items], [i % self.n for i in range(len(items))]
        )
        for o in outs:
            if isinstance(o, _Failure):
                raise RuntimeError(f"pool map failed in a worker:\n{o.tb}")
        return outs

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(("stop", None))
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self._conns:
            c.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> "EpisodePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
