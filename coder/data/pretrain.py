"""Pretraining input pipeline: sources -> mixture -> host shard -> tokenize -> pack -> batches.

Entry point for the trainer:

    it = make_pretrain_iterator(config, tokenizer, split="train",
                                process_index=jax.process_index(),
                                process_count=jax.process_count())
    batch = next(it)        # dict of numpy arrays [config.data.batch_size // process_count, seq_len]
    state = it.get_state()  # JSON-serialisable dict: save it in every checkpoint
    it.set_state(state)     # on a fresh iterator from the same config: continues exactly
    it.metrics()            # {"data/records_seen": ..., "data/records_bad": ..., per kind, ...}

`it` is a grain DatasetIterator, so `grain.checkpoint.CheckpointSave(it)` / `CheckpointRestore`
put its state in an orbax checkpoint (one JSON file per process). Keyword arguments `seq_len`
and `batch_size` override config.data's (longctx / sft stages). A state restores only into an
iterator built from the same data settings (sources, seed, seq_len, batch, hosts, workers).

Batches follow docs/contracts.md: `tokens` int32, `positions` int32, `segment_ids` int32,
`loss_mask` float32 (1 on every non-padding token). Padding only appears at the end of a finite
(held-out) pass. `split="train"` repeats forever (each epoch reshuffled); "heldout" makes one
ordered pass, the last batch padded. The number of held-out batches can differ between hosts, so
a multi-host eval should take a fixed number of batches from `num_epochs=None`.

Design:
- Index-based grain pipeline: each source is a `MapDataset` over record indices, filtered to the
  split, globally shuffled (seed from `config.seed` and the source index), repeated; sources are
  interleaved by `MapDataset.mix` in proportion to their weights (a share of *records*, exact at
  every prefix, not sampled); each host takes every process_count-th record of the mixture, so
  hosts are disjoint and together complete. The split of a record is a hash of its index.
- Documents are `[bos] + text + [eos]`, packed greedily into rows (concat-then-split): a row
  holds consecutive documents; a document that does not fit is cut and continues at the start
  of the next row. Each piece gets its own segment id; its positions continue the document's
  (the piece at token offset o starts at position o) while they stay below the model's
  max_position_embeddings, and restart at 0 for a piece that would pass it. RoPE only sees
  position differences inside a segment, so the offset changes no attention score; it keeps a
  token's position its place in the document wherever the model's context allows.
  The cut loses one prediction per cut (a piece's first token has no predecessor in its row).
- Repository documents (config.data.repos, coder.data.repo_docs): one document per repository,
  its files in dependency order (or runs of them, config.data.repo_part_chars), mixed with the
  short sources at config.data.repo_weight.
- Bad records are not filtered silently: the packer counts each record it consumes, per source
  and per kind, and ships the counts with the batch; `DataIterator` accumulates them (in its
  checkpointed state) and raises, naming the source, when a source's bad fraction exceeds
  `config.data.max_bad_fraction` after `config.data.bad_check_min_records` records.
- Exact resume: the packer's state is the parent iterator's state *before* the document it is
  cutting plus the offset into it; restoring re-reads that one document (not re-counted).
- `config.data.num_workers > 0`: grain worker processes (`mp_prefetch`) each read, tokenize and
  pack their own slice of this host's records; batches alternate between workers. The order
  differs from num_workers=0 but is deterministic and checkpointed (workers' states included).
  Without workers, two threads read and tokenize ahead of the packer.
"""
import grain
import numpy as np
from absl import flags

from coder.data import corpus, repo_docs, sources
from coder.data.sources import BAD_KINDS

# Columns of the per-source counters ("heldout": documents dropped as overlapping held-out code).
STAT_COLUMNS = ("seen",) + BAD_KINDS + ("truncated", "dropped", "heldout")
_SEEN, _TRUNCATED, _DROPPED, _HELDOUT = 0, len(BAD_KINDS) + 1, len(BAD_KINDS) + 2, len(BAD_KINDS) + 3


# --- per-record work (runs inside grain, possibly in worker processes: all picklable) --------
class _Fetch:
    """Record index -> (source index, raw record)."""

    def __init__(self, source_index: int, source):
        self.source_index, self.source = source_index, source

    def __call__(self, index: int):
        return self.source_index, self.source[index]


