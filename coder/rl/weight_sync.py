"""The weight store: every learner version at a URL, as anchors and zstd-compressed XOR deltas.

The learner publishes each new version of its weights (already cast to the serving dtype, e.g.
bfloat16 through ml_dtypes, or float32) as a flat {name: numpy array}; actors poll the store and
apply what changed. Between two RL steps ~98-99% of bf16 weights keep every bit, so version v is
stored as the XOR of its bytes with version v-1's, zstd-compressed, and every `anchor_every`
versions (and a publisher's first, and any leaf whose delta would not be smaller) in full.
Lossless: a reader reconstructs the published bytes exactly and checks each leaf's sha256.

    publish(url, v, flat, anchor_every=10) -> {"bytes", "raw_bytes", "anchor_leaves", ...}
    load(url, version=None) -> (version, flat)           # latest complete version by default
    WeightPublisher(url, shard=(i, n))                   # stateful: holds the last bytes it wrote
    WeightReader(url).poll() -> (version, flat) | None   # stateful: applies deltas to its copy
    local_slices({name: jax.Array}) -> {name@index: Slice}  # this process's share, for publish
    WeightReader(url, shardings={name: Sharding})        # reads only its devices' slices -> jax.Arrays
    gc(url, keep_from=v)                                 # drops what no reader of >= v needs

The channel between a learner and its engines over this store (a model in, an engine out) is
coder/rl/weight_channel.py: ModelPublisher, StoreLoad, EngineFollower.

Layout at `url` (a local path, `memory://...`, `gs://...` or `s3://...`, through fsspec; gcsfs for
gs://, the s3 extra's s3fs for s3://):

    {url}/v0000000007/part-00000-of-00002.json   writer 0's part of version 7's manifest
    {url}/v0000000007/part-00000-of-00002.bin    the payloads of its leaves, one after another
    {url}/v0000000007/part-00001-of-00002.json   writer 1's ...
    {url}/v0000000007/part-00001-of-00002.bin

Each learner host writes what it owns (`shard=(process_index, process_count)`): either whole
leaves (numpy arrays, split e.g. by `split_leaves`) or, for a state sharded over the job's
devices, the slices its own devices hold (`local_slices`: every shard with replica_id 0, so each
element is written once in the whole job and no host ever gathers a leaf). Its payloads go
first, then its manifest part (the commit marker; renamed into place on a local disk, a single
object write elsewhere). Version v is *complete*
when the parts 0..n-1 of one writer count n all exist and agree on version, parent and session.
A manifest part:

    {"format": 1, "version": 7, "parent": 6, "session": "5", "shard": [0, 2],
     "data": "part-00000-of-00002.bin",
     "leaves": {"layers.0.attn.wq": {"shape": [128, 64], "dtype": "bfloat16",
                                     "sha256": hex digest of the leaf's bytes at version 7,
                                     "kind": "anchor" | "delta",
                                     "base_sha256": (delta only) sha256 of the parent's bytes,
                                     "offset": 0, "length": 5321},
                "layers.0.attn.wo@0:64,0:128": {... as above, the slice's own shape, hash and
                                                 payload, and "global_shape": [128, 128]}, ...}}

A slice entry is named `leaf@start:stop,...` (one range per dimension, `leaf@` for a scalar):
readers assemble a leaf from its slices, and a reader given target shardings (`WeightReader(url,
shardings=...)`) reads only the slices that overlap its own devices' shards, whatever the
writers' sharding was (resharding through the store: no process reads or holds more than the
slices its devices need, plus the overlap where the two shardings' boundaries differ). Slices
chain their deltas like leaves, so a reader keeps its bytes per slice between versions.

    anchor payload = the leaf's bytes (C order, little-endian as numpy holds them)
    delta payload  = zstd(byteplanes(bytes_v XOR bytes_parent)); byteplanes puts byte k of every
                     element together (bf16: the sign/exponent bytes, nearly all 0, then the
                     mantissa bytes), which zstd compresses better than the interleaved bytes

`parent` is the version the writer published before (v-1 when it publishes every version);
`session` names one run of the publishers (default: the version a publisher started at) so a
restarted learner's parts never complete a version together with its previous run's. A
publisher that starts (or restarts at a version <= its last) writes anchors and first deletes
its own parts of that version and every later one: those were a previous run's future.

Reading version v from scratch follows `parent` from v down to each leaf's anchor and applies
the deltas upwards, checking every intermediate sha256; a leaf whose hash fails raises
CorruptLeaf naming the leaf and the version; a parent that is missing (deleted, never written)
or whose bytes are not the delta's base raises VersionGap. A `WeightReader` that holds version
u applies only the deltas after u when they chain to its bytes (each delta names the sha256 of
its base), else (it missed versions that were collected, or the learner restarted) it starts
again from the anchors, whichever reads fewer bytes.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import time

import fsspec
import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 types with numpy)
import numpy as np
import zstandard

FORMAT = 1
_VERSION_DIR = re.compile(r"v(\d{10})$")
_PART = re.compile(r"part-(\d{5})-of-(\d{5})\.json$")


class WeightStoreError(RuntimeError):
    """The store cannot give the requested version."""


class CorruptLeaf(WeightStoreError):
    """A leaf's bytes do not match its sha256 (or its payload does not decode)."""


