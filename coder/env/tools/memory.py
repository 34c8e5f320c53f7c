"""Agent memory: notes an agent keeps across the trajectories of one repository (the
`memory_write` / `memory_read` tools).

What an agent learns about a codebase in one task (where the tests live, how to run them, a
module's quirks) is worth having in the next task of the same codebase, as a developer keeps
notes. The store is append-only: each note is one small JSON file, so concurrent rollouts in
different env workers (or Ray nodes) write without a lock and nothing a rollout writes can
erase another's note.

**Scope** (`Memory.scope(task)` -> a `Scope`): one run, one split (or session), one repository.
- Run: the store's root is a directory of the stage's run (`{stage_dir}/memory`), so a run never
  reads another run's notes.
- Split: `eval` for the held-out tasks the store was told of (`eval_ids`), `train` for every other
  task. Training rollouts therefore never see a note written while evaluating a held-out task,
  which would leak the held-out set into training; eval rollouts see only eval notes. A task
  that is both trained on and held out counts as held out everywhere: its training rollouts
  then write the eval split (the safe direction).
- Repository: `repository_key(task)`: a repository task's `metadata["repo"]` (SWE-bench's
  `owner/name`, the same on every machine) or else its `repo` location; a task without a
  repository (the toy sources, v1 JSONL tasks) uses its task source (`source:<task.source>`):
  those tasks are small variations on one family of problems, the closest thing they have to a
  shared codebase. Notes never cross repositories.
- Session: a task whose metadata names a session (`in_session(tasks, name)`, key `SESSION`)
  keeps its notes in that session's own store under its split, empty when the session starts,
  read by no rollout outside it (training's included) and reading nothing from outside it.
  Every agent eval runs in a session of its own (coder/rl/eval.py), so the eval before GRPO's
  first step, the one after its last and each of realtime's gate cycles start from the same,
  empty memory, and what one eval wrote is never read by the next.

**What a rollout reads** (`Scope.notes`): the notes that rollouts of *other* tasks of its scope
wrote before it started (its episode's reset opened the scope), and its own. Memory is for the
next task on a codebase (the seeds: a note stored now pays off in a later, other trajectory),
so a rollout never reads a note of its own task, neither a sibling's in its GRPO group nor an
earlier group's of the same task, and nothing written after it started: the G rollouts of a
group, opened together, read the same notes, and their rewards compare like with like. A note's
file name carries its time and its task's digest, so a read opens only the notes it may see.

**Caps**: at most `max_notes` notes per scope (a write beyond it is refused with an `error:`
the agent reads; a read returns the first `max_notes` in time order even if concurrent writers
overshot) and `max_chars` characters per note (env.memory_max_notes, env.memory_max_chars).

**Where**: any fsspec URL or local path (a run's directory may be `gs://...`); a scope's notes
are `{root}/{split}/[session-{name}/]{slug}-{hash}/{time_ns}-{task digest}-{random}.json`,
holding `{"text", "task_id", "time"}`. Env workers on other machines (env.workers_backend="ray") write there too, so a
cluster run's workdir must be a URL or file system every node reaches (as its checkpoints
already must). Serving does not use this store: a served conversation's tools run in the client.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time

import fsspec

SPLITS = ("train", "eval")
SESSION = "memory_session"  # the task metadata key naming the session a task's rollouts run in


def in_session(tasks, name: str) -> list:
    """Copies of `tasks` whose rollouts keep their notes in session `name` (module docstring,
    "Scope"): a fresh name gives an empty memory that nothing outside the session reads."""
    return [dataclasses.replace(t, metadata={**(t.metadata or {}), SESSION: str(name)}) for t in tasks]


def _slug(text: str, n: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[-n:]


def _digest(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def repository_key(task) -> str:
    """The repository a task's notes belong to (module docstring, "Scope")."""
    repo = str((getattr(task, "metadata", None) or {}).get("repo") or getattr(task, "repo", "") or "")
    return f"repo:{repo}" if repo else f"source:{getattr(task, 'source', '') or 'none'}"


