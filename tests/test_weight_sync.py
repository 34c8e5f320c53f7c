"""The weight store: bit-exact round trips over anchor + delta chains, hash and gap errors, a
reader catching up, garbage collection, two writers, and the size of a small delta."""
import json
import os
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
