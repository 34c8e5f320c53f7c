"""The batches of a GRPO learner over several processes whose actors process 0 drives.

With Ray actors (`rl.topology.actors >= 1`) a learner job of P processes has one driver, in process 0:
it hands every task of the epoch to the actors (one staleness gate, one group queue, one view of
the actors' health) and takes the step's B finished groups. Every learner process feeds its own
rows of the global batch, so process 0 scatters them: process p gets groups
[p * B / P, (p + 1) * B / P) of the step (scored on process 0: advantages are per group), or all
B where every process feeds the whole batch (the mesh's batch axes do not span the processes:
`Trainer.batch_row_shares`), the step's rollout metrics and the epoch's position (so every
process checkpoints the same one).

    process 0:  channel.send([share_0, share_1, ...])   posts share p for process p (p >= 1)
    process p:  share = channel.receive()                blocks until the step's share is posted

The shares travel pickled through the job's coordination key-value store (`jax.distributed`), in
parts of at most `PART_BYTES` (the store is a gRPC service; a step's rollouts, router replay's
expert ids included, can be tens of MB). A step's rollouts take minutes, so a follower waits as
long as process 0 takes; if process 0 dies the coordination service (it runs there) goes with it
and the follower's next read raises. A share of None ends the run (the epoch ran out).

Keys: `coder/{name}/{step}/{process}/{part}` and `.../count`; process 0 deletes a step's keys when
it posts the step after next (every follower has taken a step once the learner step that used it
ran: its collectives needed every process).
"""
from __future__ import annotations

import pickle

import jax

from coder.infer.channel import _client, _deadline_exceeded

PART_BYTES = 1 << 20


class StepChannel:
    """Process 0 -> every other process of the learner's job, one share per process per step.
    `name` must be the same on every process."""

    def __init__(self, name: str = "grpo-steps"):
        self.name = name
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.seq = 0  # the last step sent (process 0) or received
        self._client = _client()

    def _key(self, *parts) -> str:
        return "/".join(("coder", self.name) + tuple(str(p) for p in parts))

    def send(self, shares: list) -> None:
        """Process 0: posts `shares[p]` for every process p >= 1 (shares[0] is its own)."""
        if self.process != 0:
            raise RuntimeError("only process 0 sends the learner's step shares")
        if len(shares) != self.processes:
            raise ValueError(f"{len(shares)} shares for {self.processes} processes")
        self.seq += 1
        n = self.seq
        for p in range(1, self.processes):
            data = pickle.dumps(shares[p], protocol=5)
            parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
            for i, part in enumerate(parts):
                self._client.key_value_set_bytes(self._key(n, p, i), part)
            self._client.key_value_set(self._key(n, p, "count"), str(len(parts)))  # last: the share is whole
        if n > 2:
            self._delete(n - 2)

    def _delete(self, n: int) -> None:
        for p in range(1, self.processes):  # the coordination service deletes a directory's keys
            self._client.key_value_delete(self._key(n, p))

    def receive(self):
        """Process p >= 1: its share of the next step, waiting as long as process 0 takes."""
        if self.process == 0:
            raise RuntimeError("process 0 sends the step shares; it does not receive them")
        n = self.seq + 1
        while True:
            try:
                count = int(self._client.blocking_key_value_get(self._key(n, self.process, "count"), 1000))
                break
            except Exception as e:  # noqa: BLE001 - jaxlib raises its own error type
                if not _deadline_exceeded(e):
                    raise RuntimeError(f"learner process {self.process} lost process 0 waiting for step "
                                       f"share {n} ({e})") from e
        data = b"".join(self._client.blocking_key_value_get_bytes(self._key(n, self.process, i), 60_000)
                        for i in range(count))
        self.seq = n
        return pickle.loads(data)
