"""How an engine's device calls reach every process it spans: the `Engine.transport` part of
coder.infer.engine.

One engine is one of three roles (`Role`): LOCAL (its mesh is on this process: a call runs
here), LEADER (process 0 of an engine over several processes: it takes the engine's public
calls and posts each device call's name and host inputs to the followers before running it,
coder/infer/channel.py) or FOLLOWER (every other process: `follow` runs the leader's device
calls with the same inputs, so the collectives inside the programs meet).
"""
from __future__ import annotations

import enum
import itertools

import jax

from coder.infer import channel as channel_lib

_ENGINES = itertools.count()  # multi-process engines, numbered in the order every process builds them


class Role(enum.Enum):
    LOCAL = "local"
    LEADER = "leader"
    FOLLOWER = "follower"


class Transport:
    """The device calls of an engine whose mesh spans `processes` (process indices), run by
    name from `handlers` ({op: fn(*args)}, the engine's device calls)."""

    def __init__(self, processes: set[int], handlers: dict, *, timeout_s: float = 60.0):
        if len(processes) > 1 and processes != set(range(jax.process_count())):
            raise ValueError(f"the engine's mesh spans processes {sorted(processes)}: a multi-process "
                             f"engine spans every process of its job (0..{jax.process_count() - 1})")
        self.processes = len(processes)
        self.handlers = handlers
        self.channel = (channel_lib.Channel(f"engine{next(_ENGINES)}", timeout_s=timeout_s)
                        if self.processes > 1 else None)
        if self.channel is None:
            self.role = Role.LOCAL
        else:
            self.role = Role.LEADER if self.channel.is_leader else Role.FOLLOWER

    @property
    def is_leader(self) -> bool:
        """This process takes the engine's calls (LOCAL or LEADER)."""
        return self.role is not Role.FOLLOWER

    @property
    def spans_processes(self) -> bool:
        return self.role is not Role.LOCAL

    def check_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"{what}: this process follows the engine (call engine.follow()); "
                               "process 0 takes the calls")

    def call(self, op: str, *args):
        """Run device call `op`, on the followers too: they take its host inputs first."""
        if self.role is Role.LEADER:
            self.channel.send(op, args)
        return self.handlers[op](*args)

    def follow(self, on_settle) -> str:
        """A follower's loop: run the leader's device calls until it closes the engine ("closed") or
        settles it ("settled", after `on_settle(release)`), or is lost (raises)."""
        if self.is_leader:
            raise RuntimeError("follow: this process leads the engine (process 0 takes the calls)")
        while True:
            op, args = self.channel.receive()
            if op == "close":
                return "closed"
            if op == "settle":
                on_settle(*args)
                return "settled"
            self.handlers[op](*args)

    def settle(self, release: bool) -> None:
        """Leader: hand the followers back (their `follow` returns "settled")."""
        if self.role is Role.LEADER:
            self.channel.send("settle", (bool(release),))

    def close(self) -> None:
        """Leader: the followers' `follow` returns "closed"; one already gone has nothing to stop."""
        if self.role is Role.LEADER:
            try:
                self.channel.send("close", ())
            except channel_lib.FollowerLost:
                pass