class VersionGap(WeightStoreError):
    """A version's chain to its anchors is broken (a parent missing or not the delta's base)."""


def _vdir(version: int) -> str:
    return f"v{int(version):010d}"


def _part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def _sha(buf) -> str:
    return hashlib.sha256(memoryview(buf)).hexdigest()


def _leaf_bytes(a) -> np.ndarray:
    """A copy of the array's bytes as a flat uint8 array (C order)."""
    a = np.asarray(a)
    if a.dtype.hasobject:
        raise TypeError(f"cannot store an array of dtype {a.dtype}")
    return np.array(a, order="C", copy=True).reshape(-1).view(np.uint8)


def _planes(u8: np.ndarray, itemsize: int) -> np.ndarray:
    return u8 if itemsize == 1 else u8.reshape(-1, itemsize).T.copy().reshape(-1)


def _unplanes(u8: np.ndarray, itemsize: int) -> np.ndarray:
    return u8 if itemsize == 1 else u8.reshape(itemsize, -1).T.copy().reshape(-1)


def _fs(url: str):
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def split_leaves(flat: dict, count: int) -> list[dict]:
    """`flat` split into `count` parts of about equal bytes (largest leaves first, each to the
    lightest part): the same split on every host, from names and sizes only."""
    parts, load = [dict() for _ in range(count)], [0] * count
    for name in sorted(flat, key=lambda k: (-np.asarray(flat[k]).nbytes, k)):
        i = min(range(count), key=lambda j: (load[j], j))
        parts[i][name] = flat[name]
        load[i] += np.asarray(flat[name]).nbytes
    return parts


# ------------------------------------------------------------------------- slices

SLICE_SEP = "@"


@dataclasses.dataclass(frozen=True)
class Slice:
    """One region of a leaf, for `publish`: `data` is leaf[index] of a leaf of `global_shape`;
    `index` is ((start, stop), ...), one range per dimension."""

    data: np.ndarray
    index: tuple
    global_shape: tuple


def slice_name(leaf: str, index) -> str:
    """The store's name of `leaf`'s region `index`: 'wo@0:64,0:128' ('scale@' for a scalar)."""
    return leaf + SLICE_SEP + ",".join(f"{a}:{b}" for a, b in index)


def _parse_name(name: str):
    """(leaf, index) of a slice entry; (name, None) of a whole leaf."""
    leaf, sep, ranges = name.rpartition(SLICE_SEP)
    if not sep:
        return name, None
    return leaf, tuple(tuple(int(v) for v in r.split(":")) for r in ranges.split(",") if r)


