"""The trajectory log: every served completion, token in and token out, and the users' feedback,
in rolling Parquet shards at a store URL (a local path or `gs://...`, through fsspec).

    log = TrajectoryLog(url, flush_seconds=30, retention_days=30)
    log.log_completion(record)          # any thread; buffered
    log.log_feedback(record)
    log.flush(); log.close()
    for record in read_completions(url, start, end): ...     # the records of [start, end)
    for record in read_feedback(url, start, end): ...

Layout at `url` (`serve.log_store`, default `{workdir}/serve/trajectories`):

    {url}/completions/date=2025-01-31/{first_ms}-{last_ms}-{writer}-{seq}.parquet
    {url}/feedback/date=2025-01-31/{first_ms}-{last_ms}-{writer}-{seq}.parquet

A shard holds what one writer (a server process, `writer` = its random id) buffered: it is
written when `flush_seconds` passed since the last one or 4096 records wait, and on close, so
a record reaches the store within `flush_seconds` of its completion. `first_ms` / `last_ms`
are the shard's first and last record times (unix milliseconds), so a reader of a window opens
only the shards that overlap it; shards sit in the UTC day of their first record. A shard is
written to a hidden temporary name and renamed on a local disk (an object store's single write
is atomic), so a reader never sees half a shard. With `retention_days > 0` a writer deletes
the day directories whose records are all older than that (checked at most once an hour).

A completion record (one per choice of a chat completion; `COMPLETION_SCHEMA`):

| field | type | meaning |
|---|---|---|
| `time` | float64 | unix seconds when the completion finished |
| `request_id` | string | the HTTP request (`X-Request-Id` header, else generated) |
| `completion_id` | string | the response's `id` (`chatcmpl-...`); with `n > 1`, shared by its choices |
| `choice` | int32 | the choice's index |
| `conversation_id` | string | the conversation it continues (given by the client, or derived) |
| `client_id` | string | the client (the request's `user`, or `X-Client-Id`; "" if neither) |
| `model` | string | the served model's name |
| `prompt_ids` | list<int32> | exactly the ids the engine was given (rendered chat + `<\\|assistant\\|>`) |
| `completion_ids` | list<int32> | exactly the ids the engine sampled (the stop token included) |
| `logprobs` | list<float32> | the engine's recorded logprob of each sampled id (`log_softmax(logits / T)`) |
| `versions` | list<int32> | the policy version that sampled each id |
| `policy_version` | int32 | the version of the first sampled id (the engine's when none) |
| `expert_ids` | binary | routing of every prompt and sampled id, `[len(prompt) + len(completion), moe_layers, top_k]` C order |
| `expert_dtype` | string | `uint8` or `uint16` |
| `moe_layers`, `top_k` | int32 | the routing's trailing shape |
| `temperature`, `top_p` | float32 | sampling settings (the learner divides logits by the same T; 0 = greedy) |
| `sampling_top_k`, `max_tokens` | int32 | the other sampling settings |
| `finish_reason` | string | the engine's: `stop`, `length` or `max_len` |
| `tool_calls`, `broken_calls` | int32 | well-formed calls returned in `tool_calls`; malformed ones (then the reply went back as text) |
| `broken_reason` | string | why the first malformed call is broken ("" when none) |
| `stream` | bool | served as server-sent events |

A feedback record (`FEEDBACK_SCHEMA`): `time`, `feedback_id`, `completion_id` and / or
`conversation_id` ("" when not given), `choice` (-1 = every choice), `signal` (a name of
`coder.rl.realtime.SIGNALS`), `value` (float64), `client_id`.

Nothing else is written: no request headers, no API keys, no message text (the prompt is its
ids). Token in, token out: the ids are the engine's, never re-tokenized from text.
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

COMPLETION_SCHEMA = pa.schema([
    ("time", pa.float64()),
    ("request_id", pa.string()),
    ("completion_id", pa.string()),
    ("choice", pa.int32()),
    ("conversation_id", pa.string()),
    ("client_id", pa.string()),
    ("model", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("completion_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    ("versions", pa.list_(pa.int32())),
    ("policy_version", pa.int32()),
    ("expert_ids", pa.binary()),
    ("expert_dtype", pa.string()),
    ("moe_layers", pa.int32()),
    ("top_k", pa.int32()),
    ("temperature", pa.float32()),
    ("top_p", pa.float32()),
    ("sampling_top_k", pa.int32()),
    ("max_tokens", pa.int32()),
    ("finish_reason", pa.string()),
    ("tool_calls", pa.int32()),
    ("broken_calls", pa.int32()),
    ("broken_reason", pa.string()),
    ("stream", pa.bool_()),
])

FEEDBACK_SCHEMA = pa.schema([
    ("time", pa.float64()),
    ("feedback_id", pa.string()),
    ("completion_id", pa.string()),
    ("conversation_id", pa.string()),
    ("choice", pa.int32()),
    ("signal", pa.string()),
    ("value", pa.float64()),
    ("client_id", pa.string()),
])

KINDS = {"completions": COMPLETION_SCHEMA, "feedback": FEEDBACK_SCHEMA}
MAX_RECORDS = 4096  # a shard is written when this many records wait, whatever the time
_SHARD = re.compile(r"(\d{13})-(\d{13})-([0-9a-z]+)-(\d{6})\.parquet$")
_DAY = re.compile(r"date=(\d{4}-\d{2}-\d{2})$")
_DAY_S = 86400.0


def _fs(url: str):
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def _day(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d")


def _day_start(day: str) -> float:
    d = datetime.datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=datetime.timezone.utc)
    return d.timestamp()


def _ls(fs, path: str) -> list[str]:
    try:
        return [p.rstrip("/") for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


class ShardWriter:
    """Buffers the records of one table and writes them as Parquet shards under `url`
    (`{url}/date=YYYY-MM-DD/{first_ms}-{last_ms}-{writer}-{seq}.parquet`). Thread-safe."""

    def __init__(self, url: str, schema: pa.Schema, *, writer: str | None = None,
                 max_records: int = MAX_RECORDS, retention_days: float = 0.0):
        self.url = url
        self.fs, self.root = _fs(url)
        self.schema = schema
        self.names = set(schema.names)
        self.writer = writer or f"{os.getpid():x}{uuid.uuid4().hex[:8]}"
        self.max_records = int(max_records)
        self.retention_s = float(retention_days) * _DAY_S
        self._buf: list[dict] = []
        self._lock = threading.Lock()  # the buffer
        self._write_lock = threading.Lock()  # shard numbers and writes, in order
        self._seq = 0
        self._expired_at = 0.0
        self.written = 0  # records written so far

    def append(self, record: dict) -> None:
        missing, extra = self.names - set(record), set(record) - self.names
        if missing or extra:
            raise ValueError(f"trajectory log record: missing fields {sorted(missing)}, unknown "
                             f"fields {sorted(extra)} (schema: {self.schema.names})")
        with self._lock:
            self._buf.append(record)
            full = len(self._buf) >= self.max_records
        if full:
            self.flush()

    def flush(self) -> str | None:
        """Writes what is buffered as one shard; returns its path (None when nothing waited)."""
        with self._write_lock:
            with self._lock:
                records, self._buf = self._buf, []
            try:
                path = self._write(records) if records else None
            except BaseException:
                with self._lock:  # kept for the next flush
                    self._buf = records + self._buf
                raise
            self._expire()
            return path

    def _write(self, records: list[dict]) -> str:
        records.sort(key=lambda r: r["time"])
        first, last = records[0]["time"], records[-1]["time"]
        name = f"{math.floor(first * 1000):013d}-{math.ceil(last * 1000):013d}-{self.writer}-{self._seq:06d}.parquet"
        self._seq += 1
        directory = f"{self.root}/date={_day(first)}"
        table = pa.Table.from_pylist(records, schema=self.schema)
        path = f"{directory}/{name}"
        self.fs.makedirs(directory, exist_ok=True)
        if _is_local(self.fs):  # hidden temporary name, then an atomic rename
            tmp = f"{directory}/.{name}.tmp"
            with self.fs.open(tmp, "wb") as f:
                pq.write_table(table, f)
            self.fs.mv(tmp, path)
        else:  # an object store's single write is atomic
            with self.fs.open(path, "wb") as f:
                pq.write_table(table, f)
        self.written += len(records)
        return path

    def _expire(self) -> None:
        """Deletes the day directories older than the retention (at most once an hour)."""
        now = time.time()
        if self.retention_s <= 0 or now - self._expired_at < 3600:
            return
        self._expired_at = now
        for d in _ls(self.fs, self.root):
            m = _DAY.search(d)
            if m and _day_start(m.group(1)) + _DAY_S <= now - self.retention_s:
                logging.info("trajectory log: %s is past the retention of %.1f days, deleted", d,
                             self.retention_s / _DAY_S)
                self.fs.rm(d, recursive=True)


class TrajectoryLog:
    """Completions and feedback at `url` (module docstring), flushed by a background thread
    every `flush_seconds` (0: every record is written at once, as its own shard)."""

    def __init__(self, url: str, *, flush_seconds: float = 30.0, retention_days: float = 0.0,
                 max_records: int = MAX_RECORDS):
        self.url = url.rstrip("/")
        self.flush_seconds = float(flush_seconds)
        writer = f"{os.getpid():x}{uuid.uuid4().hex[:8]}"
        kw = dict(writer=writer, max_records=max_records, retention_days=retention_days)
        self.completions = ShardWriter(f"{self.url}/completions", COMPLETION_SCHEMA, **kw)
        self.feedback = ShardWriter(f"{self.url}/feedback", FEEDBACK_SCHEMA, **kw)
        self._stop = threading.Event()
        self._thread = None
        if self.flush_seconds > 0:
            self._thread = threading.Thread(target=self._flusher, name="trajectory-log", daemon=True)
            self._thread.start()

    def log_completion(self, record: dict) -> None:
        self.completions.append(record)
        if self.flush_seconds <= 0:
            self.completions.flush()

    def log_feedback(self, record: dict) -> None:
        self.feedback.append(record)
        if self.flush_seconds <= 0:
            self.feedback.flush()

    def flush(self) -> None:
        self.completions.flush()
        self.feedback.flush()

    def _flusher(self) -> None:
        while not self._stop.wait(self.flush_seconds):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the records stay buffered for the next flush
                logging.exception("trajectory log: writing a shard to %s failed", self.url)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()


# --- reading --------------------------------------------------------------------------------------
def shards(url: str, kind: str, start: float | None = None, end: float | None = None) -> list[str]:
    """Paths of the `kind` shards at `url` that may hold records of [start, end), oldest first."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; kinds are {sorted(KINDS)}")
    fs, root = _fs(f"{url.rstrip('/')}/{kind}")
    days = sorted(d for d in _ls(fs, root) if _DAY.search(d))
    lo = -math.inf if start is None else start * 1000
    hi = math.inf if end is None else end * 1000
    found = []
    for d in days:
        day0 = _day_start(_DAY.search(d).group(1))
        # a shard sits in the day of its first record and may run past midnight: look one day back
        if (start is not None and day0 + 2 * _DAY_S <= start) or (end is not None and day0 >= end):
            continue
        for p in _ls(fs, d):
            m = _SHARD.search(p)
            if m and not os.path.basename(p).startswith(".") and int(m.group(2)) >= lo and int(m.group(1)) < hi:
                found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def read(url: str, kind: str, start: float | None = None, end: float | None = None) -> Iterator[dict]:
    """Yields the `kind` records with start <= time < end (None: unbounded), shard by shard
    (oldest shard first; by time within a shard)."""
    fs, _ = _fs(url)
    for path in shards(url, kind, start, end):
        with fs.open(path, "rb") as f:
            table = pq.read_table(f)
        for r in table.to_pylist():
            if (start is None or r["time"] >= start) and (end is None or r["time"] < end):
                yield r


def read_completions(url: str, start: float | None = None, end: float | None = None) -> Iterator[dict]:
    return read(url, "completions", start, end)


def read_feedback(url: str, start: float | None = None, end: float | None = None) -> Iterator[dict]:
    return read(url, "feedback", start, end)


def expert_array(record: dict) -> np.ndarray:
    """A completion record's routing as `[len(prompt) + len(completion), moe_layers, top_k]`."""
    n = len(record["prompt_ids"]) + len(record["completion_ids"])
    a = np.frombuffer(record["expert_ids"], np.dtype(record["expert_dtype"]))
    return a.reshape(n, int(record["moe_layers"]), int(record["top_k"]))