class _InSplit:
    def __init__(self, salt: int, split: str, heldout_fraction: float):
        self.salt, self.split, self.heldout_fraction = salt, split, heldout_fraction

    def __call__(self, index: int) -> bool:
        return sources.record_in_split(self.salt, index, self.split, self.heldout_fraction)


def bad_doc(source_index: int, kind: str) -> dict:
    return {"source": source_index, "bad": BAD_KINDS.index(kind), "tokens": None}


def heldout_doc(source_index: int) -> dict:
    """A document left out for overlapping held-out code (coder.data.decontaminate)."""
    return {"source": source_index, "bad": -1, "tokens": None, "heldout": True}


class PretrainTransform:
    """(source index, raw record) -> document {"tokens" int32 [n], "source", "bad"}; a text
    overlapping `exclude` (a decontaminate.NgramIndex of held-out code) is left out."""

    def __init__(self, tokenizer, specs: list[dict], exclude=None):
        self.tokenizer, self.exclude = tokenizer, exclude
        self.formats = [(s["format"], s["text_field"]) for s in specs]

    def __call__(self, item) -> dict:
        source_index, raw = item
        fmt, field = self.formats[source_index]
        obj, bad = sources.parse_record(raw, fmt, field)
        if obj is not None:
            text, bad = sources.extract_text(obj, field)
        if bad is not None:
            return bad_doc(source_index, bad)
        if self.exclude is not None and self.exclude.contaminated(text):
            return heldout_doc(source_index)
        ids = self.tokenizer.encode(text)
        tokens = np.empty(len(ids) + 2, np.int32)
        tokens[0], tokens[1:-1], tokens[-1] = self.tokenizer.bos_id, ids, self.tokenizer.eos_id
        return {"source": source_index, "bad": -1, "tokens": tokens}


class BadDataError(ValueError):
    pass


def check_bad_counts(counts, names, max_bad_fraction: float, min_records: int) -> None:
    """Raises BadDataError naming the first source over the bad-record threshold."""
    bad = counts[:, 1 : 1 + len(BAD_KINDS)]
    for s, name in enumerate(names):
        seen = counts[s, _SEEN]
        if seen >= min_records and bad[s].sum() > max_bad_fraction * seen:
            kinds = {k: int(v) for k, v in zip(BAD_KINDS, bad[s]) if v}
            raise BadDataError(
                f"data source {name!r}: {int(bad[s].sum())} of {int(seen)} records are bad "
                f"{kinds}, more than config.data.max_bad_fraction={max_bad_fraction}; "
                "fix or remove the bad records, or raise the threshold"
            )