def _ranges(index, shape) -> tuple:
    """A device's index (a tuple of python slices, as jax gives it) as ((start, stop), ...)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def _overlap(a, b):
    """The intersection of two regions ((start, stop), ...), or None when it is empty."""
    lo_hi = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in lo_hi) else lo_hi


CHUNK_BYTES = 64 << 20  # a slice entry's size cap: a reader of another sharding reads ~its share


def _chunks(index, itemsize: int, chunk_bytes: int) -> list:
    """`index` ((start, stop), ...) cut into a grid of chunks of at most `chunk_bytes` (at least
    one element): the dimension with the longest piece is halved until a piece fits, so chunks
    stay about cubic and a reader that splits any dimension reads about its share."""
    pieces = [1] * len(index)
    extent = lambda d: -(-(index[d][1] - index[d][0]) // pieces[d])
    while index and int(np.prod([extent(d) for d in range(len(index))], dtype=np.int64)) * itemsize > chunk_bytes:
        d = max(range(len(index)), key=lambda k: (extent(k), -k))
        if extent(d) <= 1:
            break
        pieces[d] *= 2
    cuts = [[(a + i * extent(d), min(b, a + (i + 1) * extent(d))) for i in range(pieces[d])
             if a + i * extent(d) < b] for d, (a, b) in enumerate(index)]
    return [tuple(cuts[d][i] for d, i in enumerate(ix)) for ix in np.ndindex(*[len(c) for c in cuts])]


def local_slices(flat: dict, *, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """This process's share of `flat` ({name: jax.Array or numpy array}) for `publish`: of every
    jax.Array the shards of this process's devices whose replica_id is 0 (each element is in
    exactly one process's share; a fully replicated leaf in one device's), cut into chunks of at
    most `chunk_bytes`, as {slice_name: Slice}; a numpy array, or a process's own jax.Array in a
    job of several processes (a host value every process holds), whole from process 0. The
    shards are copied to host one by one: no process gathers a leaf."""
    import jax  # heavy: jax (this module loads without it)

    out = {}
    for name, x in flat.items():
        if SLICE_SEP in name:
            raise ValueError(f"leaf name {name!r} contains {SLICE_SEP!r}, the store's slice separator")
        # a fully addressable array in a job of several processes is a process's own copy (every
        # process holds the same value): like a numpy leaf, process 0 writes it
        if isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable):
            for shard in x.addressable_shards:
                if shard.replica_id != 0:
                    continue
                index = _ranges(shard.index, x.shape)
                data = np.asarray(shard.data)
                for chunk in _chunks(index, data.dtype.itemsize, chunk_bytes):
                    local = tuple(slice(a - i0, b - i0) for (a, b), (i0, _) in zip(chunk, index))
                    out[slice_name(name, chunk)] = Slice(data[local], chunk, tuple(x.shape))
        elif jax.process_index() == 0:
            out[name] = np.asarray(x)
    return out


def _assemble(leaf: str, pieces, region, dtype) -> np.ndarray:
    """`region` ((start, stop), ...) of `leaf` from the stored `pieces` [(index, array)]."""
    out = np.empty(tuple(b - a for a, b in region), dtype)
    covered = 0
    for index, data in pieces:
        both = _overlap(index, region)
        if both is None:
            continue
        dst = tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(both, region))
        src = tuple(slice(lo - i0, hi - i0) for (lo, hi), (i0, _) in zip(both, index))
        out[dst] = data[src]
        covered += int(np.prod([hi - lo for lo, hi in both], dtype=np.int64))
    if covered != out.size:
        raise WeightStoreError(f"leaf {leaf}: the stored slices cover {covered} of the {out.size} "
                               f"elements of region {region} (missing or overlapping slices)")
    return out


# ------------------------------------------------------------------------- manifests

@dataclasses.dataclass
class Leaf:
    shape: tuple
    dtype: np.dtype
    sha256: str
    kind: str  # "anchor" | "delta"
    base_sha256: str | None
    data: str  # path of the part's data file
    offset: int
    length: int
    global_shape: tuple | None = None  # a slice entry's leaf shape (None: a whole leaf)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass
class Manifest:
    """A complete version: every part merged."""

    version: int
    parent: int | None
    session: str
    leaves: dict  # name -> Leaf


def _read_manifest(fs, root: str, version: int) -> Manifest | None:
    """Version `version`'s merged manifest, or None when it is missing or incomplete."""
    vdir = f"{root}/{_vdir(version)}"
    try:
        fs.invalidate_cache(vdir)
        names = [os.path.basename(p) for p in fs.ls(vdir, detail=False)]
    except FileNotFoundError:
        return None
    groups: dict[int, set] = {}
    for n in names:
        m = _PART.match(n)
        if m:
            groups.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    complete = [n for n, idx in groups.items() if idx == set(range(n))]
    if not complete:
        return None
    if len(complete) > 1:
        raise WeightStoreError(f"version {version} at {vdir} holds complete manifests of "
                               f"{sorted(complete)} writers")
    count = complete[0]
    parts = []
    for i in range(count):
        try:
            parts.append(json.loads(fs.cat_file(f"{vdir}/{_part_name(i, count)}.json")))
        except FileNotFoundError:  # deleted under us
            return None
    keys = {(p["version"], p["parent"], p["session"]) for p in parts}
    if len(keys) != 1:  # parts of two publisher runs: not (yet) a consistent version
        return None
    _, parent, session = keys.pop()
    leaves = {}
    for p in parts:
        for name, e in p["leaves"].items():
            if name in leaves:
                raise WeightStoreError(f"version {version}: leaf {name} is in two parts")
            leaves[name] = Leaf(tuple(e["shape"]), np.dtype(e["dtype"]), e["sha256"], e["kind"],
                                e.get("base_sha256"), f"{vdir}/{p['data']}", int(e["offset"]),
                                int(e["length"]),
                                tuple(e["global_shape"]) if "global_shape" in e else None)
    return Manifest(int(version), parent, session, leaves)


