"""Coding environment: sandboxed workspaces, agent tools, tasks and test-based rewards.

Plain Python (no JAX). Four rooms, and what is built on them:
- runtime/: where commands run: sandbox (bubblewrap workspaces), terminal (a shell session),
  images (OCI layouts as read-only roots), environments (a task's Python venv), prepared
  (starting trees built once), installed (what an installation's modules are), build_once.
- tools/: what the agent can call: registry (the tools, their specs and how each runs),
  search (BM25), semantic_search, diagnostics (mypy and jedi; jedi_query runs in the sandbox),
  memory (notes kept across a repository's trajectories).
- scoring/: what a rollout earned: score (the workspace's hidden tests run, hardened), runners
  (each test runner's report format), grading (SWE-bench's resolution rule), verdicts (one run
  per distinct workspace).
- sources/: where tasks come from: swebench, r2egym, harbor, releases (with pypi), mutate and
  package_mutants (generated bug fixes), repo (a repository's tree at a commit), verify.
On top: tasks (Task JSONL, toy tasks), protocol (tool-call text), episode (one rollout), pool
and ray_pool (parallel workers), transcripts (SFT data), heldout, suite, and the CLIs check and
make_tasks.
"""

from coder.env.episode import Episode
from coder.env.runtime.sandbox import InfraError, Limits, Result, Sandbox, SandboxError, Snapshot
from coder.env.tasks import Task, read_tasks, toy_tasks, write_tasks

__all__ = [
    "Episode",
    "InfraError",
    "Limits",
    "Result",
    "Sandbox",
    "SandboxError",
    "Snapshot",
    "Task",
    "read_tasks",
    "toy_tasks",
    "write_tasks",
]
