"""Code search over a workspace: chunking plus BM25 ranking (Okapi BM25, k1=1.2, b=0.75).

Files are cut into chunks of `chunk_lines` lines overlapping by half a chunk; Python files cut
preferably at top-level `def`/`class` lines so a chunk tends to hold whole functions. Tokens are
identifier parts: `parse_http_header` and `parseHttpHeader` both index as parse/http/header plus
the whole identifier, so a natural-language query matches code names.

This is the `search` tool; `semantic_search` (coder.env.tools.semantic_search) ranks by embeddings.

Cache: a file's chunks and their term counts are kept per file content (sha256) and an index
per corpus (the set of file contents), in this process (`_MAX_FILES` files, `_MAX_INDEXES`
corpora, least recently used dropped). A rollout's searches over one repository then tokenize it
once, and a search after an edit re-tokenizes the edited file only (the corpus statistics, idf
and average length, are recomputed from the cached counts). Measured on the standard library
(168 files, 4.7 MB; bench/search_recall.py): 0.92 s a query before, 9-24 ms (median) after, the
rankings unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import re
import threading
from collections import Counter

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


@dataclasses.dataclass(frozen=True)
class Chunk:
    path: str
    start: int  # first line, 1-based
    end: int  # last line, inclusive
    text: str
    context: str = ""  # semantic_search: a method's class line (embedded with it, not shown)


def tokenize(text: str) -> list[str]:
    out = []
    for ident in _IDENT.findall(text):
        low = ident.lower()
        out.append(low)
        parts = [p.lower() for piece in ident.split("_") for p in _CAMEL.findall(piece)]
        if len(parts) > 1:
            out.extend(parts)
    return out


def chunk_file(path: str, text: str, chunk_lines: int = 40) -> list[Chunk]:
    lines = text.splitlines()
    if not lines:
        return []
    starts = [0]
    if path.endswith(".py"):  # prefer boundaries at top-level definitions
        defs = [i for i, ln in enumerate(lines) if re.match(r"(async\s+def|def|class)\b|@", ln)]
        for d in defs:
            if d - starts[-1] >= chunk_lines // 4:
                starts.append(d)
    chunks = []
    bounds = starts + [len(lines)]
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        step = max(chunk_lines // 2, 1)
        i = s
        while True:
            j = min(i + chunk_lines, e)
            chunks.append(Chunk(path, i + 1, j, "\n".join(lines[i:j])))
            if j >= e:
                break
            i += step
    return chunks


class BM25:
    def __init__(self, docs: list[list[str]] | None = None, k1: float = 1.2, b: float = 0.75, *,
                 counts: list[Counter] | None = None):
        """Over `docs` (token lists) or their term `counts`."""
        self.k1, self.b = k1, b
        self.tf = [Counter(d) for d in docs] if counts is None else list(counts)
        self.len = [sum(c.values()) for c in self.tf]
        self.avg = sum(self.len) / max(len(self.tf), 1)
        df = Counter(t for d in self.tf for t in d)
        n = len(self.tf)
        # Robertson-Sparck Jones idf, floored at 0 so very common terms never subtract.
        self.idf = {t: max(math.log((n - f + 0.5) / (f + 0.5) + 1.0), 0.0) for t, f in df.items()}

    def scores(self, query: list[str]) -> list[float]:
        q = Counter(query)
        out = []
        for tf, ln in zip(self.tf, self.len, strict=True):
            s = 0.0
            norm = self.k1 * (1 - self.b + self.b * ln / max(self.avg, 1e-9))
            for t, qn in q.items():
                f = tf.get(t)
                if f:
                    s += qn * self.idf[t] * f * (self.k1 + 1) / (f + norm)
            out.append(s)
        return out


_MAX_FILES = 50_000
_MAX_INDEXES = 8
_FILES: collections.OrderedDict = collections.OrderedDict()  # (sha, path, lines) -> [(Chunk, Counter)]
_INDEXES: collections.OrderedDict = collections.OrderedDict()  # corpus key -> (chunks, BM25)
_LOCK = threading.Lock()


def _file_entry(path: str, text: str, chunk_lines: int) -> list:
    """[(chunk, term counts)] of one file, cached by content (the path is indexed too)."""
    key = (hashlib.sha256(text.encode()).hexdigest(), path, chunk_lines)
    with _LOCK:
        hit = _FILES.pop(key, None)
        if hit is not None:
            _FILES[key] = hit
            return hit
    entry = [(c, Counter(tokenize(c.path + "\n" + c.text))) for c in chunk_file(path, text, chunk_lines)]
    with _LOCK:
        _FILES[key] = entry
        while len(_FILES) > _MAX_FILES:
            _FILES.popitem(last=False)
    return entry


def _index(files: dict[str, str], chunk_lines: int):
    """(chunks, BM25) of a corpus, cached per corpus."""
    entries = [_file_entry(p, files[p], chunk_lines) for p in sorted(files)]
    key = (tuple(id(e) for e in entries), chunk_lines)  # the cached entries are the corpus
    with _LOCK:
        hit = _INDEXES.pop(key, None)
        if hit is not None and all(a is b for a, b in zip(hit[2], entries, strict=True)):
            _INDEXES[key] = hit
            return hit[0], hit[1]
    chunks = [c for e in entries for c, _ in e]
    index = BM25(counts=[n for e in entries for _, n in e])
    with _LOCK:
        _INDEXES[key] = (chunks, index, entries)  # the entries pin the ids of the key
        while len(_INDEXES) > _MAX_INDEXES:
            _INDEXES.popitem(last=False)
    return chunks, index


def search(
    files: dict[str, str], query: str, k: int = 5, chunk_lines: int = 40
) -> list[tuple[float, Chunk]]:
    """Top-k chunks of `files` ({path: text}) for `query`, best first; zero-score chunks dropped."""
    chunks, index = _index(files, chunk_lines)
    if not chunks:
        return []
    scores = index.scores(tokenize(query))
    scored = sorted(zip(scores, range(len(chunks)), strict=True), key=lambda x: (-x[0], x[1]))
    return [(s, chunks[i]) for s, i in scored[:k] if s > 0]