def _version_dirs(fs, root: str) -> list[int]:
    """Versions with a directory (complete or not), ascending."""
    try:
        fs.invalidate_cache(root)
        names = [os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_VERSION_DIR.match, names) if m)


def versions(url: str) -> list[int]:
    """The complete versions at `url`, ascending."""
    fs, root = _fs(url)
    return [v for v in _version_dirs(fs, root) if _read_manifest(fs, root, v) is not None]


def _latest(fs, root: str) -> Manifest | None:
    for v in reversed(_version_dirs(fs, root)):
        m = _read_manifest(fs, root, v)
        if m is not None:
            return m
    return None


def latest_version(url: str) -> int | None:
    """The newest complete version at `url` (None when there is none)."""
    m = _latest(*_fs(url))
    return None if m is None else m.version


# ------------------------------------------------------------------------- writing

class WeightPublisher:
    """Writes versions of one writer's leaves; holds the bytes it last wrote, so a delta never
    re-reads the store.

    Args:
      url: the store.
      shard: (index, count) of this writer among the learner hosts (each writes its own leaves).
      anchor_every: version v is written in full when v % anchor_every == 0 (and at a
        publisher's first version); the others as deltas against the previous version.
      level: zstd level of the deltas.
      session: the name shared by all writers of one run (default: the first version this
        publisher writes, the same on every host of a learner that starts or resumes together).
      threads: leaves encoded in parallel (0 = min(8, cpu count)).
    """

    def __init__(self, url: str, *, shard: tuple[int, int] | None = None, anchor_every: int = 10,
                 level: int = 3, session: str | None = None, threads: int = 0):
        self.url = url
        self.fs, self.root = _fs(url)
        self.shard = tuple(shard or (0, 1))
        if not 0 <= self.shard[0] < self.shard[1]:
            raise ValueError(f"shard={shard} must be (index, count) with 0 <= index < count")
        if anchor_every < 1:
            raise ValueError(f"anchor_every={anchor_every} must be >= 1")
        self.anchor_every, self.level = int(anchor_every), int(level)
        self.threads = int(threads) or min(8, os.cpu_count() or 1)
        self._session_arg = session
        self.session: str | None = None
        self.version: int | None = None
        self._last: dict = {}  # name -> (uint8 bytes, dtype, shape, sha256)

    def _start_session(self, version: int):
        """A previous run's parts of `version` and later ones are that run's future: remove ours."""
        mine = re.compile(rf"part-{self.shard[0]:05d}-of-\d{{5}}\.(json|bin)$")
        for v in _version_dirs(self.fs, self.root):
            if v < version:
                continue
            vdir = f"{self.root}/{_vdir(v)}"
            paths = sorted((p for p in self.fs.ls(vdir, detail=False) if mine.search(p)),
                           key=lambda p: not p.endswith(".json"))  # the manifest part first
            for p in paths:
                self.fs.rm_file(p)
            if paths:
                logging.info("weight store %s: removed %d stale part files of version %d",
                             self.url, len(paths), v)
        self.session = self._session_arg or str(version)
        self._last = {}
        self.version = None

    def _encode(self, item):
        name, arr = item
        a = np.asarray(arr.data if isinstance(arr, Slice) else arr)
        u8 = _leaf_bytes(a)
        sha = _sha(u8)
        last = self._last.get(name)
        anchor = (self._anchor or last is None or last[1] != a.dtype or last[2] != a.shape)
        if not anchor:
            xor = np.bitwise_xor(u8, last[0])
            payload = zstandard.ZstdCompressor(level=self.level).compress(
                _planes(xor, a.dtype.itemsize).data)
            if len(payload) < u8.size:  # else the full bytes are cheaper (a tiny leaf)
                return name, a, u8, sha, payload, last[3]
        return name, a, u8, sha, u8, None

    def publish(self, version: int, flat: dict) -> dict:
        """Writes `flat` (this writer's leaves: numpy arrays, or the `Slice`s of `local_slices`)
        as version `version`; returns
        {"version", "bytes" (written), "raw_bytes" (the leaves' full size), "anchor_leaves",
        "delta_leaves", "seconds"}."""
        t0 = time.perf_counter()
        version = int(version)
        if self.version is None or version <= self.version:
            self._start_session(version)
        parent = self.version
        self._anchor = parent is None or version % self.anchor_every == 0
        vdir = f"{self.root}/{_vdir(version)}"
        name = _part_name(*self.shard)
        self.fs.makedirs(vdir, exist_ok=True)
        entries, last, written, raw, kinds = {}, {}, 0, 0, {"anchor": 0, "delta": 0}
        with concurrent.futures.ThreadPoolExecutor(self.threads) as pool, \
                self.fs.open(f"{vdir}/{name}.bin", "wb") as f:
            for leaf, a, u8, sha, payload, base in pool.map(self._encode, sorted(flat.items())):
                kind = "anchor" if base is None else "delta"
                entries[leaf] = {"shape": list(a.shape), "dtype": a.dtype.name, "sha256": sha,
                                 "kind": kind, "offset": written, "length": len(payload)}
                if base is not None:
                    entries[leaf]["base_sha256"] = base
                if isinstance(flat[leaf], Slice):
                    entries[leaf]["global_shape"] = list(flat[leaf].global_shape)
                f.write(memoryview(payload))
                written += len(payload)
                raw += u8.size
                kinds[kind] += 1
                last[leaf] = (u8, a.dtype, a.shape, sha)
        manifest = json.dumps({"format": FORMAT, "version": version, "parent": parent,
                               "session": self.session, "shard": list(self.shard),
                               "data": f"{name}.bin", "leaves": entries}).encode()
        path = f"{vdir}/{name}.json"
        if _is_local(self.fs):  # a reader never sees half a manifest
            self.fs.pipe_file(path + ".tmp", manifest)
            self.fs.mv(path + ".tmp", path)
        else:  # one object write is atomic
            self.fs.pipe_file(path, manifest)
        self._last, self.version = last, version
        return {"version": version, "bytes": written + len(manifest), "raw_bytes": raw,
                "anchor_leaves": kinds["anchor"], "delta_leaves": kinds["delta"],
                "seconds": time.perf_counter() - t0}


