"""Where GRPO's actors live: one driver-facing interface (`ActorHost`) over the actor inside the
learner's process (`LocalActors`), Ray actor processes (`RayActors`) and Ray actor groups of
several processes (coder/rl/actor_group.py `RayActorGroups`). The driver (coder/rl/driver.py)
hands work out through it and never asks which host it has.

Failures: a Ray actor whose process dies is restarted by Ray (MAX_RESTARTS); a call it was running
raises `ActorLost` (the driver drops the group and hands its task out again).
"""
from __future__ import annotations

import concurrent.futures
import math
import os
from typing import Protocol

from coder.data import tokenizer as tokenizer_lib
from coder.rl.actor_worker import ActorWorker, GroupResult, Work, env_workers

MAX_RESTARTS = 8  # Ray restarts of one actor process


class ActorLost(RuntimeError):
    """The actor process running a call died or is restarting (a group is dropped); `for_good`:
    the actor is dead and Ray will not restart it."""

    def __init__(self, message: str, for_good: bool = False):
        super().__init__(message)
        self.for_good = for_good


class ActorHost(Protocol):
    """The driver's view of its actors (coder/rl/driver.py): `len(host)` actors, numbered 0..n-1;
    `submit` starts actor i's group and returns a token; `wait` returns the tokens done within
    `timeout`; `result` is the token's GroupResult (or raises ActorLost); `probe` a token that
    resolves once actor i is up again; `notify` tells every actor a version was published."""

    def __len__(self) -> int: ...

    def submit(self, i: int, work: Work): ...

    def wait(self, tokens: list, timeout: float) -> list: ...

    def result(self, token) -> GroupResult: ...

    def probe(self, i: int): ...

    def notify(self, version: int) -> None: ...

    def close(self) -> None: ...


class LocalActors:
    """One ActorWorker inside the learner's process (rl.topology.actors = 0): no Ray, no second JAX
    runtime; its groups run in threads. Its engine also serves the agent eval."""

    def __init__(self, worker: ActorWorker, slots: int):
        self.workers = [worker]
        self._ex = concurrent.futures.ThreadPoolExecutor(slots, thread_name_prefix="actor-group")

    def __len__(self):
        return 1

    def submit(self, i: int, work: Work):
        return self._ex.submit(self.workers[i].run_group, work)

    def wait(self, tokens: list, timeout: float) -> list:
        done, _ = concurrent.futures.wait(tokens, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return list(done)

    def result(self, token) -> GroupResult:
        return token.result()

    def probe(self, i: int):
        return self._ex.submit(self.workers[i].pid)

    def notify(self, version: int) -> None:
        self.workers[0].notify(version)

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)
        self.workers[0].close()


def local_ray_cpus(config, n: int, processes: int) -> int:
    """Logical CPUs of a local Ray instance for `n` Ray actors of `processes` processes each
    (n = 0: the actor in the learner's process), one more for the driver's calls, and, with
    env.workers_backend "ray", every env worker pool the run starts: each actor's (`env_workers`)
    and the agent eval's in the learner's process 0 (rl.env_workers, else up to 16). A pool
    whose actors the instance cannot place waits for CPUs that never come (ray_pool's start
    timeout): each must fit beside the others."""
    cpus = n * processes + 1
    if config.env.workers_backend == "ray":
        eval_workers = int(config.rl.env_workers) or 16
        workers = max(n, 1) * env_workers(config) + eval_workers
        cpus += math.ceil(workers * float(config.env.ray_num_cpus_per_worker))
    return max(os.cpu_count() or 1, cpus)


def start_ray(config, n: int, processes: int) -> bool:
    """Connects to the Ray cluster at rl.topology.ray_address, or starts a local instance (even when
    RAY_ADDRESS names another cluster) with `local_ray_cpus`. False when Ray was already up."""
    import ray  # heavy: ray (the Ray deployments only)

    if ray.is_initialized():
        return False
    address = str(config.rl.topology.ray_address)
    if address:
        ray.init(address=address)
        return True
    ray.init(address="local", num_cpus=local_ray_cpus(config, n, processes), include_dashboard=False)
    return True


class RayActors:
    """`n` ActorWorkers as Ray actor processes (restarted by Ray when they die), on the cluster
    at `rl.topology.ray_address` or on a local Ray instance started here ("" = local)."""

    def __init__(self, config, n: int, tokenizer, make_episode, model_fn, url: str, slots: int):
        import ray  # heavy: ray (the Ray deployments only)

        address = str(config.rl.topology.ray_address)
        self._started = start_ray(config, n, processes=1)
        options = dict(max_restarts=MAX_RESTARTS, max_task_retries=0, max_concurrency=slots + 4,
                       **ray_placement(local=not address))
        remote = ray.remote(ActorWorker).options(**options)
        # the constructor's arguments in the object store, held here for the run: Ray re-runs the
        # constructor with them when it restarts a dead actor (arguments it put there itself for
        # the first call may be freed by then: the restart then fails to start)
        self._args = [ray.put(a) for a in (config, tokenizer_lib.to_record(tokenizer), make_episode, model_fn)]
        self.handles = [remote.remote(*self._args, url, i) for i in range(n)]

    def __len__(self):
        return len(self.handles)

    def submit(self, i: int, work: Work):
        return self.handles[i].run_group.remote(work)

    def wait(self, tokens: list, timeout: float) -> list:
        import ray  # heavy: ray (the Ray deployments only)

        ready, _ = ray.wait(tokens, num_returns=1, timeout=timeout)
        return ready

    def result(self, token) -> GroupResult:
        import ray  # heavy: ray (the Ray deployments only)

        try:
            return ray.get(token)
        except ray.exceptions.RayActorError as e:  # died (restarting) or unreachable
            if e.actor_init_failed:  # not a lost process: the actor cannot start at all
                raise RuntimeError(f"[grpo] an actor failed to start: {e}") from None
            raise ActorLost(str(e).splitlines()[0], isinstance(e, ray.exceptions.ActorDiedError)) from None

    def probe(self, i: int):
        """A call that returns once actor `i` is up (after a restart)."""
        return self.handles[i].pid.remote()

    def notify(self, version: int) -> None:
        for h in self.handles:
            h.notify.remote(version)

    def pids(self, timeout: float = 600.0) -> list[int]:
        import ray  # heavy: ray (the Ray deployments only)

        return ray.get([h.pid.remote() for h in self.handles], timeout=timeout)

    def close(self) -> None:
        import ray  # heavy: ray (the Ray deployments only)

        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._started:
            ray.shutdown()


def ray_placement(local: bool) -> dict:
    """Ray resources of one actor: a CPU; on a cluster with accelerators, all of one host's
    (one actor per TPU / GPU host)."""
    if local:
        return {"num_cpus": 1}
    import ray  # heavy: ray (the Ray deployments only)

    try:
        nodes = ray.nodes()
    except Exception:  # noqa: BLE001 - a client that cannot list nodes: let Ray place it
        nodes = []
    for node in nodes:
        res = node.get("Resources", {}) if node.get("Alive") else {}
        if res.get("TPU"):
            return {"num_cpus": 1, "resources": {"TPU": res["TPU"]}}
        if res.get("GPU"):
            return {"num_cpus": 1, "num_gpus": res["GPU"]}
    return {"num_cpus": 1}
