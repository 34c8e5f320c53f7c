"""What an engine has done, counted: the `Engine.counters` part of coder.infer.engine.

Cumulative counts (a caller diffs two `snapshot()`s): the engine thread adds to them as it
prefills and decodes, and jit adds one trace to `compilations` per compiled program.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class EngineCounters:
    spec_k: int = 0  # drafts per speculative step (0: plain decoding)
    offload: bool = False  # the engine moves idle rows to host memory (offload_idle_rows)
    compilations: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # traces per program
    prefill_tokens: int = 0  # real tokens run through prefill (shared prompts count once)
    prefix_hits: int = 0  # groups that started from a cached prefix
    prefix_tokens: int = 0  # prompt tokens those groups did not prefill
    decode_steps: int = 0  # decode (or draft + verify) steps
    decode_calls: int = 0  # host calls of the multi-step decode program
    emitted: int = 0  # tokens emitted by decode calls
    row_steps: int = 0  # sum over steps of the rows that took part (occupancy numerator)
    slot_steps: int = 0  # sum over steps of the pool's slot count (occupancy denominator)
    drafted: int = 0  # speculative: drafts proposed for active rows
    accepted: int = 0  # speculative: drafts accepted
    accepted_by_depth: np.ndarray = None  # speculative: [spec_k] drafts accepted at each depth
    offloads: int = 0  # rows moved to host memory
    swap_ins: int = 0  # rows written back from host memory
    offloaded_bytes: int = 0  # bytes those moves took to host memory

    def __post_init__(self):
        if self.accepted_by_depth is None:
            self.accepted_by_depth = np.zeros((self.spec_k,), np.int64)

    @property
    def num_compilations(self) -> int:
        return sum(self.compilations.values())

    def count_decode(self, out: dict, slots: int) -> None:
        """One decode call's `out` (programs.decode's emitted fields on the host) over a pool of `slots`."""
        steps = int(out["steps"])
        self.decode_calls += 1
        self.decode_steps += steps
        self.emitted += int(out["count"].sum())
        self.row_steps += int(out["row_steps"].sum())
        self.slot_steps += steps * slots
        if self.spec_k:
            self.drafted += self.spec_k * int(out["row_steps"].sum())
            self.accepted += int(out["accepted"].sum())
            self.accepted_by_depth += out["accepted"]

    def snapshot(self, rows_offloaded_now: int = 0) -> dict:
        """The counters, the decode batch occupancy (rows decoding / pool slots, over all steps)
        and, with speculative decoding, the drafts accepted at each depth (`accepted_depth{d}`;
        depth d is examined only when drafts 1..d-1 were accepted)."""
        s = dict(prefill_tokens=self.prefill_tokens, prefix_hits=self.prefix_hits,
                 prefix_tokens=self.prefix_tokens, decode_steps=self.decode_steps,
                 decode_calls=self.decode_calls, emitted=self.emitted, row_steps=self.row_steps,
                 slot_steps=self.slot_steps, occupancy=self.row_steps / self.slot_steps if self.slot_steps else 0.0,
                 rows_per_step=self.row_steps / self.decode_steps if self.decode_steps else 0.0)
        if self.spec_k:
            s.update(drafted=self.drafted, accepted=self.accepted,
                     **{f"accepted_depth{d + 1}": int(a) for d, a in enumerate(self.accepted_by_depth)})
        if self.offload:
            s.update(offloads=self.offloads, swap_ins=self.swap_ins, offloaded_bytes=self.offloaded_bytes,
                     rows_offloaded_now=int(rows_offloaded_now))
        return s