# --- packing ----------------------------------------------------------------------------------
class _PackIterator(grain.DatasetIterator):
    """Packs documents into batches [rows, seq_len]; see PackIterDataset."""

    def __init__(self, parent, seq_len: int, rows: int, num_sources: int, split_docs: bool, guard,
                 max_position: int):
        super().__init__(parent)
        self._seq_len, self._rows, self._split_docs = seq_len, rows, split_docs
        self._max_position = max_position
        self._num_sources = num_sources
        self._guard = guard  # (source names, max bad fraction, min records) or None
        self._pending = None  # [doc, token offset, parent state before doc]
        self._exhausted = False

    def _pull(self, stats: np.ndarray):
        """The next valid document (counted), or None at the end of the data."""
        while True:
            state = self._parent.get_state()
            try:
                doc = next(self._parent)
            except StopIteration:
                self._exhausted = True
                return None
            row = stats[doc["source"]]
            row[_SEEN] += 1
            if doc["bad"] >= 0:
                row[1 + doc["bad"]] += 1
                if self._guard is not None and row[_SEEN] >= self._guard[2]:
                    # A long run of bad records would otherwise spin here without ever
                    # returning a batch to DataIterator's check.
                    check_bad_counts(stats, *self._guard)
                continue
            if doc.get("heldout"):
                row[_HELDOUT] += 1
                continue
            if doc.get("truncated"):
                row[_TRUNCATED] += 1
            if doc.get("dropped"):
                row[_DROPPED] += 1
                continue
            return [doc, 0, state]

    def __next__(self) -> dict:
        n, rows = self._seq_len, self._rows
        batch = {
            "tokens": np.zeros((rows, n), np.int32),
            "positions": np.zeros((rows, n), np.int32),
            "segment_ids": np.zeros((rows, n), np.int32),
            "loss_mask": np.zeros((rows, n), np.float32),
        }
        stats = np.zeros((self._num_sources, len(STAT_COLUMNS)), np.int64)
        fill = np.zeros(rows, np.int64)  # tokens used per row
        segments = np.zeros(rows, np.int64)  # segments used per row
        row = 0
        while not self._exhausted:
            if self._pending is None:
                self._pending = self._pull(stats)
                if self._pending is None:
                    break
            doc, offset, _ = self._pending
            length = len(doc["tokens"]) - offset
            if self._split_docs:
                # Concat-then-split: fill rows in order, cutting the document at a row's end.
                if fill[row] == n:
                    row += 1
                    if row == rows:
                        break
                take = min(length, n - fill[row])
                r = row
            else:
                # Whole documents, first fit: the batch ends when one fits in no row.
                if length > n:
                    raise ValueError(f"a {length}-token document cannot be packed whole in {n}")
                fits = np.flatnonzero(fill + length <= n)
                if len(fits) == 0:
                    break
                r, take = fits[0], length
            start, end = fill[r], fill[r] + take
            segments[r] += 1
            piece = slice(offset, offset + take)
            batch["tokens"][r, start:end] = doc["tokens"][piece]
            first = offset if offset + take <= self._max_position else 0  # continue the document
            batch["positions"][r, start:end] = np.arange(first, first + take)
            batch["segment_ids"][r, start:end] = segments[r]
            mask = doc.get("loss_mask")
            batch["loss_mask"][r, start:end] = 1.0 if mask is None else mask[piece]
            fill[r] = end
            self._pending = None if take == length else [doc, offset + take, self._pending[2]]
        if not fill.any():
            raise StopIteration
        batch["_stats"] = stats
        return batch

    def get_state(self) -> dict:
        if self._pending is None:
            return {"parent": self._parent.get_state(), "offset": -1}
        return {"parent": self._pending[2], "offset": int(self._pending[1])}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._exhausted = False
        self._pending = None
        if state["offset"] >= 0:
            # Re-read the document being cut; it was counted when first consumed.
            self._pending = [next(self._parent), state["offset"], state["parent"]]


class PackIterDataset(grain.IterDataset):
    """Documents {"tokens" [n], optional "loss_mask" [n], "source", "bad"} -> packed batches.

    split_docs=True: concat-then-split (pretraining; documents may be cut across rows).
    split_docs=False: whole documents placed first-fit (SFT; each must be <= seq_len tokens).
    Each batch carries "_stats" [num_sources, len(STAT_COLUMNS)]: records consumed for it.
    guard: (source names, max bad fraction, min records): raise BadDataError when the records
    consumed for one batch are mostly bad (DataIterator checks the cumulative counts).
    max_position: a piece cut from a document at token offset o gets positions o, o+1, ... when
    they stay below it, else 0, 1, ... (None: seq_len, i.e. every later piece restarts at 0).
    """

    def __init__(self, parent, seq_len: int, rows: int, num_sources: int, split_docs: bool, guard=None,
                 max_position: int | None = None):
        super().__init__(parent)
        self._args = (seq_len, rows, num_sources, split_docs, guard, max_position or seq_len)

    def __iter__(self):
        return _PackIterator(self._parent.__iter__(), *self._args)

    def __str__(self) -> str:
        seq_len, rows, num_sources, split_docs, _, _ = self._args
        return f"PackIterDataset({seq_len=}, {rows=}, {num_sources=}, {split_docs=})"


