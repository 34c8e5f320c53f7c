"""The weight store: bit-exact round trips over anchor + delta chains, hash and gap errors, a
reader catching up, garbage collection, two writers, and the size of a small delta."""
import json
import os
import sys
import uuid

import fsspec
import ml_dtypes
import numpy as np
import pytest

from coder.rl import weight_sync as ws


def _weights(rng):
    return {
        "embed": rng.normal(0, 0.02, (37, 5)).astype(np.float32),
        "layers.0.wq": rng.normal(0, 0.02, (3, 129)).astype(ml_dtypes.bfloat16),
        "layers.0.mlp.bias": rng.normal(0, 1, (7,)).astype(np.float32),
        "norm": np.ones((1,), ml_dtypes.bfloat16),
        "scale": np.array(0.5, np.float32),  # a scalar
        "big": rng.normal(0, 0.02, (64, 200)).astype(ml_dtypes.bfloat16),
    }


def _step(w, rng, frac=0.05):
    """A new version: `frac` of each leaf's elements moved a little (in their own dtype)."""
    out = {}
    for k, x in w.items():
        hit = rng.random(x.shape) < frac
        out[k] = np.where(hit, x.astype(np.float32) * 1.01 + 1e-3, x.astype(np.float32)).astype(x.dtype)
    return out


def _same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def _chain(url, n=7, anchor_every=3, seed=0):
    rng = np.random.default_rng(seed)
    hist, infos, w = [], [], _weights(rng)
    for v in range(n):
        hist.append(w)
        infos.append(ws.publish(url, v, w, anchor_every=anchor_every))
        w = _step(w, rng)
    return hist, infos


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "store")
    else:
        u = f"memory://weights-{uuid.uuid4().hex}"
        yield u
        fs, root = fsspec.core.url_to_fs(u)
        fs.rm(root, recursive=True)


def test_round_trip_chain_bit_exact(url):
    hist, infos = _chain(url)
    # anchors at 0, 3, 6 (every 3 and the first), deltas between; tiny leaves stay full
    assert [i["delta_leaves"] > 0 for i in infos] == [False, True, True, False, True, True, False]
    assert all(i["bytes"] > 0 for i in infos)
    assert ws.versions(url) == list(range(7)) and ws.latest_version(url) == 6
    for v, want in enumerate(hist):
        got_v, got = ws.load(url, v)
        assert got_v == v
        _same(got, want)
    assert ws.load(url)[0] == 6
    # a publisher's deltas are much smaller than its anchors
    assert infos[1]["bytes"] < 0.6 * infos[0]["bytes"]


def _part(url, version):
    fs, root = fsspec.core.url_to_fs(url)
    vdir = f"{root}/v{version:010d}"
    return fs, vdir, json.loads(fs.cat_file(f"{vdir}/part-00000-of-00001.json"))


def _flip_byte(url, version, leaf, at=3):
    fs, vdir, part = _part(url, version)
    e = part["leaves"][leaf]
    data = bytearray(fs.cat_file(f"{vdir}/{part['data']}"))
    data[e["offset"] + min(at, e["length"] - 1)] ^= 0x40
    fs.pipe_file(f"{vdir}/{part['data']}", bytes(data))
    return e["kind"]


def test_corrupted_leaf_fails_its_hash(url):
    _chain(url)
    assert _flip_byte(url, 3, "big") == "anchor"
    for v in (3, 4, 5):  # 4 and 5 are built on 3
        with pytest.raises(ws.CorruptLeaf, match="leaf big of version 3"):
            ws.load(url, v)
    assert ws.load(url, 2)[0] == 2 and ws.load(url, 6)[0] == 6
    assert _flip_byte(url, 1, "layers.0.wq", at=20) == "delta"
    with pytest.raises(ws.CorruptLeaf, match="leaf layers.0.wq of version 1"):
        ws.load(url, 1)


def test_version_gap_raises(url):
    hist, _ = _chain(url)
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm(f"{root}/v{4:010d}", recursive=True)
    with pytest.raises(ws.VersionGap, match="needs version 4"):
        ws.load(url, 5)
    with pytest.raises(ws.VersionGap, match="version 4 is not in the weight store"):
        ws.load(url, 4)
    _same(ws.load(url, 6)[1], hist[6])  # an anchor: no parent needed
    _same(ws.load(url, 3)[1], hist[3])
    # a reader holding 3 cannot take the chain 5 -> 4 -> 3; it still gets 6 from its anchor
    reader = ws.WeightReader(url)
    reader.load(3)
    assert reader.poll()[0] == 6 and reader.last_read["from"] == "anchor"


