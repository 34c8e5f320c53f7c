"""Pretraining pipeline (coder/data/pretrain.py, sources.py): packing, mixture, bad records,
fsspec / Parquet / ArrayRecord sources, exact resume and host sharding."""
import json
import random

import fsspec
import grain
import numpy as np
import pytest

from coder.data import corpus, pretrain
from coder.data import tokenizer as tk
from configs import base

WORDS = "def class return import self lambda yield with as for in if else elif try".split()


def make_docs(n, seed=0, max_words=40):
    rng = random.Random(seed)
    return [
        f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
        + ("\n    pass\n" if i % 3 == 0 else "")
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def tok():
    texts = make_docs(300) + tk.sample_texts((d["text"] for d in corpus.documents("train")), 60_000)
    return tk.train_tokenizer(texts, vocab_size=400)


def write_jsonl(path, docs, field="text"):
    with fsspec.open(str(path), "wb") as f:
        for d in docs:
            f.write((json.dumps({field: d, "meta": 1}) + "\n").encode())


def config(sources=(), seq_len=32, batch_size=4, **data):
    cfg = base.get_config()
    cfg.data.sources = tuple(sources)
    cfg.data.seq_len = seq_len
    cfg.data.batch_size = batch_size
    cfg.data.heldout_fraction = 0.0
    for k, v in data.items():
        cfg.data[k] = v
    return cfg


def encoded(tok, text):
    return [tok.bos_id] + tok.encode(text) + [tok.eos_id]


def check_rows(batch, tok):
    """Structure every packed row must have (docs/contracts.md)."""
    tokens, pos, seg, mask = (batch[k] for k in ("tokens", "positions", "segment_ids", "loss_mask"))
    assert tokens.dtype == pos.dtype == seg.dtype == np.int32 and mask.dtype == np.float32
    for r in range(tokens.shape[0]):
        real = seg[r] > 0
        n = int(real.sum())
        assert real[:n].all() and not real[n:].any(), "padding only at the end of a row"
        assert (tokens[r, n:] == 0).all() and (pos[r, n:] == 0).all()
        np.testing.assert_array_equal(mask[r], real.astype(np.float32))
        ids = seg[r, :n]
        assert n == 0 or (ids[0] == 1 and set(np.diff(ids)) <= {0, 1})
        for s in np.unique(ids):
            where = np.flatnonzero(seg[r] == s)
            # positions count up inside a piece; a document starts at 0 (a later piece continues
            # the document's positions below model.max_position_embeddings)
            np.testing.assert_array_equal(np.diff(pos[r, where]), 1)
            assert tokens[r, where[0]] != tok.bos_id or pos[r, where[0]] == 0
            # A segment is a whole document or a piece cut at a row boundary.
            assert where[0] == 0 or tokens[r, where[0]] == tok.bos_id
            assert where[-1] == tokens.shape[1] - 1 or tokens[r, where[-1]] == tok.eos_id


def stream(batches):
    """Non-padding tokens of the batches in row order."""
    return [int(t) for b in batches for row, seg in zip(b["tokens"], b["segment_ids"]) for t in row[seg > 0]]


def split_docs(ids, tok):
    """Token stream -> decoded documents (they are [bos] ... [eos])."""
    docs, cur = [], None
    for t in ids:
        if t == tok.bos_id:
            cur = []
        elif t == tok.eos_id:
            docs.append(tok.decode(cur))
            cur = None
        else:
            cur.append(t)
    return docs


# --- packing ------------------------------------------------------------------------------------
def _pack(lengths, seq_len, rows, split_docs_, max_position=None):
    docs = [
        {"source": 0, "bad": -1, "tokens": np.arange(100 * i + 1, 100 * i + 1 + n, dtype=np.int32)}
        for i, n in enumerate(lengths)
    ]
    ds = grain.MapDataset.source(docs).to_iter_dataset()
    return list(pretrain.PackIterDataset(ds, seq_len, rows, 1, split_docs_, max_position=max_position))


def test_concat_then_split_layout():
    b1, b2 = _pack([5, 12, 3], seq_len=8, rows=2, split_docs_=True)
    np.testing.assert_array_equal(b1["tokens"], [[1, 2, 3, 4, 5, 101, 102, 103], list(range(104, 112))])
    np.testing.assert_array_equal(b1["segment_ids"], [[1] * 5 + [2] * 3, [1] * 8])
    np.testing.assert_array_equal(b1["positions"], [[0, 1, 2, 3, 4, 0, 1, 2], list(range(8))])
    np.testing.assert_array_equal(b2["tokens"], [[112, 201, 202, 203, 0, 0, 0, 0], [0] * 8])
    np.testing.assert_array_equal(b2["segment_ids"], [[1, 2, 2, 2, 0, 0, 0, 0], [0] * 8])
    np.testing.assert_array_equal(b2["positions"], [[0, 0, 1, 2, 0, 0, 0, 0], [0] * 8])
    np.testing.assert_array_equal(b2["loss_mask"], b2["segment_ids"] > 0)
    assert b1["_stats"][0, 0] == 2 and b2["_stats"][0, 0] == 1  # records consumed per batch


def test_cut_documents_continue_their_positions_below_max_position():
    # the 12-token document cut 3 | 8 | 1: its pieces start at offsets 0, 3, 11
    b1, b2 = _pack([5, 12, 3], seq_len=8, rows=2, split_docs_=True, max_position=16)
    np.testing.assert_array_equal(b1["positions"], [[0, 1, 2, 3, 4, 0, 1, 2], list(range(3, 11))])
    np.testing.assert_array_equal(b2["positions"][0], [11, 0, 1, 2, 0, 0, 0, 0])
    # past max_position a piece restarts at 0: offset 3 + 8 tokens > 10
    b1, b2 = _pack([5, 12, 3], seq_len=8, rows=2, split_docs_=True, max_position=10)
    np.testing.assert_array_equal(b1["positions"][1], range(8))
    np.testing.assert_array_equal(b2["positions"][0], [0, 0, 1, 2, 0, 0, 0, 0])


def test_whole_documents_first_fit():
    b1, b2 = _pack([5, 4, 3, 6], seq_len=8, rows=2, split_docs_=False)
    np.testing.assert_array_equal(b1["tokens"], [[1, 2, 3, 4, 5, 201, 202, 203], [101, 102, 103, 104, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b1["segment_ids"], [[1] * 5 + [2] * 3, [1] * 4 + [0] * 4])
    np.testing.assert_array_equal(b2["tokens"][0], [301, 302, 303, 304, 305, 306, 0, 0])
    np.testing.assert_array_equal(b2["positions"][0], [0, 1, 2, 3, 4, 5, 0, 0])


def test_no_token_lost_and_rows_well_formed(tok, tmp_path):
    docs = make_docs(120, max_words=60)
    write_jsonl(tmp_path / "a.jsonl", docs)
    it = pretrain.make_pretrain_iterator(config([{"path": str(tmp_path / "a.jsonl")}]), tok, "all")
    batches = list(it)
    for b in batches:
        assert b["tokens"].shape == (4, 32)
        check_rows(b, tok)
    assert stream(batches) == sum((encoded(tok, d) for d in docs), [])
    assert it.counts()[str(tmp_path / "a.jsonl")]["seen"] == 120
    assert any((b["positions"][:, 0] > 0).any() or (b["segment_ids"][:, 0] == 1).all() for b in batches)


def test_bundled_corpus_is_the_default(tok):
    cfg = config(seq_len=64, heldout_fraction=0.05)
    it = pretrain.make_pretrain_iterator(cfg, tok, "heldout")
    first = next(it)
    check_rows(first, tok)
    (doc,) = [d for d in corpus.documents("heldout")][:1]
    assert stream([first])[: 65] == encoded(tok, doc["text"])[:65]
    assert it.source_names == ["python_stdlib"]
    train = pretrain.make_pretrain_iterator(cfg, tok, "train")
    assert next(train)["tokens"].shape == (4, 64)


# --- sources --------------------------------------------------------------------------------------
def test_memory_fsspec_glob_source(tok):
    docs = make_docs(30, seed=1)
    write_jsonl("memory://coder-test/mem/part-0.jsonl", docs[:10])
    write_jsonl("memory://coder-test/mem/part-1.jsonl", docs[10:])
    cfg = config([{"path": "memory://coder-test/mem/*.jsonl", "name": "mem"}])
    batches = list(pretrain.make_pretrain_iterator(cfg, tok, "all"))
    assert split_docs(stream(batches), tok) == docs


def test_parquet_and_arrayrecord_sources_match_jsonl(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python import array_record_module

    docs = make_docs(40, seed=2)
    write_jsonl(tmp_path / "d.jsonl", docs)
    pq.write_table(pa.table({"content": docs}), tmp_path / "d.parquet", row_group_size=7)
    writer = array_record_module.ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
    for d in docs:
        writer.write(json.dumps({"text": d}).encode())
    writer.close()
    with open(tmp_path / "d.array_record", "rb") as f:
        fsspec.filesystem("memory").pipe("/coder-test/ar/d.array_record", f.read())

    def run(spec):
        return stream(list(pretrain.make_pretrain_iterator(config([spec]), tok, "all")))

    want = run({"path": str(tmp_path / "d.jsonl")})
    assert split_docs(want, tok) == docs
    assert run({"path": str(tmp_path / "d.parquet"), "text_field": "content"}) == want
    assert run({"path": str(tmp_path / "d.array_record")}) == want
    assert run({"path": "memory://coder-test/ar/d.array_record"}) == want


def test_sources_are_thread_safe(tmp_path):
    """grain reads with several threads: concurrent reads must return the right records."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq

    from coder.data import sources

    docs = [f"record {i} " + "x" * (i % 97) for i in range(3000)]
    for part in range(3):
        write_jsonl(tmp_path / f"p{part}.jsonl", docs[part * 1000 : (part + 1) * 1000])
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet", row_group_size=100)
    order = list(range(3000))
    random.Random(0).shuffle(order)
    for spec in ({"path": str(tmp_path / "p*.jsonl")}, {"path": str(tmp_path / "d.parquet")}):
        spec = sources.normalize_spec(spec)
        source = sources.open_source(spec)
        source._MAX_OPEN = 2  # also exercise closing and reopening handles

        def read(i, source=source, spec=spec):
            return sources.parse_record(source[i], spec["format"], "text")[0]["text"]

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(read, order)) == [docs[i] for i in order]


def test_bad_source_specs_are_rejected(tmp_path):
    cfg = config([{"path": str(tmp_path / "missing-*.jsonl")}])
    with pytest.raises(FileNotFoundError, match="missing"):
        pretrain.make_pretrain_iterator(cfg, None)
    with pytest.raises(ValueError, match="unknown keys"):
        pretrain.make_pretrain_iterator(config([{"path": "x.jsonl", "wieght": 2}]), None)
    with pytest.raises(ValueError, match="format"):
        pretrain.make_pretrain_iterator(config([{"path": "x.jsonl", "format": "csv"}]), None)
    with pytest.raises(ValueError, match="compressed"):
        pretrain.make_pretrain_iterator(config([{"path": "x.jsonl.gz"}]), None)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        pretrain.make_pretrain_iterator(config([{"path": str(tmp_path / "empty.jsonl")}]), None)
    with pytest.raises(ValueError, match="no held-out split"):
        pretrain.make_pretrain_iterator(config([{"path": str(tmp_path / "empty.jsonl")}]), None, "heldout")


# --- bad records ----------------------------------------------------------------------------------
BAD_LINES = {
    "malformed_json": [b'{"text": "unterminated', b"[1, 2]", b"not json"],
    "missing_field": [b'{"body": "x"}', b'{"text": 5}', b'{"text": null}'],
    "invalid_utf8": [b'{"text": "caf\xe9"}', b'{"text": "\\ud800 lone surrogate"}'],
    "empty_text": [b'{"text": ""}', b'{"text": "  \\n\\t "}'],
}


def write_mixed(path, good, bad_lines):
    lines = [json.dumps({"text": d}).encode() for d in good] + bad_lines
    random.Random(0).shuffle(lines)
    with open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n\n")  # a blank line is not a record


def test_bad_records_are_skipped_and_counted_by_kind(tok, tmp_path):
    good = make_docs(50, seed=3)
    write_mixed(tmp_path / "m.jsonl", good, sum(BAD_LINES.values(), []))
    cfg = config([{"path": str(tmp_path / "m.jsonl"), "name": "mixed"}], max_bad_fraction=0.5)
    it = pretrain.make_pretrain_iterator(cfg, tok, "all")
    batches = list(it)
    assert sorted(split_docs(stream(batches), tok)) == sorted(good)
    counts = it.counts()["mixed"]
    assert counts["seen"] == 50 + 10
    for kind, lines in BAD_LINES.items():
        assert counts[kind] == len(lines), kind
    metrics = it.metrics()
    assert metrics["data/records_seen"] == 60 and metrics["data/records_bad"] == 10


def test_too_many_bad_records_fail_naming_the_source(tok, tmp_path):
    write_mixed(tmp_path / "ok.jsonl", make_docs(40, seed=4), [])
    write_mixed(tmp_path / "bad.jsonl", make_docs(20, seed=5), [b"{oops"] * 20)
    sources = [{"path": str(tmp_path / "ok.jsonl")}, {"path": str(tmp_path / "bad.jsonl"), "name": "scraped"}]
    cfg = config(sources, max_bad_fraction=0.1, bad_check_min_records=10)
    it = pretrain.make_pretrain_iterator(cfg, tok)
    with pytest.raises(pretrain.BadDataError, match="'scraped'.*malformed_json"):
        for _ in range(50):
            next(it)
    # A source with no good record at all fails instead of spinning forever inside one batch.
    write_mixed(tmp_path / "all_bad.jsonl", [], [b'{"text": ""}'] * 5)
    cfg_all_bad = config([{"path": str(tmp_path / "all_bad.jsonl"), "name": "void"}], bad_check_min_records=10)
    with pytest.raises(pretrain.BadDataError, match="'void'.*empty_text"):
        next(pretrain.make_pretrain_iterator(cfg_all_bad, tok))
    cfg.data.max_bad_fraction = 0.6
    it = pretrain.make_pretrain_iterator(cfg, tok)
    for _ in range(30):
        next(it)
    assert it.counts()["scraped"]["malformed_json"] > 10


# --- mixture, order, resume, sharding ---------------------------------------------------------------
def test_mixture_proportions(tok, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", make_docs(50, seed=6))
    write_jsonl(tmp_path / "b.jsonl", make_docs(50, seed=7))
    for wa, wb in ((3.0, 1.0), (0.2, 0.8)):
        cfg = config([
            {"path": str(tmp_path / "a.jsonl"), "weight": wa, "name": "a"},
            {"path": str(tmp_path / "b.jsonl"), "weight": wb, "name": "b"},
        ])
        it = pretrain.make_pretrain_iterator(cfg, tok)
        for _ in range(60):
            next(it)
        c = it.counts()
        total = c["a"]["seen"] + c["b"]["seen"]
        assert total > 200  # several epochs of the smaller share: repeats are reshuffled
        assert abs(c["a"]["seen"] / total - wa / (wa + wb)) < 0.02


def test_order_is_deterministic_and_depends_on_seed(tok, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", make_docs(40, seed=8))
    cfg = config([{"path": str(tmp_path / "a.jsonl")}])
    first = [next(pretrain.make_pretrain_iterator(cfg, tok))["tokens"] for _ in range(2)]
    np.testing.assert_array_equal(first[0], first[1])
    cfg.seed = 1
    assert not np.array_equal(next(pretrain.make_pretrain_iterator(cfg, tok))["tokens"], first[0])


def test_exact_resume_from_saved_state(tok, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", make_docs(30, seed=9, max_words=80))
    write_mixed(tmp_path / "b.jsonl", make_docs(30, seed=10), [b"{bad"] * 3)
    cfg = config([{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.jsonl"), "weight": 0.5}],
                 bad_check_min_records=10_000)
    reference = pretrain.make_pretrain_iterator(cfg, tok)
    ref = [next(reference) for _ in range(12)]
    cut_docs = 0
    for n in (1, 4, 7):
        it = pretrain.make_pretrain_iterator(cfg, tok)
        for _ in range(n):
            next(it)
        state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
        cut_docs += state["pipeline"]["offset"] > 0
        counts = it.counts()
        fresh = pretrain.make_pretrain_iterator(cfg, tok)
        fresh.set_state(state)
        assert fresh.counts() == counts
        for want in ref[n : n + 4]:
            got = fresh.__next__()
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])
        assert fresh.counts() == {name: c for name, c in reference_counts(cfg, tok, n + 4).items()}
    assert cut_docs > 0  # some resumes happened in the middle of a document


def reference_counts(cfg, tok, n):
    it = pretrain.make_pretrain_iterator(cfg, tok)
    for _ in range(n):
        next(it)
    return it.counts()


def test_two_hosts_are_disjoint_and_complete(tok, tmp_path):
    docs = make_docs(90, seed=11)
    write_jsonl(tmp_path / "a.jsonl", docs[:60])
    write_jsonl(tmp_path / "b.jsonl", docs[60:])
    cfg = config([{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.jsonl")}])
    hosts = []
    for p in range(2):
        batches = list(pretrain.make_pretrain_iterator(cfg, tok, "all", process_index=p, process_count=2))
        assert all(b["tokens"].shape == (2, 32) for b in batches)
        hosts.append(split_docs(stream(batches), tok))
    assert not set(hosts[0]) & set(hosts[1])
    assert sorted(hosts[0] + hosts[1]) == sorted(docs)
    assert abs(len(hosts[0]) - len(hosts[1])) <= 1
    # Shuffled, infinite: the first batches of the two hosts hold different documents.
    train = [pretrain.make_pretrain_iterator(cfg, tok, process_index=p, process_count=2) for p in range(2)]
    firsts = [set(split_docs(stream([next(t) for _ in range(3)]), tok)) for t in train]
    assert firsts[0] and not firsts[0] & firsts[1]
    with pytest.raises(ValueError, match="divisible"):
        pretrain.make_pretrain_iterator(cfg, tok, process_index=0, process_count=3)


def test_heldout_split_of_sources(tok, tmp_path):
    docs = make_docs(80, seed=12)
    write_jsonl(tmp_path / "a.jsonl", docs)
    cfg = config([{"path": str(tmp_path / "a.jsonl")}], heldout_fraction=0.25)
    parts = {
        split: split_docs(stream(list(pretrain.make_pretrain_iterator(cfg, tok, split, num_epochs=1))), tok)
        for split in ("train", "heldout")
    }
    assert not set(parts["train"]) & set(parts["heldout"])
    assert sorted(parts["train"] + parts["heldout"]) == sorted(docs)
    assert 8 <= len(parts["heldout"]) <= 32


@pytest.mark.slow
def test_worker_processes_give_the_same_documents(tok, tmp_path):
    docs = make_docs(40, seed=13)
    write_jsonl(tmp_path / "a.jsonl", docs)
    cfg = config([{"path": str(tmp_path / "a.jsonl")}], num_workers=2)
    it = pretrain.make_pretrain_iterator(cfg, tok, "all")
    got = stream(list(it))
    it.close()
    assert it.counts()[str(tmp_path / "a.jsonl")]["seen"] == 40
    # Exact resume with workers: their states are part of the saved state.
    cfg.data.sources = ({"path": str(tmp_path / "a.jsonl"), "name": "a"},)
    it = pretrain.make_pretrain_iterator(cfg, tok, batch_size=2, seq_len=16)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    it.close()
    fresh = pretrain.make_pretrain_iterator(cfg, tok, batch_size=2, seq_len=16)
    fresh.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(fresh)["tokens"], w["tokens"])
    assert w["tokens"].shape == (2, 16)
    fresh.close()
    # Each worker packs its own slice and batches alternate between workers, so a document cut
    # across rows continues two batches later: compare token multisets.
    assert sorted(got) == sorted(sum((encoded(tok, d) for d in docs), []))


def test_state_round_trips_through_grains_orbax_handler(tok, tmp_path):
    from etils import epath

    write_jsonl(tmp_path / "a.jsonl", make_docs(30, seed=14, max_words=80))
    cfg = config([{"path": str(tmp_path / "a.jsonl")}])
    it = pretrain.make_pretrain_iterator(cfg, tok)
    for _ in range(3):
        next(it)
    (tmp_path / "ckpt").mkdir()
    grain.checkpoint.CheckpointHandler().save(epath.Path(tmp_path / "ckpt"), item=it)
    fresh = grain.checkpoint.CheckpointHandler().restore(
        epath.Path(tmp_path / "ckpt"), item=pretrain.make_pretrain_iterator(cfg, tok)
    )
    np.testing.assert_array_equal(next(fresh)["tokens"], next(it)["tokens"])
    assert fresh.counts() == it.counts()
