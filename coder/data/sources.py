"""Random-access record sources over JSONL, Parquet, ArrayRecord and plain-text files.

A source spec (an entry of `config.data.sources`) is a dict:
  path        glob, URL or list of them: local paths or any fsspec URL (gs://, s3://, memory://)
  weight      mixture weight (default 1.0): the share of *records* drawn from this source
  format      "jsonl" | "parquet" | "arrayrecord" | "text" (default: from the file extension,
              .jsonl/.json, .parquet, .array_record; any other = "text": each file is one
              document, e.g. a tree of .py files). Compressed files are refused (no random access).
  text_field  field holding the document text (default "text"; SFT reads "messages")
  name        name used in counters and errors (default: the path)

Sources are random-access data sources in grain's sense (len + getitem), so the pipeline can
shuffle globally by index. They return *raw* records (bytes, or a Parquet cell); `parse_record`
turns one into a dict or a bad-record kind, so bad records are counted where they are consumed.
ArrayRecord records are UTF-8 JSON objects, like JSONL lines.

Costs to know at scale: a JSONL file is read once at start to index its line offsets; a Parquet
row is read by decoding its row group (a small LRU of decoded groups makes nearby reads cheap,
but global shuffling over huge Parquet sets is slow: convert them to ArrayRecord); a non-local
ArrayRecord file is copied once to a local cache (fsspec simplecache), since its reader needs a
local path.
"""
import collections
import json
import os
import tempfile
import threading

import fsspec
import numpy as np

from coder.data import repo_docs

FORMATS = ("jsonl", "parquet", "arrayrecord", "text")
SPEC_KEYS = ("path", "weight", "format", "text_field", "name")
# Kinds of bad record, in the column order of the counters (column 0 counts records seen).
BAD_KINDS = ("malformed_json", "missing_field", "invalid_utf8", "empty_text", "invalid_conversation")
_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".array_record": "arrayrecord",
    ".arrayrecord": "arrayrecord",
}


def normalize_spec(spec) -> dict:
    """Fills defaults and rejects unknown keys or formats, naming what to fix."""
    spec = dict(spec)
    unknown = set(spec) - set(SPEC_KEYS)
    if unknown:
        raise ValueError(f"data source {spec!r}: unknown keys {sorted(unknown)}; known: {SPEC_KEYS}")
    if "path" not in spec:
        raise ValueError(f"data source {spec!r} has no 'path'")
    paths = spec["path"] if isinstance(spec["path"], (list, tuple)) else [spec["path"]]
    spec["path"] = tuple(str(p) for p in paths)
    spec.setdefault("weight", 1.0)
    if not float(spec["weight"]) > 0:
        raise ValueError(f"data source {spec['path']}: weight must be > 0, got {spec['weight']}")
    first = spec["path"][0].rstrip("*").lower()
    if first.endswith((".gz", ".zst", ".bz2", ".xz")):
        # Records are read by index (global shuffle, exact resume): that needs random access.
        raise ValueError(
            f"data source {spec['path']}: compressed files cannot be read by record index; "
            "decompress them or convert them to ArrayRecord"
        )
    if "format" not in spec:
        ext = os.path.splitext(first)[1]
        spec["format"] = _EXTENSIONS.get(ext, "text" if ext else "jsonl")
    if spec["format"] not in FORMATS:
        raise ValueError(f"data source {spec['path']}: format {spec['format']!r} not in {FORMATS}")
    spec.setdefault("text_field", "text")
    spec.setdefault("name", ",".join(spec["path"]))
    return spec


def expand_paths(patterns) -> list[str]:
    """Globs each pattern (local or fsspec URL) into sorted full URLs; missing files are errors."""
    out = []
    for pattern in patterns:
        fs, _, matches = fsspec.core.get_fs_token_paths(pattern)
        if not matches or not all(fs.isfile(m) for m in matches):
            raise FileNotFoundError(f"data source path {pattern!r} matches no files")
        out += sorted(fs.unstrip_protocol(m) if "://" in pattern else m for m in matches)
    return out


