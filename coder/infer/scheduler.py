"""Host bookkeeping of the engine: rows, the slot pool, requests, and what each program call runs.

No JAX here: the scheduler turns requests into numpy inputs of coder/infer/programs.py and the
numpy outputs back into rows. coder/infer/engine.py owns the device store and the thread that
calls the programs; every method here runs under the engine's lock.

Life of a row (one sequence of a group):
  waiting   the group asked for slots (`admit`); its prompt is pending;
  holding   it owns a slot: its tokens are in the slot's cache; it may hold pending tokens
            (appended observations) that the next prefill writes, never the history;
  decoding  a `generate` request covers it: it takes part in every decode call until it stops,
            spends its budget or reaches max_len; its request then completes;
  offloaded (the engine's `offload_idle_rows`) a holding row whose slot another group or row
            needed: its slot's state (KV cache, logits, hidden states) was copied to host memory
            and the slot freed; its next `generate` brings it back into a free slot first;
  released  its group was closed (or garbage-collected): the slot returns to the pool.
A row waiting on a tool is "holding": it keeps its slot and its cache while other rows decode.
With offload on, idle holding rows are offloaded when work waits for slots: rows coming back
first, then the oldest waiting admission; cached prefixes are evicted before any row is
offloaded, and rows idle longest go first.

Prefix cache (`prefix_cache_slots` > 0): a released row's slot keeps its cache as a cached
prefix (its cached tokens), least recently used first out, at most `prefix_cache_slots` of them.
A new group whose prompt starts with tokens a cached prefix holds starts from a copy of that
slot: only the rest of its prompt is prefilled (a conversation's next turn, the same files in
another prompt). Cached slots are free for the taking: an admission that finds no free slot
evicts them, least recently used first. New weights make every cached prefix stale: the engine
flushes them (`new_weights`), and a row whose cache holds entries of older weights (it was
admitted before the change and decoded on: in-flight updates) is never cached when it is
released: each row keeps the weights epoch it was admitted under (`Row.kv_epoch`), and only rows
of the current epoch become prefixes. Each row counts the prompt tokens it took from a cached
prefix (`Row.reused`) and the tokens prefill computed in its slot (`Row.prefilled`).

Continuous batching: every decode call runs all decoding rows of all groups together; rows join
(after their prefill) at the next call and leave when they stop.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import threading

import numpy as np

FINISH_REASONS = ("stop", "length", "max_len", "cancelled")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    max_new_tokens: int = 256  # per generate call and row
    stop_token_ids: tuple = ()  # a row stops after sampling one of these (it is kept)


@dataclasses.dataclass
class Generation:
    tokens: list  # sampled token ids
    logprobs: list  # log_softmax(logits / T)[token] per token
    expert_ids: np.ndarray  # [n_tokens, moe_layers, top_k] uint8/uint16, routing of each token
    finish_reason: str  # "stop" | "length" | "max_len" | "cancelled" (on_tokens)
    policy_version: list  # weights version that produced each token's distribution


def bucket(buckets, n: int) -> int:
    """Smallest bucket >= n; past the largest, the next multiple of the largest."""
    i = bisect.bisect_left(buckets, n)
    if i < len(buckets):
        return buckets[i]
    top = buckets[-1]
    return -(-n // top) * top


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)  # an engine's slot counts by default (past 32: multiples of 32)


def default_len_buckets(max_len: int) -> tuple:
    """Powers of two from 16 up to the first one >= max_len."""
    b = [16]
    while b[-1] < max_len:
        b.append(b[-1] * 2)
    return tuple(b)


@dataclasses.dataclass
class Request:
    """One row's part of a `generate` call."""

    params: SamplingParams
    rng: np.ndarray  # key data of fold_in(call rng, row): token keys fold in the position
    call: "Call"
    on_tokens: object = None  # fn(tokens, logprobs) -> truthy to cancel; each decode call's new tokens
    gen: Generation = None
    stops: frozenset = frozenset()

    def __post_init__(self):
        self.stops = frozenset(int(s) for s in self.params.stop_token_ids)
        self.gen = Generation([], [], [], None, [])