def test_reader_applies_deltas_and_catches_up(url):
    rng = np.random.default_rng(1)
    pub = ws.WeightPublisher(url, anchor_every=3)
    reader = ws.WeightReader(url)
    assert reader.poll() is None  # empty store
    w, hist = _weights(rng), {}
    for v in range(10):
        hist[v] = w
        pub.publish(v, w)
        if v in (0, 1):  # an actor following every version applies each delta
            got_v, got = reader.poll()
            assert got_v == v
            _same(got, w)
            assert reader.poll() is None  # nothing new
        w = _step(w, rng)
    assert reader.last_read["from"] == "delta" and reader.last_read["version"] == 1
    # it missed 2..9 (anchors 3, 6, 9): version 9 is read from its anchor
    got_v, got = reader.poll()
    assert (got_v, reader.last_read["from"]) == (9, "anchor")
    _same(got, hist[9])
    pub.publish(10, w)
    got_v, got = reader.poll()
    assert (got_v, reader.last_read["from"]) == (10, "delta")
    _same(got, w)
    # missed versions that are deltas are applied in order when that reads less than the anchor
    late = ws.WeightReader(url)
    late.load(3)
    _same(late.load(5)[1], hist[5])
    assert late.last_read["from"] == "delta"
    fresh = ws.WeightReader(url)
    fresh.load(5)
    assert fresh.last_read["from"] == "anchor"
    assert late.last_read["bytes"] < 0.6 * fresh.last_read["bytes"]


def test_gc_keeps_what_readers_need(url):
    hist, _ = _chain(url, n=9)  # anchors 0, 3, 6
    reader = ws.WeightReader(url)
    reader.load(5)
    out = ws.gc(url, keep_from=5)
    assert out["deleted"] == [0, 1, 2] and out["kept"] == [3, 4, 5, 6, 7, 8]
    for v in range(3, 9):  # every kept version still loads from scratch
        _same(ws.load(url, v)[1], hist[v])
    assert reader.poll()[0] == 8
    assert ws.gc(url, keep_from=7)["deleted"] == [3, 4, 5]
    _same(ws.load(url, 7)[1], hist[7])
    # keep_from past the newest version never empties the store
    assert ws.gc(url, keep_from=100)["deleted"] == []
    _same(ws.load(url)[1], hist[8])


def test_two_writers(url):
    rng = np.random.default_rng(2)
    w = _weights(rng)
    parts = ws.split_leaves(w, 2)
    assert set(parts[0]) | set(parts[1]) == set(w) and not set(parts[0]) & set(parts[1])
    assert parts[0] and parts[1]
    pubs = [ws.WeightPublisher(url, shard=(i, 2), anchor_every=4) for i in range(2)]
    reader = ws.WeightReader(url)
    hist = {}
    for v in range(6):
        hist[v] = w
        pubs[0].publish(v, ws.split_leaves(w, 2)[0])
        # one writer's part alone is not a version
        assert ws.latest_version(url) == (None if v == 0 else v - 1)
        pubs[1].publish(v, ws.split_leaves(w, 2)[1])
        assert ws.latest_version(url) == v
        if v % 2:
            _same(reader.poll()[1], w)
        w = _step(w, rng)
    for v, want in hist.items():
        _same(ws.load(url, v)[1], want)
    # Both hosts restart from an earlier checkpoint and publish version 4 again with other
    # weights: until both parts of the new run are there, version 4 is not complete.
    w = _step(hist[3], rng, frac=0.3)
    new = [ws.WeightPublisher(url, shard=(i, 2), anchor_every=4) for i in range(2)]
    new[0].publish(4, ws.split_leaves(w, 2)[0])
    assert ws.versions(url) == [0, 1, 2, 3]  # 5 lost writer 0's part, 4 is mixed
    new[1].publish(4, ws.split_leaves(w, 2)[1])
    assert ws.latest_version(url) == 4
    _same(ws.load(url, 4)[1], w)
    got_v, got = reader.poll()  # held the old run's 5: takes the new 4
    assert got_v == 4
    _same(got, w)


