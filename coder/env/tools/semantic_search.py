"""Semantic code search (the `semantic_search` tool): a repository's definitions embedded by an
encoder and ranked by cosine similarity to the query's embedding.

BM25 (coder.env.tools.search) finds code that shares words with the query; an embedding also finds
code that means what the query says in other words ("the retry loop" -> `_backoff`). Cursor
measured +12.5% accuracy over grep for its agent with semantic search (the seeds).

**Chunks** (`chunk_definitions`): in a Python file each top-level function is one chunk, a class
one chunk when it is short, else its header (docstring, class attributes) one chunk and each
method one; module-level code between definitions one chunk per run of lines; decorators go with
their definition. A chunk longer than `max_lines` is cut into windows. Other files, and Python
that does not parse, are cut into the overlapping windows BM25 uses. A chunk is embedded as its
path, its class line (a method), then its text, so a file's and a class's names count.

**Encoders** (`SemanticSpec.encoder`, a `package.module:factory` import path called with the
spec's options): the factory returns any object with `encode(list[str]) -> array [n, dim]`
(its `name` attribute, if any, keys the cache; else the import path). The tool imports the
factory where it runs (the env worker), so this module depends on no model code. What
`env.semantic_encoder` names (coder.infer.embedding.semantic_spec turns the config into a spec):
- `"policy"` (the default): the policy model's own trunk, mean-pooled
  (coder.infer.embedding.PolicyEncoder), from the stage's starting checkpoint: no extra weights
  to ship;
- an encoder the user installs (a sentence-transformers model, wordllama, an HTTP embedding
  service's client), by its factory's import path.

**Index**: faiss `IndexFlatIP` over L2-normalised vectors, i.e. exact cosine similarity. faiss
because it is the field's vector-search library, kept by Meta with wheels for every platform,
and has the approximate indexes (IVF, HNSW) a monorepo needs behind the same `search` call; a
repository of 10^4-10^5 chunks is searched exactly in milliseconds.

**Measured** (bench/search_recall.py, 2026-11-28, 2 CPU cores): CPython's standard library as
the repository (168 files, 4.7 MB, 7,742 chunks), 35 generated bug-fix tasks; recall@5 / @10 of
the changed file, three query forms (that bench's docstring):

| ranker | as generated (35) | failing test only (35) | docstring words (19) |
|---|---|---|---|
| BM25 (`search`) | 0.943 / 0.943 | 0.286 / 0.400 | 0.947 / 1.000 |
| policy: the quickstart's GRPO checkpoint (1M parameters) | 0.029 / 0.114 | 0.086 / 0.114 | 0.000 / 0.053 |
| wordllama (installed, 256-d) | 0.571 / 0.771 | 0.000 / 0.086 | 0.632 / 0.684 |

Here BM25 wins every form: these queries carry the code's own identifiers and words, and a
1M-parameter policy's mean-pooled states are near chance (about 0.05). A query takes 17-60 ms
(BM25: 9-24 ms, its index cached the same way). What the policy encoder is worth at the scale it
is meant for is not measured here.

**Cache**: embeddings are stored per file content (sha256), so a vector is only ever used for
the exact text it was computed from. The first search of a task loads the table of the task's
snapshot (`snapshot_key`: repository + commit, or the task's files) from
`{cache_dir}/{encoder}/{snapshot}.npz`, embeds only the files it lacks (the agent's edits, or
everything the first time) and, the first time, writes the table back: the G rollouts of a
group, the next epoch and other workers read it instead of re-embedding the repository. Within
a process the tables stay in memory (`_MAX_TABLES` most recent snapshots).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import tempfile
import threading

import numpy as np

from coder.env.tools import search as search_lib

CACHE = os.path.join(tempfile.gettempdir(), "coder-semantic")
_CHUNKING = "definitions-v1"  # part of the cache key: a change of chunking invalidates tables
_MAX_TABLES = 8


@dataclasses.dataclass(frozen=True)
class SemanticSpec:
    """What a worker needs to build the search (picklable): the encoder's factory by import path,
    called as `factory(**dict(options))`, and where embeddings are cached."""

    encoder: str  # "package.module:factory"
    options: tuple = ()  # (name, value) pairs: the factory's keyword arguments
    cache_dir: str = ""  # "" = CACHE
    max_lines: int = 60  # longest chunk, in lines

    def __post_init__(self):
        module, _, attr = self.encoder.partition(":")
        if not module or not attr:
            raise ValueError(f"semantic search encoder {self.encoder!r}: 'package.module:factory'")


Chunk = search_lib.Chunk  # path, first and last line (1-based), text, and a method's class line


def embed_text(c: Chunk) -> str:
    """What is embedded of a chunk: its path, its class line (a method), its text."""
    return f"{c.path}\n{c.context + chr(10) if c.context else ''}{c.text}"


# --- chunks ------------------------------------------------------------------------------------
def _span(node) -> tuple[int, int]:
    """0-based [start, end) lines of a definition, decorators included."""
    start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
    return start, node.end_lineno


def chunk_definitions(path: str, text: str, max_lines: int = 60) -> list[Chunk]:
    """The chunks of one file (module docstring, "Chunks")."""
    if not path.endswith(".py"):
        return search_lib.chunk_file(path, text, max_lines)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return search_lib.chunk_file(path, text, max_lines)
    lines = text.splitlines()
    spans: list[tuple[int, int, str]] = []  # (start, end, context)
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, defs):
            spans.append((*_span(node), ""))
        elif isinstance(node, ast.ClassDef):
            start, end = _span(node)
            methods = [n for n in node.body if isinstance(n, defs)]
            if end - start <= max_lines or not methods:
                spans.append((start, end, ""))
                continue
            header = lines[node.lineno - 1].strip()
            first = _span(methods[0])[0]
            spans.append((start, first, ""))
            for i, m in enumerate(methods):  # code between methods goes with the one before
                s = _span(m)[0]
                e = _span(methods[i + 1])[0] if i + 1 < len(methods) else end
                spans.append((s, e, header))
    spans.sort()
    # module-level code between definitions: one chunk per gap that holds more than blank lines
    covered, gaps = 0, []
    for s, e, _ in spans:
        if s > covered:
            gaps.append((covered, s, ""))
        covered = max(covered, e)
    if covered < len(lines):
        gaps.append((covered, len(lines), ""))
    chunks = []
    for s, e, ctx in sorted(spans + gaps):
        while s < e and not lines[s].strip():
            s += 1
        while e > s and not lines[e - 1].strip():
            e -= 1
        for i in range(s, e, max_lines):  # long definitions: consecutive windows
            j = min(i + max_lines, e)
            chunks.append(Chunk(path, i + 1, j, "\n".join(lines[i:j]), ctx))
    return chunks


# --- encoders ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def encoder_of(spec: SemanticSpec):
    """The spec's encoder, built once per process."""
    module, _, attr = spec.encoder.partition(":")
    enc = getattr(importlib.import_module(module), attr)(**dict(spec.options))
    if not callable(getattr(enc, "encode", None)):
        raise TypeError(f"{spec.encoder}() returned {type(enc).__name__}, which has no encode(texts)")
    return enc