# --- the iterator the trainer sees ------------------------------------------------------------
class DataIterator(grain.DatasetIterator):
    """Batches plus cumulative per-source record counters; state = pipeline state + counters.

    A grain `DatasetIterator`, so `grain.checkpoint.CheckpointSave(it)` / `CheckpointRestore`
    store its (JSON) state in an orbax checkpoint, one file per process.
    """

    def __init__(self, dataset, source_names, max_bad_fraction: float, min_records: int):
        super().__init__(iter(dataset))
        self.source_names = list(source_names)
        self._counts = np.zeros((len(self.source_names), len(STAT_COLUMNS)), np.int64)
        self._max_bad_fraction, self._min_records = max_bad_fraction, min_records

    def __next__(self) -> dict:
        batch = next(self._parent)
        self._counts += batch.pop("_stats")
        check_bad_counts(self._counts, self.source_names, self._max_bad_fraction, self._min_records)
        return batch

    def counts(self) -> dict:
        """{source name: {column: count}} since the start of training (restored on resume)."""
        return {
            name: dict(zip(STAT_COLUMNS, map(int, row)))
            for name, row in zip(self.source_names, self._counts)
        }

    def metrics(self) -> dict:
        """Flat counters for the trainer's metric line."""
        total = self._counts.sum(0)
        out = {"data/records_seen": int(total[_SEEN])}
        out["data/records_bad"] = int(total[1 : 1 + len(BAD_KINDS)].sum())
        for k, kind in enumerate(BAD_KINDS):
            out[f"data/bad_{kind}"] = int(total[1 + k])
        out["data/truncated"], out["data/dropped"] = int(total[_TRUNCATED]), int(total[_DROPPED])
        out["data/heldout_dropped"] = int(total[_HELDOUT])
        return out

    def get_state(self) -> dict:
        return {"pipeline": self._parent.get_state(), "counts": self._counts.tolist()}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["pipeline"])
        counts = np.asarray(state["counts"], np.int64).reshape(len(self.source_names), -1)
        self._counts = np.zeros_like(self._counts)
        self._counts[:, : counts.shape[1]] = counts  # a state saved before the "heldout" column


# --- pipeline construction --------------------------------------------------------------------
def corpus_spec(config, split: str) -> dict:
    """The bundled stdlib corpus as a source of whole-file documents (split by path hash)."""
    if config.data.corpus != "python_stdlib":
        raise ValueError(f"config.data.corpus={config.data.corpus!r}: only 'python_stdlib' exists")
    files = corpus.stdlib_files(split, config.data.heldout_fraction)
    return sources.normalize_spec({"path": files, "format": "text", "name": "python_stdlib"})


def repo_spec(config, split: str) -> dict:
    """The repository documents of `split` (config.data.repos, coder.data.repo_docs) as a source
    spec of weight config.data.repo_weight; the split is by repository (split_repositories)."""
    urls = repo_docs.split_repositories(repo_docs.repository_dirs(config.data.repos), split,
                                        float(config.data.heldout_fraction))
    if not urls:
        raise ValueError(f"config.data.repos={tuple(config.data.repos)}: no repository in split {split!r} "
                         "(a held-out split needs >= 2 repositories and data.heldout_fraction > 0)")
    return {"path": tuple(urls), "weight": float(config.data.repo_weight), "format": "repo",
            "text_field": "text", "name": "repositories", "part_chars": int(config.data.repo_part_chars)}


def check_repos(config) -> None:
    """config.data.repos / repo_weight, at start-up: a weight needs repositories, and >= 0."""
    weight = float(config.data.repo_weight)
    if weight < 0:
        raise ValueError(f"config.data.repo_weight={weight} must be >= 0 (0 = no repository documents)")
    if int(config.data.repo_part_chars) < 0:
        raise ValueError(f"config.data.repo_part_chars={config.data.repo_part_chars} must be >= 0 "
                         "(0 = one document per repository)")
    if weight > 0 and not config.data.repos:
        raise ValueError(f"config.data.repo_weight={weight} mixes in repository documents, but "
                         "config.data.repos is empty: set it to globs of repository directories")