def test_same_version_from_a_new_session_is_picked_up(url):
    rng = np.random.default_rng(3)
    w = _weights(rng)
    ws.WeightPublisher(url).publish(0, w)
    reader = ws.WeightReader(url)
    reader.poll()
    w2 = _step(w, rng, frac=0.5)
    ws.WeightPublisher(url).publish(0, w2)  # same version number and session name
    got_v, got = reader.poll()
    assert got_v == 0
    _same(got, w2)


def test_small_change_delta_is_a_small_fraction_of_full():
    """2% of the elements of bf16 / f32 weights nudged: the delta is a few % of the full bytes."""
    rng = np.random.default_rng(4)
    w = {"w16": rng.normal(0, 0.02, (512, 1024)).astype(ml_dtypes.bfloat16),
         "w32": rng.normal(0, 0.02, (256, 512)).astype(np.float32)}
    url = f"memory://weights-{uuid.uuid4().hex}"
    pub = ws.WeightPublisher(url)
    full = pub.publish(0, w)
    w2 = {}
    for k, x in w.items():
        hit = rng.random(x.shape) < 0.02
        w2[k] = np.where(hit, x.astype(np.float32) * (1 + 2e-2), x.astype(np.float32)).astype(x.dtype)
    delta = pub.publish(1, w2)
    assert delta["delta_leaves"] == 2
    assert delta["bytes"] < 0.12 * full["bytes"], (delta["bytes"], full["bytes"])
    _same(ws.load(url, 1)[1], w2)
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm(root, recursive=True)


def test_manifest_records_the_format(tmp_path):
    """Version v's manifest names its parent, shapes, dtypes, hashes and each leaf's kind."""
    url = str(tmp_path / "s")
    hist, _ = _chain(url, n=2)
    _, _, part = _part(url, 1)
    assert (part["version"], part["parent"], part["shard"]) == (1, 0, [0, 1])
    e = part["leaves"]["layers.0.wq"]
    assert (e["shape"], e["dtype"], e["kind"]) == ([3, 129], "bfloat16", "delta")
    import hashlib

    assert e["sha256"] == hashlib.sha256(hist[1]["layers.0.wq"].tobytes()).hexdigest()
    assert e["base_sha256"] == hashlib.sha256(hist[0]["layers.0.wq"].tobytes()).hexdigest()
    assert part["leaves"]["scale"]["shape"] == [] and part["leaves"]["scale"]["kind"] == "anchor"
    assert os.path.exists(f"{url}/v{1:010d}/part-00000-of-00001.bin")


# ------------------------------------------------------------------------- slices of sharded leaves

def _sharded(seed, mesh, specs, shapes):
    """{name: jax.Array} of seeded bf16 / f32 values, each in NamedSharding(mesh, specs[name])."""
    import jax
    from jax.sharding import NamedSharding

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        dtype = np.float32 if name == "bias" else ml_dtypes.bfloat16
        host = rng.normal(0, 0.02, shape).astype(dtype)
        out[name] = jax.device_put(host, NamedSharding(mesh, specs[name]))
    return out


SHAPES = {"wq": (16, 24), "bias": (24,), "scale": (), "embed": (40, 6)}


def _mesh(shape, names):
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()).reshape(shape), names)


