"""RL actors that span processes: each actor one JAX job of `rl.topology.actor_processes` Ray actor
processes (disaggregated mode: the actors on hosts of their own, placed by Ray).

A model that does not fit one host's accelerators (DeepSeek-V3, Kimi K2 in bf16) needs an engine
over several hosts. `RayActorGroups` starts `rl.topology.actors` groups; a group is P Ray actor
processes (`GroupMember`, one per host: a placement group, STRICT_SPREAD on a cluster, PACK on a
local instance) that join a `jax.distributed` world of their own (coordinator: member 0, on a
free port of its node), separate from the learner's. Each member builds the same engine over
every device of the group (coder/infer/engine.py, several processes):

    member 0   the actor the driver talks to (`ActorWorker` with the group's mesh): agent loops,
               env workers, the engine's scheduler; its weight poller calls
               `engine.load_weights(StoreLoad(url, v))`
    member r>0 `engine.follow()` in a thread: runs the leader's device calls, reads its own
               devices' slices of every version from the store

so no member ever holds the whole model. The driver's calls (`run_group`, `notify`, `stats`,
`pid`) go to member 0; `RayActorGroups` has the driver-facing interface of
coder/rl/actor_hosts.py's `RayActors`.

Failures: a member that dies breaks its group's world (the leader's engine raises FollowerLost
within rl.topology.actor_timeout_s; a follower whose leader died stops following). Ray does not restart
members one by one (a lone new process cannot join the old world): the group's groups in
flight come back as ActorLost, and the driver's probe of the group kills what is left of it and
starts a new group (at most MAX_GROUP_RESTARTS times), which reads the newest version from the
store.

Imports: nothing that brings jax is imported at this module's top (the coder modules included):
a member's Ray process loads this module to run `GroupMember`, and its JAX must start only in
`join`, after jax.distributed.initialize.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import threading

MAX_GROUP_RESTARTS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class GroupMember:
    """One process of a multi-process actor (module docstring); hosted by a Ray actor."""

    def __init__(self, rank: int, size: int):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: its stacks, to its Ray log
        self.rank, self.size = int(rank), int(size)
        self.worker = None  # member 0: the ActorWorker
        self.engine = None  # members > 0: the engine they follow
        self.follow_error: BaseException | None = None
        self._joined = threading.Event()  # the driver's calls may arrive before join returned
        self._join_error: BaseException | None = None

    def coordinator(self) -> str:
        """host:port of the group's jax.distributed coordinator (called on member 0)."""
        import ray  # heavy: ray (the Ray deployments only)

        return f"{ray.util.get_node_ip_address()}:{_free_port()}"

    def join(self, coordinator: str, config, args: list, url: str, index: int) -> int:
        """Joins the group's JAX world and builds this member's part of the engine; member 0's
        returns once the engine holds the store's newest version. Returns the pid.

        `args`: [ObjectRef] of (tokenizer record, make_episode, model_fn), fetched only once
        jax.distributed is up (unpickling a jax.Array, e.g. weights a model_fn carries, starts
        the XLA backend, after which this process could not join)."""
        import jax  # jax only once the Ray actor runs (join: before jax.distributed)
        import ray  # heavy: ray (the Ray deployments only)
        from flax import nnx

        from coder.rl import actor as actor_lib
        from coder.rl.actor_worker import ActorWorker

        try:
            timeout = int(float(config.rl.topology.actor_timeout_s))
            # a dead member is noticed by the others' heartbeats within the same bound
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=self.size,
                                       process_id=self.rank, initialization_timeout=timeout,
                                       heartbeat_timeout_seconds=timeout, shutdown_timeout_seconds=timeout)
            tokenizer, make_episode, model_fn = ray.get(args)
            mesh = actor_lib.engine_mesh(config, jax.devices())
            if self.rank == 0:
                self.worker = ActorWorker(config, tokenizer, make_episode, model_fn, url, index, mesh=mesh)
                return os.getpid()
            model = nnx.eval_shape(model_fn or actor_lib.model_fn(config))
            self.engine = actor_lib.make_engine(model, config, mesh=mesh)
            threading.Thread(target=self._follow, name=f"actor{index}-member{self.rank}", daemon=True).start()
            logging.info("[actor %d] member %d of %d (pid %d) follows the engine of member 0", index, self.rank,
                         self.size, os.getpid())
            return os.getpid()
        except BaseException as e:
            self._join_error = e
            raise
        finally:
            self._joined.set()

    def _follow(self) -> None:
        try:
            self.engine.follow()
        except BaseException as e:  # noqa: BLE001 - the leader died or closed: the group is over
            self.follow_error = e
            logging.error("[actor group] member %d stopped following: %s", self.rank, e)

    # --- member 0: the actor the driver calls ------------------------------------------------
    def _leader(self):
        self._joined.wait()
        if self._join_error is not None:
            raise RuntimeError(f"member 0 failed to join its group: {self._join_error}")
        return self.worker

    def run_group(self, work):
        return self._leader().run_group(work)

    def notify(self, version: int | None = None) -> None:
        self._leader().notify(version)

    def stats(self) -> dict:
        return self._leader().stats()

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()  # closes the engine: the followers' follow() returns


