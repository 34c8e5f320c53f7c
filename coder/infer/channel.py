"""The leader -> follower channel of an engine that spans processes (a multi-controller JAX job).

Every process of the job runs the same compiled programs on one global mesh; only the leader
(process 0) schedules. Before each device call (resize the slot pool, prefill, copy slots,
decode, load weights) the leader posts the call's name and host inputs — a few KB of token ids,
slot indices and sampling parameters, once per call, never per token — to the job's
coordination key-value store (`jax.distributed`), and waits until every follower has taken it;
the followers (`Engine.follow()`) run the same call with the same inputs, so the collectives
inside the programs meet. Outputs are read on the leader.

    leader:   channel.send(op, args)      posts op n, returns once every follower took it
    follower: op, args = channel.receive()   blocks for op n + 1 (the leader may idle for long)

Failure is an error, never a hang: a follower that does not take an op within `timeout_s`
(dead, or stalled) makes the leader raise `FollowerLost` naming its process; a leader that dies
takes the coordination service (it runs in process 0) with it, and the followers' next read
raises.

Keys: `coder/{name}/op/{n}` (the pickled (op, args)) and `coder/{name}/took/{n}/{process}`;
the leader deletes a call's keys once the next call has been taken.
"""
from __future__ import annotations

import pickle
import time

import jax


class FollowerLost(RuntimeError):
    """A follower process did not take a call in time (dead or stalled)."""


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("an engine over several processes needs jax.distributed.initialize() first")
    return client


def _deadline_exceeded(err: Exception) -> bool:
    text = str(err)
    return "DEADLINE_EXCEEDED" in text or "Deadline Exceeded" in text or "timed out" in text.lower()


class Channel:
    """One engine's call channel. `name` must be the same on every process of the job (engines
    are numbered in the order they are built, the same on every process)."""

    def __init__(self, name: str, *, timeout_s: float = 60.0):
        self.name, self.timeout_s = name, float(timeout_s)
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.is_leader = self.process == 0
        self.seq = 0  # the last call sent (leader) or taken (follower)
        self._client = _client()

    def _key(self, *parts) -> str:
        return "/".join(("coder", self.name) + tuple(str(p) for p in parts))

    def send(self, op: str, args: tuple) -> None:
        """Leader: post call `op(*args)` and wait until every follower took it."""
        if not self.is_leader:
            raise RuntimeError("only the leader (process 0) sends engine calls")
        self.seq += 1
        n = self.seq
        self._client.key_value_set_bytes(self._key("op", n), pickle.dumps((op, args), protocol=5))
        deadline = time.monotonic() + self.timeout_s
        missing = []
        for p in range(1, self.processes):
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                self._client.blocking_key_value_get(self._key("took", n, p), left_ms)
            except Exception as e:  # noqa: BLE001 - jaxlib raises its own error type
                if not _deadline_exceeded(e):
                    raise
                missing.append(p)
        if missing:
            raise FollowerLost(f"engine {self.name}: follower process(es) {missing} did not take call "
                               f"{n} ({op}) within {self.timeout_s:.0f} s: dead or stalled")
        if n > 1:  # every follower took n, so n - 1 is done with
            self._client.key_value_delete(self._key("op", n - 1))
            for p in range(1, self.processes):
                self._client.key_value_delete(self._key("took", n - 1, p))

    def receive(self) -> tuple[str, tuple]:
        """Follower: the next call (op, args), waiting as long as the leader idles."""
        if self.is_leader:
            raise RuntimeError("the leader does not receive engine calls")
        n = self.seq + 1
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(self._key("op", n), 1000)
                break
            except Exception as e:  # noqa: BLE001
                if not _deadline_exceeded(e):
                    raise RuntimeError(f"engine {self.name}: follower {self.process} lost the leader "
                                       f"waiting for call {n} ({e})") from e
        self.seq = n
        self._client.key_value_set(self._key("took", n, self.process), "1")
        return pickle.loads(data)
