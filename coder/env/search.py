"""Code search over a workspace: chunking plus BM25 ranking (Okapi BM25, k1=1.2, b=0.75).

Files are cut into chunks of `chunk_lines` lines overlapping by half a chunk; Python files cut
preferably at top-level `def`/`class` lines so a chunk tends to hold whole functions. Tokens are
identifier parts: `parse_http_header` and `parseHttpHeader` both index as parse/http/header plus
the whole identifier, so a natural-language query matches code names.

No embedding model is used: none can be had offline here at a cost a rollout can afford; BM25 is
the ranking model (a `rank(query, chunks)` with another scorer can replace it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


@dataclasses.dataclass(frozen=True)
class Chunk:
    path: str
    start: int  # first line, 1-based
    end: int  # last line, inclusive
    text: str


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
    def __init__(self, docs: list[list[str]], k1: float = 1.2, b: float = 0.75):
        self.k1, self.b = k1, b
        self.tf = [Counter(d) for d in docs]
        self.len = [len(d) for d in docs]
        self.avg = sum(self.len) / max(len(docs), 1)
        df = Counter(t for d in self.tf for t in d)
        n = len(docs)
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


def search(
    files: dict[str, str], query: str, k: int = 5, chunk_lines: int = 40
) -> list[tuple[float, Chunk]]:
    """Top-k chunks of `files` ({path: text}) for `query`, best first; zero-score chunks dropped."""
    chunks = [c for path in sorted(files) for c in chunk_file(path, files[path], chunk_lines)]
    if not chunks:
        return []
    index = BM25([tokenize(c.path + "\n" + c.text) for c in chunks])
    scores = index.scores(tokenize(query))
    scored = sorted(zip(scores, range(len(chunks)), strict=True), key=lambda x: (-x[0], x[1]))
    return [(s, chunks[i]) for s, i in scored[:k] if s > 0]