def test_sharded_leaves_are_written_as_slices_and_read_back_in_another_sharding(url):
    """A state over a (2, 4) mesh is written as the shards with replica_id 0, cut into chunks
    (every element once); a reader without shardings assembles whole leaves, one with another
    sharding (a (4, 2) mesh, other dimensions split) gets jax.Arrays in it, bit-exact, and
    follows the next version by deltas."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    write = _mesh((2, 4), ("a", "b"))
    specs = {"wq": P("a", "b"), "bias": P("b"), "scale": P(), "embed": P(None, "a")}
    arrays = _sharded(0, write, specs, SHAPES)
    mine = ws.local_slices(arrays, chunk_bytes=64)
    covered = {}
    for key, sl in mine.items():
        leaf = key.split(ws.SLICE_SEP)[0]
        assert sl.data.nbytes <= 64 or sl.data.size == 1, key
        assert ws.slice_name(leaf, sl.index) == key and sl.global_shape == SHAPES[leaf]
        covered[leaf] = covered.get(leaf, 0) + sl.data.size
    assert covered == {k: int(np.prod(s, dtype=int)) for k, s in SHAPES.items()}  # replicas written once
    pub = ws.WeightPublisher(url, anchor_every=10)
    pub.publish(0, mine)
    whole = {k: np.asarray(v) for k, v in arrays.items()}
    _same(ws.load(url, 0)[1], whole)

    read = _mesh((4, 2), ("x", "y"))
    targets = {"wq": P("y", "x"), "bias": P("x"), "scale": P(), "embed": P("x", "y")}
    reader = ws.WeightReader(url, shardings={k: NamedSharding(read, s) for k, s in targets.items()})
    v, got = reader.load()
    assert v == 0 and reader.last_read["from"] == "anchor"
    for k, a in got.items():
        assert isinstance(a, jax.Array) and a.sharding == NamedSharding(read, targets[k]), k
        assert a.dtype == whole[k].dtype and np.asarray(a).tobytes() == whole[k].tobytes(), k

    rng = np.random.default_rng(1)
    nxt = {k: _step({k: w}, rng)[k] for k, w in whole.items()}
    arrays = {k: jax.device_put(nxt[k], NamedSharding(write, specs[k])) for k in nxt}
    info = pub.publish(1, ws.local_slices(arrays, chunk_bytes=64))
    assert info["delta_leaves"] > 0
    v, got = reader.poll()
    assert v == 1 and reader.last_read["from"] == "delta"
    assert all(np.asarray(got[k]).tobytes() == nxt[k].tobytes() for k in nxt)
    assert reader.poll() is None


def test_sharded_reader_names_what_the_store_lacks(url):
    """A missing slice, a leaf the reader has no sharding for, a leaf the store lacks, and a
    name holding the separator: each a clear error, never a silently wrong array."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh((2, 4), ("a", "b"))
    specs = {"wq": P("a", "b"), "bias": P("b"), "scale": P(), "embed": P(None, "a")}
    mine = ws.local_slices(_sharded(0, mesh, specs, SHAPES))
    dropped = sorted(k for k in mine if k.startswith("wq@"))[0]
    ws.WeightPublisher(url).publish(0, {k: v for k, v in mine.items() if k != dropped})
    with pytest.raises(ws.WeightStoreError, match="leaf wq: the stored slices cover"):
        ws.load(url, 0)
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    with pytest.raises(ws.WeightStoreError, match="no sharding for"):
        ws.WeightReader(url, shardings={k: s for k, s in shardings.items() if k != "bias"}).load()
    with pytest.raises(ws.WeightStoreError, match="lacks the leaves"):
        ws.WeightReader(url, shardings=dict(shardings, extra=shardings["bias"])).load()
    with pytest.raises(ValueError, match="separator"):
        ws.local_slices({"a@b": np.zeros(2)})


def test_chunks_tile_the_region_within_the_cap():
    """Every chunk within the byte cap (or a single element), the chunks tile the region once."""
    for index, itemsize, cap in [(((4, 100), (8, 50), (0, 3)), 2, 500), (((0, 10), (0, 7)), 4, 40),
                                 ((), 4, 1), (((0, 5),), 8, 1)]:
        chunks = ws._chunks(index, itemsize, cap)
        seen = np.zeros([b - a for a, b in index], np.int32)
        for c in chunks:
            n = int(np.prod([b - a for a, b in c], dtype=int))
            assert n * itemsize <= cap or n == 1, (index, c)
            seen[tuple(slice(a - i0, b - i0) for (a, b), (i0, _) in zip(c, index))] += 1
        assert np.all(seen == 1), index


# ------------------------------------------------------------------------- two processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIG = {"wq": (512, 384), "embed": (1024, 256), "bias": (384,), "scale": ()}