class Call:
    """A blocking `generate` (or admission) waiting for its rows; set by the engine's thread."""

    def __init__(self, n: int):
        self.left = n
        self.error: BaseException | None = None
        self.done = threading.Event()

    def finish_one(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


@dataclasses.dataclass
class Row:
    tokens: list  # whole sequence: cached tokens, then pending (appended, not yet prefilled)
    length: int = 0  # tokens in the cache (positions 0 .. length-1)
    expert_chunks: list = dataclasses.field(default_factory=list)  # [t, L, K] over the cached tokens
    logits_version: int = 0  # policy version of the logits the next token is sampled from
    finish_reason: str | None = None
    slot: int = -1  # -1: no slot yet (waiting) or released
    reuse: tuple | None = None  # (cached slot, tokens) a new group's first row starts from
    request: Request | None = None  # the generate call decoding this row
    result: Generation | None = None  # what the last request produced, until its caller takes it
    host: object = None  # offloaded: its slot's state in host memory (programs.Store of numpy leaves)
    last_used: int = 0  # the scheduler's tick when it last decoded or was admitted (offload: oldest first)
    kv_epoch: int = 0  # the scheduler's weights epoch at admission: its cache's oldest entries' weights
    reused: int = 0  # prompt tokens copied from a cached prefix at admission (not prefilled)
    prefilled: int = 0  # tokens prefill computed in this row's slot (a group's shared prompt: its first row)

    @property
    def closed(self) -> bool:
        return self.slot < 0 and self.host is None

    @property
    def pending(self) -> list:
        return self.tokens[self.length:]


class SlotPool:
    """Slot ids 0..max_slots-1; the lowest free ones are handed out first, so the used slots stay
    at the bottom and the decode batch (the pool's size, a batch bucket) stays small."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.free = list(range(max_slots))  # sorted

    def alloc(self, n: int) -> list | None:
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, slots) -> None:
        for s in slots:
            bisect.insort(self.free, s)

    @property
    def high(self) -> int:
        """1 + the highest slot in use (0 when none is)."""
        used = set(range(self.max_slots)) - set(self.free)
        return max(used) + 1 if used else 0

    @property
    def in_use(self) -> int:
        return self.max_slots - len(self.free)


class Scheduler:
    """Rows by slot, the admission queue, and the inputs / outputs of each program call."""

    def __init__(self, *, max_slots: int, max_len: int, spec_k: int, num_steps: int, moe_layers: int,
                 top_k: int, expert_dtype, prefix_cache_slots: int = 0, prefix_in_place: bool = False):
        self.pool = SlotPool(max_slots)
        self.prefix_cache_slots = int(prefix_cache_slots)
        self.prefix_in_place = bool(prefix_in_place)  # a match's slot is taken as it is, never copied
        # slot -> (cached tokens, their expert-id chunks), least recently used first
        self.prefixes: collections.OrderedDict[int, tuple[list, list]] = collections.OrderedDict()
        self.max_len, self.spec_k, self.num_steps = max_len, spec_k, num_steps
        self.expert_shape, self.expert_dtype = (moe_layers, top_k), expert_dtype
        self.rows: dict[int, Row] = {}  # slot -> row holding it
        self.admissions: list[tuple[list, Call]] = []  # (rows of a group, its call) in FIFO order
        self.to_release: list = []  # slots of closed groups (freed by the engine thread)
        self.offloaded: list[Row] = []  # rows whose state is in host memory, in offload order
        self.tick = 0  # counts admissions and decode calls: rows' last_used
        self.weights_epoch = 0  # weights installed so far (`new_weights`): rows' kv_epoch

    # ------------------------------------------------------------------ admission and release
    def admit_ready(self) -> list[list]:
        """Groups (lists of rows) that get slots now, in FIFO order (a group that does not fit
        waits, and so do the ones behind it). A group's first row may start from a cached prefix
        (`Row.reuse`); cached slots are evicted for room, least recently used first, but none a
        group admitted here reuses (the engine copies them after this call). A group that fits
        only with its match's slot takes that slot as it is (its first row starts with the
        prefix's n tokens cached, `Row.reused`; nothing to copy): a self-summary chain's next
        window in the slot its previous window left. With `prefix_in_place` every match is taken
        so (one slot where a copy holds two: the pool, and each decode call over it, stays as
        small as the rows; the prefix is no longer cached, but the row's slot is, once released,
        with the same tokens and more)."""
        out, pinned = [], set()
        while self.admissions:
            rows, call = self.admissions[0]
            match = self.longest_prefix(rows[0].tokens)
            keep = pinned | ({match[0]} if match else set())
            while len(self.pool.free) < len(rows):
                victim = next((s for s in self.prefixes if s not in keep), None)
                if victim is None:
                    break
                self._evict(victim)
            own = None  # (cached slot, n) the first row takes as it is: nothing to copy
            if match and match[0] not in pinned and (self.prefix_in_place or len(self.pool.free) < len(rows)):
                if len(self.pool.free) + 1 >= len(rows):  # the match's own slot (makes it fit)
                    own, match = match, None
                else:
                    self._evict(match[0])  # only by giving up its match does the group fit
                    match = None
            if own:
                cached = self.prefixes.pop(own[0])[1]
                slots = [own[0]] + self.pool.alloc(len(rows) - 1)
            else:
                slots = self.pool.alloc(len(rows))
                if slots is None:
                    break
            self.admissions.pop(0)
            self.tick += 1
            for r, s in zip(rows, slots):
                r.slot, r.last_used, r.kv_epoch = s, self.tick, self.weights_epoch
                self.rows[s] = r
            if own:  # the slot holds the prefix's cache: the row's first n tokens are in it
                n = own[1]
                rows[0].length, rows[0].expert_chunks, rows[0].reused = n, [np.concatenate(cached)[:n]], n
            if match:
                rows[0].reuse = match
                pinned.add(match[0])
                self.prefixes.move_to_end(match[0])
            out.append((rows, call))
        return out

    def longest_prefix(self, tokens: list) -> tuple[int, int] | None:
        """(cached slot, n) of the cached prefix sharing the most leading tokens with `tokens`,
        n < len(tokens) (the last prompt token is prefilled: its logits sample the next token);
        None when none shares one."""
        best = None
        for slot, (cached, _) in self.prefixes.items():
            n = min(len(cached), len(tokens) - 1)
            k = next((i for i in range(n) if cached[i] != tokens[i]), n)
            if k and (best is None or k > best[1]):
                best = (slot, k)
        return best

    # ------------------------------------------------------------------ offload
    def slots_wanted(self) -> int:
        """Slots the oldest waiting work needs: every offloaded row a generate waits on, else the
        head admission's group."""
        back = sum(1 for r in self.offloaded if r.request is not None)
        return back or (len(self.admissions[0][0]) if self.admissions else 0)

    def idle(self) -> list[Row]:
        """Holding rows no generate covers, idle longest first (offload candidates)."""
        return sorted((r for s, r in self.rows.items() if r.request is None and s not in self.to_release),
                      key=lambda r: r.last_used)

    def offload_victims(self) -> list[Row]:
        """Idle rows to move to host memory so the oldest waiting work fits (cached prefixes
        count as free: admission evicts them first)."""
        short = self.slots_wanted() - len(self.pool.free) - len(self.prefixes)
        return self.idle()[:max(short, 0)]

    def offload(self, r: Row, host) -> bool:
        """Row `r`'s slot state is `host`: free its slot. False (nothing done) when a generate
        took the row since it was chosen."""
        if r.request is not None or self.rows.get(r.slot) is not r or r.slot in self.to_release:
            return False
        del self.rows[r.slot]
        self.pool.release([r.slot])
        r.slot, r.host = -1, host
        self.offloaded.append(r)
        return True

    def swap_in_ready(self) -> list[Row]:
        """Offloaded rows a generate waits on that get a slot now (cached prefixes evicted for
        room), in offload order; the engine writes their state back before anything runs."""
        out = []
        for r in [r for r in self.offloaded if r.request is not None]:
            if not self.pool.free and self.prefixes:
                self._evict(next(iter(self.prefixes)))
            slots = self.pool.alloc(1)
            if slots is None:
                break
            self.offloaded.remove(r)
            r.slot = slots[0]
            self.rows[r.slot] = r
            out.append(r)
        return out

    def drop_offloaded(self, rows) -> None:
        """Closed rows in host memory: forget their state."""
        for r in rows:
            r.host = None
            if r in self.offloaded:
                self.offloaded.remove(r)

    def _evict(self, slot: int) -> None:
        del self.prefixes[slot]
        self.pool.release([slot])

    def flush_prefixes(self) -> None:
        """Drop every cached prefix (new weights: their caches are stale)."""
        for slot in list(self.prefixes):
            self._evict(slot)

    def new_weights(self) -> None:
        """Weights changed: every cached prefix is stale, and so is every row admitted before (its
        cache, once released, is never cached: `release_closed`)."""
        self.weights_epoch += 1
        self.flush_prefixes()

    def release_closed(self) -> None:
        for s in self.to_release:
            if self.rows.get(s) is not None and self.rows[s].request is None:
                r = self.rows.pop(s)
                r.slot = -1
                if self.prefix_cache_slots and r.length and r.kv_epoch == self.weights_epoch:
                    self.prefixes[s] = (r.tokens[:r.length], r.expert_chunks)
                    while len(self.prefixes) > self.prefix_cache_slots:
                        self._evict(next(iter(self.prefixes)))
                else:
                    self.pool.release([s])
        self.to_release = [s for s in self.to_release if s in self.rows]

    def stuck(self, offload: bool = False) -> bool:
        """Groups wait for slots that nothing will free: no row is decoding and no closed
        group is pending release (every slot is held by an open, idle group; with `offload`,
        none is idle either)."""
        return (bool(self.admissions) and not self.decoding() and not self.to_release and not self.prefixes
                and not (offload and self.idle()))

    # ------------------------------------------------------------------ work selection
    def decoding(self) -> list[Row]:
        return [r for r in self.rows.values() if r.request is not None]

    def to_prefill(self) -> list[Row]:
        """Rows whose next decode needs their pending tokens in the cache."""
        return [r for r in self.decoding() if r.pending]

    def ready(self) -> list[Row]:
        return [r for r in self.decoding() if not r.pending]

    def needed_capacity(self, ready: list[Row]) -> int:
        """Cache positions the next decode call may write: every held row keeps its tokens; a
        decoding row may add up to its budget for this call (+ k draft slots)."""
        held = max((r.length for r in self.rows.values()), default=1)
        w = self.num_steps * (self.spec_k + 1)
        grow = max((r.length + min(self.budget(r), w) + self.spec_k for r in ready), default=0)
        return max(held, grow, 1)

    def budget(self, r: Row) -> int:
        req = r.request
        return max(0, min(req.params.max_new_tokens - len(req.gen.tokens), self.max_len - r.length))

    # ------------------------------------------------------------------ program inputs
    def prefill_batch(self, rows: list[Row], chunk: int, len_buckets, batch: int, slots: int, *,
                      aligned: bool = False):
        """numpy inputs of `programs.prefill` for the first `chunk` pending tokens of `rows`:
        (chunks, at, args), `at[j]` the batch row of rows[j]. aligned: `programs.prefill_pool`'s
        (the batch is the pool, `batch` == `slots`: each row at its slot, no slot index)."""
        chunks = [r.pending[:chunk] for r in rows]
        t = bucket(len_buckets, max(len(c) for c in chunks))
        idx = np.full((batch,), slots, np.int32)
        tokens = np.zeros((batch, t), np.int32)
        positions = np.zeros((batch, t), np.int32)
        seg = np.zeros((batch, t), np.int32)
        last = np.zeros((batch,), np.int32)
        at = [r.slot if aligned else j for j, r in enumerate(rows)]
        for j, r, c in zip(at, rows, chunks):
            idx[j] = r.slot
            tokens[j, :len(c)] = c
            positions[j, :len(c)] = np.arange(r.length, r.length + len(c))
            seg[j, :len(c)] = 1
            last[j] = len(c) - 1
        args = (tokens, positions, seg, last) if aligned else (idx, tokens, positions, seg, last)
        return chunks, at, args

    def absorb_prefill(self, rows: list[Row], chunks: list, at: list, experts: np.ndarray, version: int) -> None:
        """experts `[B, T, L, K]` of the prefilled chunk, rows[j]'s at batch row at[j]."""
        for j, r, c in zip(at, rows, chunks):
            r.expert_chunks.append(np.ascontiguousarray(experts[j, :len(c)]))
            r.length += len(c)
            r.logits_version = version

    def decode_inputs(self, ready: list[Row], slots: int, key_shape) -> dict:
        """numpy fields of `programs.SlotInputs` for a pool of `slots` (only `ready` rows active)."""
        n_stop = max([len(r.request.stops) for r in ready] + [1])
        n_stop = -(-n_stop // 8) * 8  # padded: few shapes
        f = dict(length=np.zeros((slots,), np.int32), active=np.zeros((slots,), bool),
                 budget=np.zeros((slots,), np.int32), rng=np.zeros((slots, *key_shape), np.uint32),
                 temperature=np.zeros((slots,), np.float32), top_k=np.zeros((slots,), np.int32),
                 top_p=np.ones((slots,), np.float32), stops=np.full((slots, n_stop), -1, np.int32))
        for r in ready:
            s, p = r.slot, r.request.params
            f["length"][s], f["active"][s], f["budget"][s] = r.length, True, self.budget(r)
            f["rng"][s] = r.request.rng
            f["temperature"][s], f["top_k"][s], f["top_p"][s] = p.temperature, p.top_k, p.top_p
            f["stops"][s, :len(r.request.stops)] = sorted(r.request.stops)
        return f

    def absorb_decode(self, ready: list[Row], out: dict, version: int) -> None:
        """Emitted tokens (numpy fields of `programs.Emitted`) into rows and their requests; a
        row that stopped, spent its budget or reached max_len finishes its request."""
        self.tick += 1
        for r in ready:
            s, req = r.slot, r.request
            c = int(out["count"][s])
            if c == 0:
                continue
            new = [int(t) for t in out["tokens"][s, :c]]
            gen = req.gen
            gen.tokens += new
            gen.logprobs += [float(x) for x in out["logprobs"][s, :c]]
            gen.policy_version += [r.logits_version] + [version] * (c - 1)
            experts = np.ascontiguousarray(out["experts"][s, :c])
            gen.expert_ids.append(experts)
            r.last_used = self.tick
            r.tokens += new
            r.expert_chunks.append(experts)
            r.length += c
            r.logits_version = version
            # a streaming caller may cancel the row (stop string seen, client gone): it leaves now
            halt = req.on_tokens(new, gen.logprobs[-c:]) if req.on_tokens is not None else False
            if bool(out["stopped"][s]):
                self.finish(r, "stop")
            elif r.length >= self.max_len:
                self.finish(r, "max_len")
            elif len(gen.tokens) >= req.params.max_new_tokens:
                self.finish(r, "length")
            elif halt:
                self.finish(r, "cancelled")

    def finish(self, r: Row, reason: str) -> None:
        req = r.request
        gen = req.gen
        gen.finish_reason = reason
        gen.expert_ids = (np.concatenate(gen.expert_ids) if gen.expert_ids
                          else np.zeros((0, *self.expert_shape), self.expert_dtype))
        r.finish_reason = reason
        r.request, r.result = None, gen
        req.call.finish_one()

    def fail_all(self, error: BaseException) -> None:
        """The engine thread failed: every waiting caller gets the error (never a hang)."""
        for r in self.decoding() + [r for r in self.offloaded if r.request is not None]:
            r.request.call.fail(error)
            r.request = None
        for _, call in self.admissions:
            call.fail(error)
        self.admissions = []