def build_iterator(
    config,
    specs: list[dict],
    transform,
    *,
    split: str,
    split_records: bool | tuple,
    split_docs: bool,
    process_index: int,
    process_count: int,
    num_epochs: int | None,
    shuffle: bool,
    seq_len: int | None = None,
    batch_size: int | None = None,
    max_position: int | None = None,
) -> DataIterator:
    """The shared pipeline of pretraining and SFT (see the module docstring).

    seq_len / batch_size default to config.data's; stages with their own (longctx, sft) pass them.
    split_records: whether each source's records are split by index hash (one bool, or one per
    spec; a source already of one split, as the bundled corpus and repositories, says False).
    max_position: positions of a cut document continue up to it (PackIterDataset).
    """
    if isinstance(split_records, bool):
        split_records = (split_records,) * len(specs)
    seq_len = seq_len or config.data.seq_len
    batch_size = batch_size or config.data.batch_size
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if batch_size % process_count:
        raise ValueError(
            f"batch_size={batch_size} must be divisible by the {process_count} data-loading "
            "processes"
        )
    if split == "heldout" and config.data.heldout_fraction <= 0:
        raise ValueError("config.data.heldout_fraction is 0: there is no held-out split")
    datasets = []
    for i, spec in enumerate(specs):
        source = sources.open_source(spec)
        if len(source) == 0:
            raise ValueError(f"data source {spec['name']!r} holds no records")
        ds = grain.MapDataset.range(len(source))
        if split_records[i]:
            ds = ds.filter(_InSplit(i, split, config.data.heldout_fraction))
        ds = ds.map(_Fetch(i, source))
        if shuffle:
            ds = ds.shuffle(seed=(config.seed * 1_000_003 + i) % 2**32)
        datasets.append(ds.repeat(num_epochs) if num_epochs != 1 else ds)
    if len(datasets) == 1:
        mixed = datasets[0]
    elif num_epochs is None:
        mixed = grain.MapDataset.mix(datasets, [float(s["weight"]) for s in specs])
    else:
        # A finite pass reads every record once; mixing would stop at the smallest source.
        # Repository documents first: a stage's few held-out batches then score long documents.
        order = sorted(range(len(specs)), key=lambda i: specs[i]["format"] != "repo")
        mixed = grain.MapDataset.concatenate([datasets[i] for i in order])
    mixed = mixed[process_index::process_count].map(transform)
    # Threads read and tokenize ahead in order; the output order does not depend on them.
    ds = mixed.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=256))
    names = [s["name"] for s in specs]
    guard = (names, config.data.max_bad_fraction, config.data.bad_check_min_records)
    ds = PackIterDataset(ds, seq_len, batch_size // process_count, len(specs), split_docs, guard,
                         max_position)
    if config.data.num_workers > 0:
        # grain's worker processes read its absl flags; outside an absl app (tests, notebooks)
        # nobody parsed them, so take their defaults.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.data.num_workers))
    return DataIterator(
        ds,
        names,
        config.data.max_bad_fraction,
        config.data.bad_check_min_records,
    )


def make_pretrain_iterator(
    config,
    tokenizer,
    split: str = "train",
    process_index: int = 0,
    process_count: int = 1,
    *,
    num_epochs: int | None = -1,
    seq_len: int | None = None,
    batch_size: int | None = None,
    exclude=None,
) -> DataIterator:
    """Packed pretraining batches of this host; see the module docstring.

    num_epochs: -1 = the split's default (train: forever, shuffled; heldout: one ordered pass),
    None = forever, k = k passes. seq_len / batch_size (global rows) override config.data's.
    A saved state restores only into an iterator built with the same data settings.
    With config.data.repo_weight > 0, repository documents (repo_spec) join the short sources,
    last, so the short sources' shuffles and splits are those of a run without them.
    exclude: a decontaminate.NgramIndex of held-out code: documents overlapping it are left out
    and counted (data/heldout_dropped).
    """
    if num_epochs == -1:
        num_epochs = None if split == "train" else 1
    check_repos(config)
    if config.data.sources:
        specs = [sources.normalize_spec(s) for s in config.data.sources]
        split_records = (True,) * len(specs)
    else:
        specs, split_records = [corpus_spec(config, split)], (False,)
    if float(config.data.repo_weight) > 0:
        specs, split_records = specs + [repo_spec(config, split)], split_records + (False,)
    return build_iterator(
        config,
        specs,
        PretrainTransform(tokenizer, specs, exclude),
        split=split,
        split_records=split_records,
        split_docs=True,
        process_index=process_index,
        process_count=process_count,
        num_epochs=num_epochs,
        shuffle=num_epochs != 1,
        seq_len=seq_len,
        batch_size=batch_size,
        max_position=int(config.model.max_position_embeddings),
    )