class _FileSource:
    """Shared plumbing: lazily opened fsspec file handles, one set per thread (grain reads with
    several threads; a shared handle's seek + read would race), never pickled to workers."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self._local = threading.local()

    _MAX_OPEN = 32  # per thread: thousands of shards must not exhaust file descriptors

    def _open(self, file_index: int):
        handles = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = collections.OrderedDict()
        handle = handles.get(file_index)
        if handle is None:
            handle = handles[file_index] = fsspec.open(self.paths[file_index], "rb").open()
            if len(handles) > self._MAX_OPEN:
                handles.popitem(last=False)[1].close()
        else:
            handles.move_to_end(file_index)
        return handle

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_local"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()


class JsonlSource(_FileSource):
    """One record per non-empty line; getitem returns the line's bytes (without the newline)."""

    def __init__(self, paths: list[str]):
        super().__init__(paths)
        starts, ends = [], []
        for path in paths:
            s, e = self._line_spans(path)
            starts.append(s)
            ends.append(e)
        self._starts, self._ends = starts, ends
        self._offsets = np.cumsum([0] + [len(s) for s in starts])

    @staticmethod
    def _line_spans(path: str, chunk_bytes: int = 1 << 26) -> tuple[np.ndarray, np.ndarray]:
        """[start, end) byte offsets of the records of one file, read in chunks."""
        newlines, size = [], 0
        with fsspec.open(path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                newlines.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n")) + size)
                size += len(chunk)
        newlines = np.concatenate(newlines + [np.zeros(0, np.int64)]).astype(np.int64)
        s = np.concatenate([[0], newlines + 1])
        e = np.concatenate([newlines, [size]])
        # A line holding nothing, or only the \r of a CRLF file, is not a record.
        keep = e - s > 1
        one = np.flatnonzero(e - s == 1)
        if len(one):
            with fsspec.open(path, "rb") as f:
                for i in one:
                    f.seek(int(s[i]))
                    keep[i] = f.read(1) != b"\r"
        return s[keep], e[keep]

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> bytes:
        file_index = int(np.searchsorted(self._offsets, index, side="right") - 1)
        i = index - self._offsets[file_index]
        start, end = self._starts[file_index][i], self._ends[file_index][i]
        handle = self._open(file_index)
        handle.seek(int(start))
        return handle.read(int(end - start))


class ParquetSource(_FileSource):
    """One record per row; getitem returns the row's `field` cell (str, bytes, list, or None)."""

    _CACHED_GROUPS = 4

    def __init__(self, paths: list[str], field: str):
        super().__init__(paths)
        import pyarrow.parquet as pq  # heavy: pyarrow (parquet sources only)

        self.field = field
        self._groups = []  # (file index, row group, first global row)
        total = 0
        for file_index, path in enumerate(paths):
            with fsspec.open(path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
                if field not in meta.schema.names:
                    raise ValueError(f"{path}: no column {field!r} (columns: {meta.schema.names})")
                for g in range(meta.num_row_groups):
                    self._groups.append((file_index, g, total))
                    total += meta.row_group(g).num_rows
        self._starts = np.asarray([g[2] for g in self._groups] + [total], np.int64)
        self._cache = collections.OrderedDict()  # row group -> decoded column, LRU
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int):
        import pyarrow.parquet as pq  # heavy: pyarrow (parquet sources only)

        g = int(np.searchsorted(self._starts, index, side="right") - 1)
        with self._lock:
            column = self._cache.get(g)
        if column is None:
            file_index, group, _ = self._groups[g]
            table = pq.ParquetFile(self._open(file_index)).read_row_group(group, columns=[self.field])
            column = table.column(self.field).to_pylist()
            with self._lock:
                self._cache[g] = column
                if len(self._cache) > self._CACHED_GROUPS:
                    self._cache.popitem(last=False)
        return column[index - int(self._starts[g])]

    def __getstate__(self):
        state = super().__getstate__()
        state["_cache"] = collections.OrderedDict()
        del state["_lock"]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lock = threading.Lock()


class TextFileSource(_FileSource):
    """One record per file: its bytes."""

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> bytes:
        with fsspec.open(self.paths[index], "rb") as f:
            return f.read()


def _local_arrayrecord_paths(paths: list[str]) -> list[str]:
    """ArrayRecord's reader needs local files: non-local URLs are copied once to a local cache."""
    local = []
    cache = os.path.join(tempfile.gettempdir(), "coder-arrayrecord-cache")
    for path in paths:
        if "://" not in path or path.startswith("file://"):
            local.append(path.removeprefix("file://"))
        else:
            local.append(fsspec.open_local(f"simplecache::{path}", simplecache={"cache_storage": cache}))
    return local


def open_source(spec: dict):
    """A random-access source of raw records for a normalized spec (or coder.data.pretrain's
    repo_spec: format "repo", paths = repository directories, one record each)."""
    fmt = spec["format"]
    if fmt == "repo":
        return repo_docs.RepoSource(list(spec["path"]), int(spec.get("part_chars", 0)))
    paths = expand_paths(spec["path"])
    if fmt == "jsonl":
        return JsonlSource(paths)
    if fmt == "parquet":
        return ParquetSource(paths, spec["text_field"])
    if fmt == "arrayrecord":
        import grain  # imported here: the tokenizer imports this module and needs no grain

        return grain.sources.ArrayRecordDataSource(_local_arrayrecord_paths(paths))
    return TextFileSource(paths)


def parse_record(raw, fmt: str, field: str) -> tuple[dict | None, str | None]:
    """Raw record -> (dict holding `field`, None) or (None, bad kind). Never raises on bad data."""
    if raw is None:
        return None, "missing_field"
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return None, "invalid_utf8"
        if fmt in ("jsonl", "arrayrecord"):
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, RecursionError):
                return None, "malformed_json"
            if not isinstance(obj, dict):
                return None, "malformed_json"
            return (obj, None) if field in obj else (None, "missing_field")
    # A Parquet cell (already decoded) or the decoded text of a "text" file.
    return {field: raw}, None