@dataclasses.dataclass(frozen=True)
class Memory:
    """The notes of one run (`root`); picklable, so env workers build the same store."""

    root: str  # a local path or fsspec URL, e.g. {stage_dir}/memory
    eval_ids: frozenset = frozenset()  # ids of the held-out tasks: their split is "eval"
    max_notes: int = 64  # notes kept per scope
    max_chars: int = 2000  # characters per note

    def __post_init__(self):
        object.__setattr__(self, "eval_ids", frozenset(self.eval_ids))
        if int(self.max_notes) < 1:
            raise ValueError(f"env.memory_max_notes={self.max_notes}: at least 1")
        if int(self.max_chars) < 1:
            raise ValueError(f"env.memory_max_chars={self.max_chars}: at least 1")

    @classmethod
    def from_config(cls, env_cfg, root: str, eval_ids=()) -> "Memory":
        """The store of `config.env`'s caps under `root`."""
        return cls(root, frozenset(eval_ids), int(env_cfg.memory_max_notes), int(env_cfg.memory_max_chars))

    def split(self, task) -> str:
        return "eval" if task.id in self.eval_ids else "train"

    def scope(self, task) -> "Scope":
        """The notes a rollout of `task` starting now reads and writes (module docstring)."""
        key = repository_key(task)
        session = str((getattr(task, "metadata", None) or {}).get(SESSION) or "")
        parts = [self.root.rstrip("/"), self.split(task)]
        if session:
            parts.append(f"session-{_slug(session, 80)}-{_digest(session, 8)}")
        parts.append(f"{_slug(key)}-{_digest(key)}")  # readable; the digest is the key
        return Scope("/".join(parts), task.id, int(self.max_notes), int(self.max_chars))


@dataclasses.dataclass
class Scope:
    """One (run, split or session, repository)'s notes as one rollout sees them: opened at its
    start (`opened_ns`), by `task_id`'s rollout (module docstring, "What a rollout reads")."""

    path: str
    task_id: str
    max_notes: int
    max_chars: int
    opened_ns: int = dataclasses.field(default_factory=time.time_ns)
    written: list = dataclasses.field(default_factory=list)  # the file names of the notes this rollout wrote

    def _fs(self):
        return fsspec.core.url_to_fs(self.path)

    def _names(self, fs, path) -> list[str]:
        if not fs.exists(path):
            return []
        return sorted(p for p in fs.ls(path, detail=False) if p.endswith(".json"))

    def _visible(self, name: str) -> bool:
        """Its own note, or another task's written before this rollout started."""
        base = name.rsplit("/", 1)[-1]
        if base in self.written:
            return True
        written_ns, task, _ = base.split("-", 2)
        return int(written_ns) < self.opened_ns and task != _digest(self.task_id)

    def notes(self, query: str = "") -> list[str]:
        """The texts of the notes this rollout sees, in time order (the first `max_notes`), those
        containing `query` (case-insensitive) when given."""
        fs, path = self._fs()
        out = []
        for name in [n for n in self._names(fs, path) if self._visible(n)][: self.max_notes]:
            with fs.open(name, "r") as f:
                text = json.load(f)["text"]
            if query.lower() in text.lower():
                out.append(text)
        return out

    def write(self, text: str) -> str:
        """Appends a note; the tool's answer (an `error:` when refused)."""
        if not text.strip():
            return "error: the note is empty"
        if len(text) > self.max_chars:
            return f"error: the note has {len(text)} characters; at most {self.max_chars}"
        fs, path = self._fs()
        n = len(self._names(fs, path))
        if n >= self.max_notes:
            return f"error: memory is full ({n} notes, at most {self.max_notes}); nothing written"
        fs.makedirs(path, exist_ok=True)
        now = time.time_ns()
        name = f"{path}/{now:020d}-{_digest(self.task_id)}-{os.urandom(6).hex()}.json"
        with fs.open(name + ".tmp", "w") as f:  # readers list *.json only: never a half note
            json.dump({"text": text, "task_id": self.task_id, "time": now / 1e9}, f)
        fs.mv(name + ".tmp", name)
        self.written.append(name.rsplit("/", 1)[-1])
        return f"noted ({n + 1} of at most {self.max_notes} notes for this repository)"
