"""The long-context eval: loss by position on held-out repository documents, and far retrieval.

Two measures of whether a model uses a long context, both on the held-out repositories of
config.data.repos (coder.data.repo_docs; the training stages never see them):

- **Loss by position bucket.** Rows of `length` tokens cut from the held-out repository
  documents (consecutive windows, each starting at position 0), the targets grouped into
  `buckets` equal ranges of position: `long/loss_{a}_{b}` is the mean next-token loss of the
  targets at positions [a, b), i.e. with a to b tokens of context before them. A model that uses
  its context has a falling curve; one that does not, a flat one. `long/loss_far` is the last
  bucket's (the long length, the figure the longctx stage must lower).
- **Far retrieval from code.** For a held-out function T whose body calls top-level functions
  defined before it in its repository (in an earlier file, or above it in its own: its callees),
  a row of `length` tokens
      [bos] callees' definitions | filler (other files of the repository) | T's header | T's body
  and its control, where the callees' definitions are replaced by as many tokens of other code:
      [bos] other code            | the same filler                       | T's header | T's body
  Both score the next-token loss on T's body only, at the same positions. `long/retrieval_with`
  and `long/retrieval_without` are those losses, `long/retrieval_gain` = without - with: the nats
  per body token the far definitions are worth (> 0: the model retrieves from far back). The
  callees' definitions end at least a quarter of the row before T's header.

`long_context_eval(...)` scores both through any `score(batch) -> (ce sum, target count)` of
the caller (the trainer's eval step, or the eval stage's jitted forward), in batches of `rows`
global rows of which this process feeds its `shard` (coder.model.sharding.data_shard).
"""
from __future__ import annotations

import ast

import numpy as np

from coder.data import repo_docs

_BODY_MAX = 8  # T's body is cut at length / _BODY_MAX tokens
_FAR_MAX = 4  # the callees' definitions, and T's header, at most length / _FAR_MAX tokens each


def position_rows(documents: list[np.ndarray], length: int, max_rows: int) -> np.ndarray:
    """Windows of `length` tokens from `documents` (token arrays), round-robin over documents,
    each document cut into consecutive non-overlapping windows (a partial tail is dropped).
    Returns int32 `[n, length]`, n <= max_rows."""
    windows = [[d[i : i + length] for i in range(0, len(d) - length + 1, length)] for d in documents]
    out = []
    for k in range(max(map(len, windows), default=0)):
        out += [w[k] for w in windows if k < len(w)]
    return np.asarray(out[:max_rows], np.int32).reshape(-1, length)


def _functions(text: str) -> tuple[list, list]:
    """(top-level functions, those plus the methods of top-level classes) of a file's source."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return [], []
    fn_types = (ast.FunctionDef, ast.AsyncFunctionDef)
    top = [n for n in tree.body if isinstance(n, fn_types)]
    methods = [m for n in tree.body if isinstance(n, ast.ClassDef) for m in n.body if isinstance(m, fn_types)]
    return top, sorted(top + methods, key=lambda n: n.lineno)


def _called_names(fn) -> set[str]:
    """Names T calls as `f(...)` or `module.f(...)` (not `self.f(...)`: a method)."""
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                out.add(node.func.id)
            elif (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                  and node.func.value.id not in ("self", "cls")):
                out.add(node.func.attr)
    return out


def _start(fn) -> int:
    """The first line of a definition, its decorators included."""
    return min([fn.lineno] + [d.lineno for d in fn.decorator_list])


def _lines(text: str, first: int, last: int) -> str:
    """Lines first..last (1-based, inclusive) of text, newline-terminated."""
    return "".join(text.splitlines(keepends=True)[first - 1 : last]).rstrip("\n") + "\n"


def retrieval_candidates(files: dict[str, str], order: list[str]):
    """(T's path, header text, body text, [(callee path, callee source)]) for every function or
    method of a top-level class whose body calls a top-level function defined before it: in a
    file earlier in `order`, or above it in its own file; in dependency order, then line order.
    The header is T's decorators, signature and docstring; the body is the statements after
    them (their indentation kept)."""
    defined: dict[str, tuple[str, str]] = {}  # function name -> (path, source), earlier files
    out = []
    for path in order:
        text = files[path]
        top, fns = _functions(text)
        source = {t.name: (path, _lines(text, _start(t), t.end_lineno)) for t in top}
        for fn in fns:
            above = {**defined, **{t.name: source[t.name] for t in top if t.end_lineno < fn.lineno}}
            first = fn.body[0]
            docstring = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                         and isinstance(first.value.value, str))
            body = fn.body[1:] if docstring else fn.body
            callees = sorted(n for n in _called_names(fn) if n in above and n != fn.name)
            if not body or not callees or body[0].lineno <= fn.lineno:  # one-line defs: no header
                continue
            header = _lines(text, _start(fn), body[0].lineno - 1)
            out.append((path, header, _lines(text, body[0].lineno, fn.end_lineno),
                        [above[n] for n in callees]))
        for name, item in source.items():
            defined.setdefault(name, item)
    return out


def retrieval_rows(files: dict[str, str], tokenizer, length: int, max_examples: int):
    """Rows for the far-retrieval measure of one repository (see the module docstring).

    Returns (with_far, without_far, body_mask), int32 / int32 / float32 `[n, length]`,
    n <= max_examples: candidates taken evenly over the repository. The far part holds the
    callees' definitions, smallest first, while they fit in length / 4 tokens (a candidate none
    of whose callees fits is skipped); the body is cut at length / 8 tokens; a candidate whose
    header passes length / 4 tokens, or whose repository's other files cannot fill the row, is
    skipped. The filler comes from the files holding neither T nor a callee shown.
    """
    order = repo_docs.dependency_order(files)
    header = repo_docs.FILE_HEADER
    rows_with, rows_without, masks = [], [], []
    candidates = retrieval_candidates(files, order)
    encoded: dict[str, list[int]] = {}  # each file's tokens with its header, encoded once

    def pool_of(paths, needed):
        out = []
        for p in paths:
            if len(out) >= needed:
                break
            if p not in encoded:
                encoded[p] = tokenizer.encode(repo_docs.repository_text(files, [p]))
            out += encoded[p]
        return out

    picks = np.unique(np.linspace(0, len(candidates) - 1, min(len(candidates), 4 * max_examples)).round())
    for i in picks.astype(int) if candidates else []:
        path, head, body, callees = candidates[i]
        shown, far = [], []
        for p, src in sorted(callees, key=lambda c: (len(c[1]), c)):
            ids = tokenizer.encode(header.format(path=p) + src)
            if len(far) + len(ids) <= length // _FAR_MAX and (p, src) not in shown:
                shown.append((p, src))
                far += ids
        near = tokenizer.encode(header.format(path=path) + head)
        body_ids = tokenizer.encode(body)[: length // _BODY_MAX]
        if not far or len(near) > length // _FAR_MAX or len(body_ids) < 4:
            continue
        used = {path} | {p for p, _ in shown}
        filler_n = length - 1 - len(far) - len(near) - len(body_ids)
        pool = pool_of([p for p in order if p not in used], len(far) + filler_n)
        if len(pool) < len(far) + filler_n:
            continue
        filler = pool[len(far) : len(far) + filler_n]
        tail = filler + near + body_ids
        rows_with.append([tokenizer.bos_id] + far + tail)
        rows_without.append([tokenizer.bos_id] + pool[: len(far)] + tail)
        mask = np.zeros(length, np.float32)
        mask[length - len(body_ids) :] = 1.0
        masks.append(mask)
        if len(masks) == max_examples:
            break
    shape = (-1, length)
    return (np.asarray(rows_with, np.int32).reshape(shape), np.asarray(rows_without, np.int32).reshape(shape),
            np.asarray(masks, np.float32).reshape(shape))


def _batches(tokens: np.ndarray, masks: np.ndarray, rows: int, shard: tuple[int, int]):
    """Global batches of `rows` rows (the last padded with empty rows), this process's slice."""
    index, count = shard
    n, length = tokens.shape
    for s in range(0, n, rows):
        t = np.zeros((rows, length), np.int32)
        m = np.zeros((rows, length), np.float32)
        k = min(rows, n - s)
        t[:k], m[:k] = tokens[s : s + k], masks[s : s + k]
        seg = np.zeros((rows, length), np.int32)
        seg[:k] = 1
        batch = {"tokens": t, "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
                 "segment_ids": seg, "loss_mask": m}
        per = rows // count
        yield {k_: v[index * per : (index + 1) * per] for k_, v in batch.items()}