_PUBLISHERS: dict = {}


def publish(url: str, version: int, flat: dict, *, anchor_every: int = 10, shard=None,
            level: int = 3, session: str | None = None) -> dict:
    """Writes version `version` of `flat` (name -> numpy array in the serving dtype) at `url`;
    returns at least {"bytes": bytes written} (WeightPublisher.publish).

    The process keeps one WeightPublisher per (url, shard), holding the last version's bytes,
    so consecutive calls write deltas; its first call, or a version <= the last one, starts a
    new session with anchors.
    """
    key = (url, tuple(shard or (0, 1)))
    pub = _PUBLISHERS.get(key)
    if pub is None:
        pub = _PUBLISHERS[key] = WeightPublisher(url, shard=shard, anchor_every=anchor_every,
                                                 level=level, session=session)
    pub.anchor_every, pub.level = int(anchor_every), int(level)
    return pub.publish(version, flat)


# ------------------------------------------------------------------------- reading

@dataclasses.dataclass
class _Held:
    """What a reader holds: a version and its leaves' bytes and hashes."""

    version: int
    session: str
    leaves: dict  # name -> (uint8 bytes, sha256)


def _plan(fs, root: str, target: Manifest, base: _Held | None, cache: dict, names=None):
    """How to build `target`'s leaves `names` (default all): (chain = [target, its parent, ...],
    start = {leaf: (index in chain of the first payload to read, from_base)}). A leaf starts at
    its newest anchor below the target, or, when `base` holds the delta's base bytes, from
    `base`. Raises VersionGap."""
    chain, start = [target], {}
    pending = set()
    for name in (target.leaves if names is None else names):
        e = target.leaves[name]
        if e.kind == "anchor":
            start[name] = (0, False)
        else:
            pending.add(name)
    cur = target
    while pending:
        i, p = len(chain) - 1, cur.parent
        if base is not None and p == base.version:
            for name in list(pending):
                held = base.leaves.get(name)
                if held is not None and held[1] == cur.leaves[name].base_sha256:
                    start[name] = (i, True)
                    pending.discard(name)
            if not pending:
                break
        leaf = min(pending)
        if p is None or p >= cur.version:
            raise VersionGap(f"version {cur.version}: leaf {leaf} is a delta without a parent")
        if p not in cache:
            cache[p] = _read_manifest(fs, root, p)
        m = cache[p]
        if m is None:
            raise VersionGap(f"version {target.version} needs version {p} (the parent of "
                             f"{cur.version}, for leaf {leaf}), which is not in the store "
                             f"{root} (deleted or never completed)")
        chain.append(m)
        for name in list(pending):
            e = m.leaves.get(name)
            if e is None or e.sha256 != cur.leaves[name].base_sha256:
                raise VersionGap(f"version {cur.version}: leaf {name}'s delta is not based on "
                                 f"version {p}'s bytes (a writer restarted without a new anchor?)")
            if e.kind == "anchor":
                start[name] = (len(chain) - 1, False)
                pending.discard(name)
        cur = m
    return chain, start