class RayActorGroups:
    """`n` actors of `processes` Ray actor processes each (module docstring), on the cluster at
    `rl.topology.ray_address` or on a local Ray instance started here. The driver-facing interface of
    `RayActors` (coder.rl.actor_hosts.ActorHost), and `pids`."""

    def __init__(self, config, n: int, processes: int, tokenizer, make_episode, model_fn, url: str, slots: int):
        import ray  # heavy: ray (the Ray deployments only)

        from coder.data import tokenizer as tokenizer_lib

        if processes < 2:
            raise ValueError(f"rl.topology.actor_processes={processes}: a group spans at least 2 processes "
                             "(1 is coder.rl.actor_hosts.RayActors)")
        from coder.rl.actor_hosts import start_ray

        address = str(config.rl.topology.ray_address)
        self._started = start_ray(config, n, processes)
        self.local = not address
        self.processes, self.slots, self.url = int(processes), int(slots), url
        self._args = [ray.put(a) for a in (config, tokenizer_lib.to_record(tokenizer), make_episode, model_fn)]
        self._lock = threading.Lock()
        self.members: list[list] = [[] for _ in range(n)]
        self.groups: list = [None] * n  # placement group of each actor
        self.generation = [0] * n  # groups started per actor
        self.broken = [False] * n  # a call of the current generation failed
        self._token_of: dict = {}  # ObjectRef -> (actor, generation)
        self._up = [self._start(i) for i in range(n)]  # each group's join: resolves when it is up

    def _start(self, i: int):
        """Starts actor `i`'s group -> the ObjectRef of member 0's join (the group is up)."""
        import ray  # heavy: ray (the Ray deployments only)
        from ray.util.placement_group import placement_group  # heavy: ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # heavy: ray

        from coder.rl.actor_hosts import ray_placement

        placement = ray_placement(self.local)  # what one member takes: a host's accelerators on a cluster
        bundle = {"CPU": placement["num_cpus"], **placement.get("resources", {})}
        if placement.get("num_gpus"):
            bundle["GPU"] = placement["num_gpus"]
        pg = placement_group([bundle] * self.processes, strategy="PACK" if self.local else "STRICT_SPREAD")
        remote = ray.remote(GroupMember)
        members = [remote.options(max_restarts=0, max_task_retries=0, max_concurrency=self.slots + 4, **placement,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      pg, placement_group_bundle_index=r))
                   .remote(r, self.processes) for r in range(self.processes)]
        coordinator = members[0].coordinator.remote()
        # the followers' joins return with the leader's (one JAX world); a failure shows as the leader's
        up, *_ = [m.join.remote(coordinator, self._args[0], self._args[1:], self.url, i) for m in members]
        self.members[i], self.groups[i] = members, pg
        self.generation[i] += 1
        self.broken[i] = False
        logging.info("[grpo] actor %d: a group of %d processes (generation %d)", i, self.processes,
                     self.generation[i])
        return up

    def _stop(self, i: int) -> None:
        import ray  # heavy: ray (the Ray deployments only)
        from ray.util.placement_group import remove_placement_group  # heavy: ray

        for m in self.members[i]:
            try:
                ray.kill(m, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.groups[i] is not None:
            try:
                remove_placement_group(self.groups[i])
            except Exception:  # noqa: BLE001
                pass
        self.members[i], self.groups[i] = [], None

    def __len__(self):
        return len(self.members)

    def _track(self, i: int, token):
        with self._lock:
            self._token_of[token] = (i, self.generation[i])
        return token

    def submit(self, i: int, work):
        return self._track(i, self.members[i][0].run_group.remote(work))

    def wait(self, tokens: list, timeout: float) -> list:
        import ray  # heavy: ray (the Ray deployments only)

        ready, _ = ray.wait(tokens, num_returns=1, timeout=timeout)
        return ready

    def result(self, token):
        import ray  # heavy: ray (the Ray deployments only)

        from coder.rl.actor_hosts import ActorLost

        with self._lock:
            i, gen = self._token_of.pop(token, (None, None))
        try:
            return ray.get(token)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            # a member died (the leader's engine raised FollowerLost, or the leader is gone), or
            # a group failed to start: the group is broken; the driver's probe restarts it
            if i is not None and gen == self.generation[i]:
                self.broken[i] = True
            if isinstance(e, ray.exceptions.RayTaskError) and not _lost_member(e):
                raise e.as_instanceof_cause() from None  # an actor's own bug stops the run
            gone = i is not None and self.generation[i] > MAX_GROUP_RESTARTS
            raise ActorLost(f"actor group {i}: {str(e).splitlines()[0]}", gone) from None

    def probe(self, i: int):
        """A call that returns once actor `i`'s group is up; a broken group is replaced first."""
        if self.broken[i] and self.generation[i] <= MAX_GROUP_RESTARTS:
            self._stop(i)
            return self._track(i, self._start(i))
        return self._track(i, self.members[i][0].pid.remote())

    def notify(self, version: int) -> None:
        for members in self.members:
            if members:
                members[0].notify.remote(version)

    def pids(self, timeout: float = 600.0) -> list[list[int]]:
        """Each group's member pids (once every group is up)."""
        import ray  # heavy: ray (the Ray deployments only)

        ray.get(self._up, timeout=timeout)
        return [ray.get([m.pid.remote() for m in members], timeout=timeout) for members in self.members]

    def close(self) -> None:
        import ray  # heavy: ray (the Ray deployments only)

        for i, members in enumerate(self.members):
            if members:
                try:
                    ray.get(members[0].close.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - a broken group: killed below
                    pass
            self._stop(i)
        if self._started:
            ray.shutdown()


def _lost_member(e) -> bool:
    """True when a RayTaskError of the leader comes from a lost member of its group."""
    from coder.infer import channel

    cause = getattr(e, "cause", None)
    return isinstance(cause, channel.FollowerLost) or "FollowerLost" in str(e)