def _mean_loss(score, tokens, masks, rows, shard) -> float:
    total = weight = 0.0
    for batch in _batches(tokens, masks, rows, shard):
        s, w = score(batch)
        total, weight = total + float(s), weight + float(w)
    return total / weight if weight else float("nan")


def build(repositories: list[dict[str, str]], tokenizer, length: int, max_rows: int,
          max_examples: int) -> dict:
    """The eval's rows from held-out repositories ({path: text} each): {"windows" `[n, length]`,
    "with", "without", "body_mask" `[m, length]`}. Built once, so a stage scores the same rows
    before and after training."""
    docs = []
    for files in repositories:
        text = repo_docs.repository_text(files, repo_docs.dependency_order(files))
        docs.append(np.asarray([tokenizer.bos_id] + tokenizer.encode(text), np.int32))
    out = {"windows": position_rows(docs, length, max_rows)}
    parts = [retrieval_rows(files, tokenizer, length, max_examples) for files in repositories]
    for k, key in enumerate(("with", "without", "body_mask")):
        dtype = np.float32 if key == "body_mask" else np.int32
        out[key] = np.concatenate([p[k] for p in parts] + [np.zeros((0, length), dtype)])[:max_examples]
    return out


def long_context_eval(rows_of: dict, score, buckets: int, rows: int, shard: tuple[int, int] = (0, 1)) -> dict:
    """Scores `rows_of` (build's) with `score(batch) -> (ce sum, targets)`; see the module
    docstring for the keys. `rows`: global rows per batch (divisible by shard[1])."""
    windows = rows_of["windows"]
    out = {}
    if len(windows):
        length = windows.shape[1]
        edges = np.linspace(0, length, buckets + 1).round().astype(int)
        pos = np.arange(length)
        for a, b in zip(edges[:-1], edges[1:]):
            mask = np.broadcast_to(((pos >= a) & (pos < b)).astype(np.float32), windows.shape)
            out[f"long/loss_{a}_{b}"] = _mean_loss(score, windows, mask, rows, shard)
        out["long/loss_far"] = out[f"long/loss_{edges[-2]}_{edges[-1]}"]
        out["long/windows"] = int(len(windows))
    if len(rows_of["with"]):
        with_far = _mean_loss(score, rows_of["with"], rows_of["body_mask"], rows, shard)
        without = _mean_loss(score, rows_of["without"], rows_of["body_mask"], rows, shard)
        out.update({"long/retrieval_with": with_far, "long/retrieval_without": without,
                    "long/retrieval_gain": without - with_far,
                    "long/retrieval_examples": int(len(rows_of["with"]))})
    return out