def _plan_bytes(chain, start) -> int:
    return sum(chain[j].leaves[n].length for n, (i, _) in start.items() for j in range(i + 1))


def _read_payloads(fs, m: Manifest, names) -> dict:
    """{leaf: payload bytes} of `names` in version `m`, each data file opened once."""
    by_file: dict[str, list] = {}
    for n in names:
        by_file.setdefault(m.leaves[n].data, []).append(n)
    out = {}
    for path, ns in by_file.items():
        try:
            with fs.open(path, "rb") as f:
                for n in sorted(ns, key=lambda k: m.leaves[k].offset):
                    e = m.leaves[n]
                    f.seek(e.offset)
                    out[n] = f.read(e.length)
        except FileNotFoundError:
            raise VersionGap(f"version {m.version}: data file {path} is gone") from None
    return out


def _build(fs, chain, start, base: _Held | None, verify: bool) -> dict:
    """{leaf: uint8 bytes} of chain[0], applying payloads from the deepest version up."""
    cur = {n: base.leaves[n][0] for n, (_, from_base) in start.items() if from_base}
    dctx = zstandard.ZstdDecompressor()
    for j in range(len(chain) - 1, -1, -1):
        m = chain[j]
        names = [n for n, (i, _) in start.items() if i >= j]
        payloads = _read_payloads(fs, m, names)
        for n in names:
            e, payload = m.leaves[n], payloads[n]
            if len(payload) != e.length:
                raise CorruptLeaf(f"leaf {n} of version {m.version}: {len(payload)} of "
                                  f"{e.length} payload bytes")
            if e.kind == "anchor":
                new = np.frombuffer(payload, np.uint8)
            else:
                try:
                    xor = np.frombuffer(dctx.decompress(payload, max_output_size=e.nbytes), np.uint8)
                except zstandard.ZstdError as err:
                    raise CorruptLeaf(f"leaf {n} of version {m.version}: delta does not "
                                      f"decode ({err})") from None
                if xor.size != e.nbytes or cur[n].size != e.nbytes:
                    raise CorruptLeaf(f"leaf {n} of version {m.version}: delta of {xor.size} "
                                      f"bytes, leaf of {e.nbytes}")
                new = np.bitwise_xor(cur[n], _unplanes(xor, e.dtype.itemsize))
            if new.size != e.nbytes:
                raise CorruptLeaf(f"leaf {n} of version {m.version}: {new.size} bytes, the "
                                  f"manifest says {e.nbytes}")
            if (verify or j == 0) and _sha(new) != e.sha256:
                raise CorruptLeaf(f"leaf {n} of version {m.version} fails its sha256 check")
            cur[n] = new
    return cur


