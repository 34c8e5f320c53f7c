"""Held-out code kept out of training data: word n-gram overlap with an index of held-out text.

An agent eval on held-out repositories measures nothing if pretraining or SFT saw those
repositories' code (or the next release a feature task asks for). The stages build an
`NgramIndex` from the held-out tasks' code (`coder.env.heldout.code_texts`: every version of each
held-out repository, the hidden tests) and the data pipelines drop each training document that
shares at least `min_matches` distinct word n-grams with it, counting the drops
(`data/heldout_dropped`).

The test is the one GPT-3 and its successors used for benchmark contamination: n consecutive
whitespace-separated words (n = 13 by default), compared exactly. For code, 13 words are about
two lines, so one shared idiom (`if __name__ == "__main__":`) matches nothing, and the default
of 20 distinct shared n-grams is a run of about 32 words: a few lines copied from held-out code.
What the test cannot tell apart is text the held-out code shares with unrelated code: a license
header (~150 words) common to a held-out package and a training document drops that document.
That errs on the side this check exists for; the drop counter shows how much it costs.

Hashes are 64-bit and deterministic (blake2b of each word, then a polynomial over the n words
mod 2^64), so an index built in one process is valid in grain's worker processes; with 10^7
indexed n-grams and 10^9 queried the expected number of false matches is ~5e-4.
"""
from __future__ import annotations

import hashlib
import re

import numpy as np

NGRAM = 13
MIN_MATCHES = 20
_WORD = re.compile(r"\S+")
_BASE = np.uint64(1_000_003)


def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def ngram_hashes(text: str, n: int = NGRAM, cache: dict | None = None) -> np.ndarray:
    """uint64 [len(words) - n + 1]: the hash of each run of n consecutive words of `text` (empty
    when it has fewer than n words). `cache` ({word: hash}) saves rehashing repeated words."""
    words = _WORD.findall(text)
    if len(words) < n:
        return np.zeros(0, np.uint64)
    cache = {} if cache is None else cache
    h = np.fromiter((cache[w] if w in cache else cache.setdefault(w, _word_hash(w)) for w in words),
                    np.uint64, len(words))
    m = len(words) - n + 1
    out = np.zeros(m, np.uint64)
    with np.errstate(over="ignore"):  # mod 2^64 is the point
        for j in range(n):
            out = out * _BASE + h[j : j + m]
    return out


class NgramIndex:
    """A sorted set of n-gram hashes (`hashes` uint64 [size]) and the rule that a text shares
    `min_matches` of them. Picklable (grain workers get a copy)."""

    def __init__(self, hashes: np.ndarray, n: int = NGRAM, min_matches: int = MIN_MATCHES):
        if n < 1 or min_matches < 1:
            raise ValueError(f"n-gram index: n={n} and min_matches={min_matches} must be >= 1")
        self.hashes = np.unique(np.asarray(hashes, np.uint64))
        self.n, self.min_matches = int(n), int(min_matches)

    @classmethod
    def from_texts(cls, texts, n: int = NGRAM, min_matches: int = MIN_MATCHES) -> "NgramIndex":
        cache: dict = {}
        parts = [ngram_hashes(t, n, cache) for t in texts]
        return cls(np.concatenate(parts) if parts else np.zeros(0, np.uint64), n, min_matches)

    def __len__(self) -> int:
        return len(self.hashes)

    def matches(self, text: str) -> int:
        """Distinct n-grams of `text` found in the index."""
        if not len(self.hashes):
            return 0
        q = np.unique(ngram_hashes(text, self.n))
        at = np.searchsorted(self.hashes, q).clip(max=len(self.hashes) - 1)
        return int(np.count_nonzero(self.hashes[at] == q))

    def contaminated(self, text: str) -> bool:
        """Whether `text` shares at least min_matches distinct n-grams with the held-out text."""
        return self.matches(text) >= self.min_matches