def _encoder_name(spec: SemanticSpec, enc) -> str:
    name = str(getattr(enc, "name", "") or spec.encoder)
    return hashlib.sha256(f"{name}|{_CHUNKING}|{spec.max_lines}".encode()).hexdigest()[:16]


def normalized(vectors) -> np.ndarray:
    """`[n, dim]` float32 rows scaled to unit length (zero rows stay zero)."""
    v = np.asarray(vectors, np.float32)
    if v.ndim != 2:
        raise ValueError(f"an encoder returned an array of shape {v.shape}, not [n, dim]")
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


# --- the per-file table and the index ----------------------------------------------------------
def snapshot_key(task) -> str:
    """Which repository snapshot a task's workspace starts from: repository and commit for a
    repository task, else the digest of the task's files."""
    repo, commit = getattr(task, "repo", "") or "", getattr(task, "commit", "") or ""
    if repo and commit:
        what = f"{repo}@{commit}"
    else:
        files = getattr(task, "files", {}) or {}
        what = json.dumps(sorted((p, hashlib.sha256(t.encode()).hexdigest()) for p, t in files.items()))
    return hashlib.sha256(what.encode()).hexdigest()[:24]


class _Table:
    """file sha256 -> (chunks, vectors `[n_chunks, dim]`) of one snapshot, plus what was added
    since it was loaded."""

    def __init__(self):
        self.entries: dict[str, tuple[list[Chunk], np.ndarray]] = {}
        self.on_disk = False
        self.lock = threading.Lock()

    def save(self, path: str) -> None:
        shas = sorted(self.entries)
        chunks = [[dataclasses.asdict(c) for c in self.entries[s][0]] for s in shas]
        vecs = [self.entries[s][1] for s in shas]
        dim = next((v.shape[1] for v in vecs if v.size), 0)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp.npz"
        np.savez(tmp, shas=np.asarray(shas), chunks=np.asarray(json.dumps(chunks)),
                 counts=np.asarray([len(c) for c in chunks], np.int64),
                 vectors=np.concatenate([v.reshape(-1, dim) for v in vecs]) if dim else np.zeros((0, 0), np.float32))
        os.replace(tmp, path)  # atomic: a reader sees the whole table or none

    @classmethod
    def load(cls, path: str) -> "_Table":
        t = cls()
        with np.load(path) as z:
            shas, chunks, counts, vectors = list(z["shas"]), json.loads(str(z["chunks"])), z["counts"], z["vectors"]
        ends = np.cumsum(counts)
        for sha, cs, end, n in zip(shas, chunks, ends, counts, strict=True):
            t.entries[str(sha)] = ([Chunk(**c) for c in cs], vectors[end - n:end])
        t.on_disk = True
        return t