class WeightReader:
    """An actor's view of the store: holds its last version's bytes and applies what is new.

        reader = WeightReader(url)
        got = reader.poll()          # None, or (version, flat) of the newest complete version

    With `shardings` ({leaf: jax.sharding.Sharding}, one per leaf of the store) the reader reads
    only the stored slices that overlap the shards of this process's devices, keeps only those
    bytes, and returns {leaf: jax.Array} in those shardings (each process of a job builds its own
    reader: together they make global arrays, `jax.make_array_from_callback`). Without, it reads
    everything and returns whole numpy leaves.
    """

    def __init__(self, url: str, *, verify: bool = True, shardings: dict | None = None):
        self.url = url
        self.fs, self.root = _fs(url)
        self.verify = verify
        self.shardings = shardings
        self._held: _Held | None = None
        self.last_read: dict = {}  # {"version", "bytes" read, "seconds", "from": "delta" | "anchor"}

    @property
    def version(self) -> int | None:
        return None if self._held is None else self._held.version

    def _wanted(self, m: Manifest) -> list[str]:
        """The entries of `m` this reader needs: all, or those overlapping its devices' shards."""
        if self.shardings is None:
            return sorted(m.leaves)
        regions, out = {}, []
        for name, e in sorted(m.leaves.items()):
            leaf, index = _parse_name(name)
            shape = e.shape if index is None else e.global_shape
            if leaf not in self.shardings:
                raise WeightStoreError(f"version {m.version} holds leaf {leaf}, which the reader "
                                       f"of {self.url} has no sharding for")
            if leaf not in regions:
                regions[leaf] = [_ranges(i, shape) for i in
                                 self.shardings[leaf].addressable_devices_indices_map(shape).values()]
            index = index or tuple((0, n) for n in shape)
            if any(_overlap(index, r) is not None for r in regions[leaf]):
                out.append(name)
        missing = set(self.shardings) - {_parse_name(n)[0] for n in m.leaves}
        if missing:
            raise WeightStoreError(f"version {m.version} of {self.url} lacks the leaves "
                                   f"{sorted(missing)[:5]} ({len(missing)} in all)")
        return out

    def _output(self, m: Manifest) -> dict:
        """{leaf: array} from the held bytes: whole numpy leaves, or jax.Arrays in `shardings`."""
        pieces: dict = {}  # leaf -> (global shape, dtype, [(index, array)])
        for name, (u8, _) in self._held.leaves.items():
            e = m.leaves[name]
            leaf, index = _parse_name(name)
            shape = e.shape if index is None else e.global_shape
            pieces.setdefault(leaf, (shape, e.dtype, []))[2].append(
                (index or tuple((0, n) for n in shape), u8.view(e.dtype).reshape(e.shape)))
        out = {}
        for leaf, (shape, dtype, parts) in pieces.items():
            if self.shardings is None:
                whole = tuple((0, n) for n in shape)
                out[leaf] = (parts[0][1] if len(parts) == 1 and parts[0][0] == whole
                             else _assemble(leaf, parts, whole, dtype))
            else:
                import jax  # heavy: jax (this module loads without it)

                out[leaf] = jax.make_array_from_callback(
                    shape, self.shardings[leaf],
                    lambda idx, leaf=leaf, shape=shape, dtype=dtype, parts=parts:
                        _assemble(leaf, parts, _ranges(idx, shape), dtype))
        return out

    def load(self, version: int | None = None) -> tuple[int, dict]:
        """Version `version` (default: the newest complete one) as (version, {name: array});
        from the reader's own bytes when they chain to it, else from the anchors."""
        t0 = time.perf_counter()
        if version is None:
            target = _latest(self.fs, self.root)
            if target is None:
                raise WeightStoreError(f"no complete version in the weight store {self.url}")
        else:
            target = _read_manifest(self.fs, self.root, int(version))
            if target is None:
                raise VersionGap(f"version {version} is not in the weight store {self.url} "
                                 "(missing, deleted or incomplete)")
        return self._load(target, t0)

    def _load(self, target: Manifest, t0: float) -> tuple[int, dict]:
        cache: dict = {target.version: target}
        names = self._wanted(target)
        plans = []
        if self._held is not None:
            try:
                plans.append((self._held, *_plan(self.fs, self.root, target, self._held, cache, names)))
            except VersionGap:
                pass
        try:
            plans.append((None, *_plan(self.fs, self.root, target, None, cache, names)))
        except VersionGap:
            if not plans:
                raise
        base, chain, start = min(plans, key=lambda p: _plan_bytes(p[1], p[2]))
        leaves = _build(self.fs, chain, start, base, self.verify)
        self._held = _Held(target.version, target.session,
                           {n: (leaves[n], target.leaves[n].sha256) for n in names})
        self.last_read = {"version": target.version, "bytes": _plan_bytes(chain, start),
                          "held_bytes": sum(u8.size for u8, _ in self._held.leaves.values()),
                          "seconds": time.perf_counter() - t0,
                          "from": "delta" if any(b for _, b in start.values()) else "anchor"}
        return target.version, self._output(target)

    def poll(self) -> tuple[int, dict] | None:
        """The newest complete version if it is not the one held (another version number, or the
        same number with other bytes: a restarted learner's), else None. A version deleted while
        it is read (a restarted publisher, gc) is retried once from the newest one."""
        for attempt in range(2):
            t0 = time.perf_counter()
            latest = _latest(self.fs, self.root)
            held = self._held
            if latest is None or (held is not None and latest.version == held.version and
                                  {n: latest.leaves[n].sha256 for n in self._wanted(latest)} ==
                                  {n: h[1] for n, h in held.leaves.items()}):
                return None
            try:
                return self._load(latest, t0)
            except VersionGap:
                if attempt:
                    raise
        return None


