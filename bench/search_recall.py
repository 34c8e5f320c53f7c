"""Semantic search against BM25 on generated repository tasks, measured side by side in one run.

    python bench/search_recall.py --checkpoint runs/quickstart/sft/checkpoints
        [--tasks T.jsonl | --n 40 --seed 0] [--encoders bm25,policy,wordllama] [--out R.json]

The repository is CPython's standard library as installed (every top-level `Lib/*.py`, ~170
files, ~4.7 MB); the tasks are coder.env.sources.mutate's verified bug-fix tasks over it (generated in
the sandbox, or read from `--tasks`); the file each task's reference patch changes is its module
`M.py`. Each task asks up to three queries:
- **as generated**: the task's prompt, which names the module and the function (`make_tasks`);
- **failing test**: only the failing test's id the prompt names (`TestClass.test_method fails`),
  the module's name removed from it: a report of what fails, not of where;
- **behaviour**: the first sentence of the broken function's docstring with the function's,
  module's and class's names removed: what the code does in words, not in names. The sentence
  is the docstring's own, in the indexed chunk: a favourable case for word overlap (BM25), as a
  user who quotes the docs; tasks whose function has no docstring skip it.
Rankers: `bm25` (coder.env.tools.search, the `search` tool), `policy` (coder.env.tools.semantic_search with
the `--checkpoint`'s trunk, the `semantic_search` tool's default), `wordllama` (an installed
encoder, if `pip install wordllama` was run: 256-d static token embeddings, weights in the wheel).

Figures per ranker and query form:
- recall@5 / @10: the changed file is among the files of the top 5 / 10 chunks;
- tokens read before the first edit, by a scripted reader (not a model): it makes one search
  (k=10, the tool's output as the agent sees it, capped at env.max_output_chars) and reads the
  hits in rank order until the first chunk of the changed file, where it edits; the count is
  the tokens (the checkpoint's tokenizer) of what it read up to and including that chunk. A miss
  reads the whole output and has not found the file: `tokens_hit` averages over hits only,
  `tokens_all` charges every miss the whole output (a lower bound: the agent still has to look).
Also: the index build time per encoder (the repository embedded once; the table cached as the
tool caches it) and the query time.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coder.env.tools import search as search_lib  # noqa: E402
from coder.env.tools import semantic_search as sem  # noqa: E402
from coder.env.tools import registry as tools  # noqa: E402
from coder.env.tasks import Task, read_tasks, write_tasks  # noqa: E402
from coder.infer import embedding  # noqa: E402


FORMS = ("as generated", "failing test", "behaviour")


class WordLlamaEncoder:
    """wordllama's bundled 256-d model (`bench.search_recall:WordLlamaEncoder` as an
    env.semantic_encoder). The wheel ships its tokenizer under `tokenizers/`, which is also the
    layout of its cache directory: pointing the cache at the package keeps it offline."""

    name = "wordllama-l2_supercat-256"

    def __init__(self):
        from pathlib import Path

        import wordllama

        self.model = wordllama.WordLlama.load(cache_dir=Path(wordllama.__file__).parent, disable_download=True)

    def encode(self, texts):
        return np.asarray(self.model.embed(list(texts), norm=True), np.float32)


def repository() -> dict[str, str]:
    """{`M.py`: text} of the installed standard library's top-level modules."""
    from coder.env.sources import mutate

    out = {}
    for name in sorted(os.listdir(mutate.STDLIB)):
        if name.endswith(".py"):
            with open(os.path.join(mutate.STDLIB, name), encoding="utf-8", errors="replace") as f:
                out[name] = f.read()
    return out


