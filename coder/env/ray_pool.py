"""Env workers as Ray actors: coder/env/pool.py's episode pool, its workers on Ray's CPU nodes.

    pool = RayEpisodePool(64, timeout_s=300, num_cpus=1, resource="env_node", **episode_kwargs)
    ... the EpisodePool interface (open / call / score / close_episode, reset / step / map) ...
    pool.close()

Selected by `env.workers_backend="ray"` (`coder.rl.actor.EpisodeFactory.pool` builds either
backend). An accelerator host has a few dozen cores; the sandboxes of thousands of concurrent
rollouts need CPU nodes. Each worker is one Ray actor running the local pool's worker code
(`pool.run_command` over the episodes it owns), asking Ray for `num_cpus` CPUs
(`env.ray_num_cpus_per_worker`) and, when `resource` names one (`env.ray_resource`), a 0.001
share of that custom resource: the actors land only on the nodes that declare it
(`ray start --resources='{"env_node": 1}'`) and their CPUs decide how many fit on each. The
pool's bookkeeping (which worker owns an episode, least-loaded placement, one command at a time
per worker, timeouts, restarts) is `EpisodePool`'s; only the transport differs: a command is an
actor method call, its result a `ray.get` with the pool's timeout.

A function given to `map` travels by reference, as to a local worker: it must be importable on
the actors' nodes (a module of coder, not a script's). Failures are the local pool's: an actor that dies (killed, its node lost) makes every later call
of its episodes raise `InfraError` naming it, and is replaced by a new actor for new episodes; a
command slower than `timeout_s` kills its actor (then the same). Nothing waits without a limit
on the per-call path: calls wait `timeout_s` (DEFAULT_TIMEOUT_S when None), a new or replaced
actor waits `start_timeout_s` to be placed (an autoscaler may take minutes to add CPU nodes),
and a pool whose actors the cluster cannot place fails at start naming the keys. Ray is the one
the process is connected to, else the cluster at `address` (`rl.topology.ray_address`), else a local
instance started here, which lives until the process exits (other pools may share it).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import uuid

import ray

from coder.env import pool as pool_lib
from coder.env.runtime.sandbox import InfraError

DEFAULT_TIMEOUT_S = 600.0  # a call's limit when the pool is given none
START_TIMEOUT_S = 600.0  # an actor's limit to be placed and started
# an idle actor that does not answer a ping in this long is replaced
PING_TIMEOUT_S = 30.0
RESOURCE_SHARE = 0.001  # of `resource` per actor: it selects nodes, CPUs pack them


class EnvWorkerActor:
    """One env worker in its Ray actor process: the episodes it owns, driven by `run`."""

    def __init__(self, episode_kwargs: dict):
        pool_lib.warm_up()  # before `ready` answers: inside the pool's start_timeout_s
        self.episode_kwargs, self.episodes = episode_kwargs, {}

    def ready(self) -> int:
        return os.getpid()

    def run(self, cmd: str, batch: list) -> list:
        return pool_lib.run_command(self.episodes, self.episode_kwargs, cmd, batch)

    def stop(self) -> None:
        pool_lib.close_episodes(self.episodes)


_remote_worker = ray.remote(EnvWorkerActor)


def _reason(e: Exception) -> str:
    """Ray's multi-line error on one line: what happened, the node's ip, the cause (the actor's
    ids, which the worker's name already gives, left out)."""
    ids = ("class_name:", "actor_id:", "namespace:", "name:", "pid:")
    lines = (line.strip() for line in str(e).splitlines())
    return "; ".join(line for line in lines if line and not line.startswith(ids))


class _RayWorker:
    """One env worker as a Ray actor, with the pool's worker interface (pool._Worker's
    docstring). Each (re)start is a new actor named `{prefix}.{epoch}`, which `ray list actors`
    shows with its node."""

    def __init__(self, options: dict, kwargs_ref, prefix: str, index: int):
        self.options, self.kwargs_ref = options, kwargs_ref
        self.prefix, self.index = prefix, index
        self.name = f"env worker {index}"
        self.epoch = 0
        self.lock = threading.Lock()
        self.actor = self.started = self._pending = self._stopping = None
        self.start()

    def start(self) -> None:
        """A new actor; `started` resolves once it runs (placed, constructed)."""
        self.epoch += 1
        actor_name = f"{self.prefix}-{self.index}.{self.epoch}"
        self.actor = _remote_worker.options(name=actor_name, **self.options).remote(
            self.kwargs_ref
        )
        self.started = self.actor.ready.remote()
        self.name = f"env worker {self.index} (Ray actor {actor_name})"
        self.dead = False

    def kill(self) -> None:
        self.dead = True
        with contextlib.suppress(Exception):  # already gone, or Ray shut down first
            ray.kill(self.actor, no_restart=True)

    def alive(self) -> bool:
        if self.dead:
            return False
        try:
            ray.get(self.actor.ready.remote(), timeout=PING_TIMEOUT_S)
        except ray.exceptions.RayError:
            return False
        return True

    def send(self, cmd: str, batch: list) -> None:
        try:
            self._pending = self.actor.run.remote(cmd, batch), len(batch)
        except ray.exceptions.RayError as e:
            raise pool_lib.WorkerLost(_reason(e)) from e

    def recv(self, timeout_s: float | None) -> list:
        (ref, n), self._pending = self._pending, None
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:  # before RayError: it is one
            raise TimeoutError(f"{self.name}: no result in {timeout_s} s") from None
        except ray.exceptions.RayActorError as e:
            raise pool_lib.WorkerLost(_reason(e)) from e
        except ray.exceptions.RayError as e:
            # the call failed (its arguments did not unpickle there, say) and the actor lives
            # on: every item of the batch failed
            return [pool_lib.Failure(_reason(e))] * n

    def stop(self) -> None:
        if self.dead:
            return
        try:
            self._stopping = self.actor.stop.remote()
        except Exception:  # noqa: BLE001 - Ray is gone (shut down first): so is the actor
            self.dead = True

    def join(self) -> None:
        if self._stopping is not None:
            try:
                ray.get(self._stopping, timeout=30)
            except ray.exceptions.RayError:
                pass  # gone already: its sandboxes with it
        self.kill()  # frees its CPUs now, not when the handle is collected


class RayEpisodePool(pool_lib.EpisodePool):
    """`EpisodePool` whose `n_workers` workers are Ray actors (module docstring).

    Args:
      n_workers: actors (rl.env_workers).
      timeout_s: longest one per-call command may take (None: DEFAULT_TIMEOUT_S).
      num_cpus: CPUs Ray reserves for each actor (env.ray_num_cpus_per_worker).
      resource: custom Ray resource the actors' nodes must have ("" = any node; env.ray_resource).
      address: the cluster to connect to when this process is not connected ("" = a local one).
      start_timeout_s: longest wait for the actors to be placed and started.
      share_verdicts: one test run per distinct workspace, as for `EpisodePool`.
      episode_kwargs: `Episode` constructor arguments, as for `EpisodePool`.
    """

    def __init__(
        self,
        n_workers: int,
        timeout_s: float | None = None,
        *,
        num_cpus: float = 1.0,
        resource: str = "",
        address: str = "",
        start_timeout_s: float = START_TIMEOUT_S,
        share_verdicts: bool = True,
        **episode_kwargs,
    ):
        if num_cpus <= 0:
            raise ValueError(f"env.ray_num_cpus_per_worker={num_cpus} must be > 0")
        if not ray.is_initialized():
            if address:
                ray.init(address=address)
            else:  # a new local instance, even when RAY_ADDRESS names another cluster
                cpus = max(os.cpu_count() or 1, math.ceil(max(n_workers, 1) * num_cpus))
                ray.init(address="local", num_cpus=cpus, include_dashboard=False)
        self.num_cpus, self.resource = float(num_cpus), str(resource)
        self.start_timeout_s = float(start_timeout_s)
        # no restarts by Ray: a replaced worker is a new epoch, whose start the pool waits for
        self._options = {
            "num_cpus": self.num_cpus,
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        if self.resource:
            self._options["resources"] = {self.resource: RESOURCE_SHARE}
        # held for the pool's life: a replaced actor is built from the same stored arguments
        self._kwargs_ref = ray.put(episode_kwargs)
        self._prefix = f"coder-env-{uuid.uuid4().hex[:8]}"
        super().__init__(
            n_workers,
            timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
            share_verdicts=share_verdicts,
            **episode_kwargs,
        )
        try:
            self._wait_started(self._workers)
        except InfraError as e:
            self.close()
            raise RuntimeError(f"env.workers_backend='ray': {e}") from None

    def _new_worker(self, index: int) -> _RayWorker:
        return _RayWorker(self._options, self._kwargs_ref, self._prefix, index)

    def _restart_if_dead(self, worker) -> None:
        if worker.dead or not worker.alive():
            worker.kill()
            worker.start()
            self._wait_started([worker])

    def _wait_started(self, workers: list) -> None:
        """Waits up to `start_timeout_s` for `workers`' actors to run; InfraError naming the
        keys when the cluster could not place them (the actors are killed) or one failed."""
        refs = [w.started for w in workers]
        done, pending = ray.wait(
            refs, num_returns=len(refs), timeout=self.start_timeout_s
        )
        try:
            ray.get(done)
        except ray.exceptions.RayError as e:
            for w in workers:
                w.kill()
            raise InfraError(
                f"an env worker's Ray actor failed to start: {_reason(e)}"
            ) from None
        if pending:
            for w in workers:
                w.kill()
            wanted = {"CPU": self.num_cpus}
            if self.resource:
                wanted[self.resource] = RESOURCE_SHARE
            has = {k: ray.cluster_resources().get(k, 0) for k in wanted}
            free = {k: ray.available_resources().get(k, 0) for k in wanted}
            raise InfraError(
                f"{len(pending)} of {len(refs)} env worker actors not placed on the Ray cluster "
                f"in {self.start_timeout_s:.0f} s: each asks for {wanted} "
                f"(env.ray_num_cpus_per_worker={self.num_cpus}, "
                f"env.ray_resource={self.resource!r}); the cluster has {has}, {free} free"
            )