def load(url: str, version: int | None = None, *, verify: bool = True) -> tuple[int, dict]:
    """(version, {name: numpy array}) of `version` (default: the newest complete one), bit-exact
    as published; raises CorruptLeaf / VersionGap (module docstring)."""
    return WeightReader(url, verify=verify).load(version)


# ------------------------------------------------------------------------- garbage collection

def gc(url: str, keep_from: int) -> dict:
    """Deletes the versions older than `keep_from` (the oldest version an actor still holds)
    that no complete version >= keep_from needs to be rebuilt from scratch (the anchors and
    deltas their chains go through are kept). Run it from one process. Returns
    {"deleted": [versions], "kept": [versions]}."""
    fs, root = _fs(url)
    dirs = _version_dirs(fs, root)
    latest = _latest(fs, root)
    if latest is None:
        return {"deleted": [], "kept": dirs}
    keep_from = min(int(keep_from), latest.version)  # never every complete version
    needed, cache = set(), {latest.version: latest}
    for v in dirs:
        if v < keep_from:
            continue
        if v not in cache:
            cache[v] = _read_manifest(fs, root, v)
        m = cache[v]
        if m is None:
            continue
        try:
            chain, _ = _plan(fs, root, m, None, cache)
        except VersionGap as e:
            logging.warning("weight store %s: version %d cannot be rebuilt (%s)", url, v, e)
            continue
        needed.update(c.version for c in chain)
    deleted = [v for v in dirs if v < keep_from and v not in needed]
    for v in deleted:
        fs.rm(f"{root}/{_vdir(v)}", recursive=True)
    return {"deleted": deleted, "kept": [v for v in dirs if v not in deleted]}