_TABLES: dict[tuple[str, str], _Table] = {}
_TABLES_LOCK = threading.Lock()


def _table(cache_file: str, key: tuple[str, str]) -> _Table:
    with _TABLES_LOCK:
        t = _TABLES.pop(key, None)
        if t is None:
            t = _Table.load(cache_file) if os.path.exists(cache_file) else _Table()
        _TABLES[key] = t  # most recent last
        while len(_TABLES) > _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        return t


def search(spec: SemanticSpec, task, files: dict[str, str], query: str, k: int = 5,
           encoder=None) -> list[tuple[float, Chunk]]:
    """Top-k chunks of `files` ({path: text}, the workspace now) for `query`, best first, with
    their cosine similarity. `encoder` overrides the spec's (tests, benchmarks)."""
    import faiss  # heavy: faiss (the semantic_search tool only)

    enc = encoder if encoder is not None else encoder_of(spec)
    name = _encoder_name(spec, enc)
    snap = snapshot_key(task)
    cache_file = os.path.join(spec.cache_dir or CACHE, name, f"{snap}.npz")
    table = _table(cache_file, (name, snap))
    shas = {p: hashlib.sha256(t.encode()).hexdigest() for p, t in files.items()}
    with table.lock:  # the calls of one turn may search at once
        _add_missing(table, files, shas, enc, spec, cache_file)
        entries = [table.entries[shas[p]] for p in sorted(files)]
    # the workspace's chunks, with their paths as they are now (a file may have moved)
    chunks, vecs = [], []
    for p, (cs, v) in zip(sorted(files), entries, strict=True):
        chunks += [dataclasses.replace(c, path=p) for c in cs]
        vecs.append(v)
    dims = {v.shape[1] for v in vecs if v.size}
    if not chunks or not dims:
        return []
    if len(dims) > 1:
        raise ValueError(f"{cache_file} mixes vector sizes {sorted(dims)}: remove it")
    index = faiss.IndexFlatIP(dims.pop())
    index.add(np.concatenate([v for v in vecs if v.size]))
    q = normalized(enc.encode([query]))
    scores, ids = index.search(q, min(int(k), len(chunks)))
    return [(float(s), chunks[i]) for s, i in zip(scores[0], ids[0], strict=True) if i >= 0]


def _add_missing(table: _Table, files: dict, shas: dict, enc, spec: SemanticSpec, cache_file: str):
    """Embed the files whose content the table lacks; the snapshot's first build is saved."""
    missing = {}
    for p in sorted(files):
        if shas[p] not in table.entries and shas[p] not in missing:
            missing[shas[p]] = chunk_definitions(p, files[p], spec.max_lines)
    if missing:
        todo = [c for cs in missing.values() for c in cs]
        vecs = normalized(enc.encode([embed_text(c) for c in todo])) if todo else np.zeros((0, 0), np.float32)
        if len(vecs) != len(todo):
            raise ValueError(f"the encoder returned {len(vecs)} vectors for {len(todo)} texts")
        i = 0
        for sha, cs in missing.items():
            table.entries[sha] = (cs, vecs[i:i + len(cs)])
            i += len(cs)
        if not table.on_disk:  # the snapshot's first build: later rollouts read it
            table.save(cache_file)
            table.on_disk = True