def extract_text(obj: dict, field: str) -> tuple[str | None, str | None]:
    """The document text of a parsed record, or a bad kind (missing / empty / invalid UTF-8)."""
    text = obj.get(field)
    if not isinstance(text, str):
        return None, "missing_field"
    if not text or text.isspace():
        return None, "empty_text"
    try:
        # JSON "\ud800" escapes decode to lone surrogates that are not encodable text.
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None, "invalid_utf8"
    return text, None


def iterate_texts(specs, heldout_fraction: float, max_records_per_source: int = 100_000):
    """Valid train-split texts of the sources in file order, round-robin (a tokenizer sample)."""
    specs = [normalize_spec(s) for s in specs]
    sources = [open_source(s) for s in specs]
    limit = min(max(len(s) for s in sources), max_records_per_source)
    for i in range(limit):
        for salt, (spec, source) in enumerate(zip(specs, sources)):
            if i < len(source) and record_in_split(salt, i, "train", heldout_fraction):
                obj, bad = parse_record(source[i], spec["format"], spec["text_field"])
                text, bad = extract_text(obj, spec["text_field"]) if obj is not None else (None, bad)
                if text is not None:
                    yield text


def record_in_split(salt: int, index: int, split: str, heldout_fraction: float) -> bool:
    """Deterministic per-record train / held-out split (splitmix64 of the record index)."""
    if split == "all" or heldout_fraction <= 0:
        return split != "heldout"
    z = (index + salt * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    held = z / 2.0**64 < heldout_fraction
    return held == (split == "heldout")