def store_worker(process_id: int, port: int, url: str):
    """One of two processes (4 CPU devices each): publishes versions 0 and 1 of a state over
    a (2, 4) mesh from its own devices' shards, then reads them back in another sharding (a
    (4, 2) mesh, other dimensions split); prints what it wrote, read and held, its host-memory
    peaks above what it held before each call (tracemalloc: numpy's and the reads' buffers; on
    CPU the arrays it builds are host memory too) and whether every shard it got is bit-exact."""
    import tracemalloc

    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=process_id)
    rng = np.random.default_rng(0)
    hosts = [{k: rng.normal(0, 0.02, s).astype(np.float32 if k == "bias" else ml_dtypes.bfloat16)
              for k, s in BIG.items()}]
    hosts.append({k: _step({k: h}, rng)[k] for k, h in hosts[0].items()})
    write = _mesh((2, 4), ("a", "b"))
    specs = {"wq": P("a", "b"), "embed": P("b", "a"), "bias": P("b"), "scale": P()}
    arrays = [{k: jax.make_array_from_callback(h[k].shape, NamedSharding(write, specs[k]), lambda i, a=h[k]: a[i])
               for k in BIG} for h in hosts]
    total = sum(a.nbytes for a in hosts[0].values())
    out = {"total": total, "written": [], "raw": [], "publish_peak": []}
    pub = ws.WeightPublisher(url, shard=(process_id, 2), anchor_every=10)
    tracemalloc.start()
    for v, state in enumerate(arrays):
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        info = pub.publish(v, ws.local_slices(state, chunk_bytes=16 << 10))
        out["publish_peak"].append(tracemalloc.get_traced_memory()[1] - before)
        out["written"].append(info["bytes"])
        out["raw"].append(info["raw_bytes"])
    multihost_utils.sync_global_devices("published")

    read = _mesh((4, 2), ("x", "y"))
    targets = {"wq": P("y", "x"), "embed": P("x", None), "bias": P("x"), "scale": P()}
    reader = ws.WeightReader(url, shardings={k: NamedSharding(read, s) for k, s in targets.items()})
    out.update(read=[], held=[], load_peak=[], exact=[], how=[])
    for v in range(2):
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        got_v, got = reader.load(v)
        out["load_peak"].append(tracemalloc.get_traced_memory()[1] - before)
        out["read"].append(reader.last_read["bytes"])
        out["held"].append(reader.last_read["held_bytes"])
        out["how"].append(reader.last_read["from"])
        out["exact"].append(got_v == v and all(
            np.asarray(sh.data).tobytes() == hosts[v][k][sh.index].tobytes() and got[k].sharding.spec == targets[k]
            for k in BIG for sh in got[k].addressable_shards))
    multihost_utils.sync_global_devices("read")
    print("STORE " + json.dumps(out), flush=True)


@pytest.mark.subprocess
def test_two_processes_write_and_read_their_own_share(tmp_path):
    """Two processes publish a state from their own devices' shards (no gather) and read it back
    in another sharding: bit-exact; each writes about half the bytes and reads and holds about
    half (chunks of 16 KiB: the reader's shards cut across the writers'); host-memory peaks
    near the share, reported. A publish holds its share's bytes (the next delta's base) and the
    payloads; a load the bytes it read (kept for deltas) and, on CPU, the arrays it built: each
    about the share, so the peak stays under 3 shares (1.5x the model), where one gathered model
    per process would be 2x or more."""
    from tests import multiprocess_jobs as jobs

    port, url = jobs.free_port(), str(tmp_path / "store")
    procs = [jobs.spawn(__file__, [i, port, url], devices=4) for i in range(2)]
    outs = [jobs.tagged_json(p, "STORE", timeout=300) for p in procs]
    print(json.dumps(outs, indent=1))
    total = outs[0]["total"]
    assert sum(o["raw"][0] for o in outs) == total  # every element written once
    for o in outs:
        assert o["exact"] == [True, True] and o["how"] == ["anchor", "delta"]
        assert 0.45 * total <= o["raw"][0] <= 0.55 * total
        assert o["written"][1] < 0.5 * o["written"][0]  # version 1 as deltas
        assert o["read"][0] <= 0.6 * total and o["held"][0] <= 0.6 * total
        assert o["publish_peak"][0] <= 1.5 * total and o["load_peak"][0] <= 1.5 * total





@pytest.mark.slow
@pytest.mark.subprocess
def test_sharded_bench_runs_and_checks_its_reads():
    """bench/weight_sync.py --processes: a 2-process job writes halves and reads halves, exact."""
    import subprocess

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "weight_sync.py"), "--processes", "2",
                          "--mb", "1", "--versions", "2", "--chunk_kb", "4"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 4 and all(r[-1] == "True" for r in rows), out.stdout
    for r in rows:  # proc version written /model publish_s read /model load_s exact
        if r[1] == "0":  # the anchors: each process writes and reads half of the model (what it
            # writes also holds its manifest, ~250 bytes per 4 KiB chunk here: 2.7% of the model)
            assert 50 <= float(r[3].rstrip("%")) < 54 and abs(float(r[6].rstrip("%")) - 50) < 1, out.stdout


if __name__ == "__main__":
    store_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