def tasks_of(args) -> list[Task]:
    if args.tasks and os.path.exists(args.tasks):
        return read_tasks(args.tasks)
    from coder.env.sources import mutate

    t0 = time.perf_counter()
    out = []
    for split in ("train", "heldout"):  # every module of the library, one task each
        out += [t for t, _ in mutate.stdlib_tasks(args.n - len(out), args.seed, split=split, max_per_module=1)]
        if len(out) >= args.n:
            break
    print(f"generated {len(out)} tasks in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.tasks:
        write_tasks(args.tasks, out)
    return out


_FUNC = re.compile(r"`([\w.]+)`|Bug: \w+\.([\w.]+) returns")
_TEST = re.compile(r"; (\S+) now fails|regression test (\S+) fails|e\.g\. (\S+)\)\.")


def failing_test_query(task: Task) -> str | None:
    """The failing test's id the prompt names, the module's name removed from it, + " fails"."""
    m = _TEST.search(task.prompt)
    if m is None:
        return None
    (path,) = [p for p in task.files if not p.startswith("test_")]
    test = re.sub(re.escape(path[:-3]), "", next(g for g in m.groups() if g), flags=re.IGNORECASE)
    return f"{test} fails"


def behaviour_query(task: Task, files: dict[str, str]) -> str | None:
    """The broken function's docstring's first sentence, names removed (None: no docstring)."""
    (path,) = [p for p in task.files if not p.startswith("test_")]
    m = _FUNC.search(task.prompt)
    if m is None or path not in files:
        return None
    func = (m.group(1) or m.group(2)).split(".")[-1]
    tree = ast.parse(files[path])
    owners = {c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
              if any(getattr(n, "name", "") == func for n in c.body)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func:
            doc = ast.get_docstring(node)
            if not doc:
                return None
            first = re.split(r"(?<=\.)\s|\n\s*\n", doc.strip(), maxsplit=1)[0]
            for name in {func, path[:-3], *owners}:
                first = re.sub(rf"\b{re.escape(name)}\b", "it", first)
            words = first.split()
            return " ".join(words) if len(words) >= 3 else None
    return None


def reader_tokens(hits, target: str, count, max_chars: int) -> tuple[bool, int]:
    """(found, tokens read) of the scripted reader over one search's hits (module docstring)."""
    blocks = [f"{c.path}:{c.start}-{c.end} (score {s:.2f})\n{c.text}" for s, c in hits]
    for i, (_, c) in enumerate(hits):
        if c.path == target:
            return True, count(tools.cap("\n\n".join(blocks[:i + 1]), max_chars))
    return False, count(tools.cap("\n\n".join(blocks), max_chars))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="runs/quickstart/sft/checkpoints",
                   help="coder checkpoint: the policy encoder's trunk and the token counter")
    p.add_argument("--tasks", default="", help="JSONL of stdlib tasks (written here when missing)")
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--encoders", default="bm25,policy,wordllama")
    p.add_argument("--max_output_chars", type=int, default=8000)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)

    files = repository()
    tasks = tasks_of(args)
    # the tool's spec and cache (a rerun reuses the tables)
    spec = sem.SemanticSpec(embedding.POLICY, (("checkpoint", args.checkpoint),))
    policy = sem.encoder_of(spec)  # also the token counter: the tokens the policy would read
    count = lambda s: len(policy.tokenizer.encode(s, allow_special=False))  # noqa: E731
    snapshot = Task(id="stdlib", prompt="", files=files, tests={})  # one snapshot: one table
    queries = []
    for t in tasks:
        (target,) = [p for p in t.files if not p.startswith("test_")]
        queries.append(("as generated", t.prompt, target))
        f = failing_test_query(t)
        if f:
            queries.append(("failing test", f, target))
        b = behaviour_query(t, files)
        if b:
            queries.append(("behaviour", b, target))
    print(f"{len(files)} files, {sum(len(x) for x in files.values()) / 1e6:.1f} MB; {len(tasks)} tasks, "
          + ", ".join(f"{sum(q[0] == f for q in queries)} {f}" for f in FORMS) + " queries", flush=True)

    rankers = {}
    for name in args.encoders.split(","):
        if name == "bm25":
            rankers[name] = lambda q: search_lib.search(files, q, k=10)
            continue
        if name == "wordllama":
            try:
                enc = WordLlamaEncoder()
            except ImportError:
                print("wordllama is not installed: skipped (pip install wordllama)")
                continue
        elif name == "policy":
            enc = policy
        else:
            raise SystemExit(f"unknown encoder {name!r}")
        t0 = time.perf_counter()
        sem.search(spec, snapshot, files, "warm up", k=1, encoder=enc)  # builds the table once
        build = time.perf_counter() - t0
        chunks = sum(len(sem.chunk_definitions(p, text, spec.max_lines)) for p, text in files.items())
        print(f"{name}: {chunks} chunks embedded (or read from the cache) in {build:.1f} s", flush=True)
        rankers[name] = (lambda e: lambda q: sem.search(spec, snapshot, files, q, k=10, encoder=e))(enc)
        rankers[name].build_s = build

    results = {}
    for name, rank in rankers.items():
        for form in FORMS:
            qs = [q for q in queries if q[0] == form]
            r5 = r10 = 0
            hit_tokens, all_tokens, times = [], [], []
            for _, text, target in qs:
                t0 = time.perf_counter()
                hits = rank(text)
                times.append(time.perf_counter() - t0)
                paths = [c.path for _, c in hits]
                r5 += target in paths[:5]
                r10 += target in paths[:10]
                found, n = reader_tokens(hits, target, count, args.max_output_chars)
                all_tokens.append(n)
                if found:
                    hit_tokens.append(n)
            row = dict(queries=len(qs), recall_at_5=r5 / max(len(qs), 1), recall_at_10=r10 / max(len(qs), 1),
                       tokens_hit=statistics.mean(hit_tokens) if hit_tokens else None,
                       tokens_all=statistics.mean(all_tokens) if all_tokens else None,
                       query_ms=1000 * statistics.median(times) if times else None,
                       build_s=getattr(rank, "build_s", 0.0))
            results[f"{name} / {form}"] = row
            print(f"{name:10s} {form:13s} n={row['queries']:3d}  recall@5 {row['recall_at_5']:.3f}  "
                  f"recall@10 {row['recall_at_10']:.3f}  tokens read (hits) "
                  f"{row['tokens_hit'] or float('nan'):7.0f}  (all, misses charged) {row['tokens_all'] or float('nan'):7.0f}  "
                  f"query {row['query_ms'] or float('nan'):.0f} ms", flush=True)
    summary = dict(checkpoint=args.checkpoint, tasks=len(tasks), files=len(files), results=results)
    print("SUMMARY " + json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
