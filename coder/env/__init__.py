"""Coding environment: sandboxed workspaces, agent tools, tasks and test-based rewards.

Plain Python (no JAX). Modules: sandbox (bubblewrap workspaces), protocol (tool-call text),
tools, diagnostics (mypy and jedi for the diagnostics tool), search (BM25), episode (one
rollout), reward (hardened scoring), tasks (Task JSONL, toy tasks), mutate (stdlib bug-fix
generator), transcripts (SFT data), pool (parallel workers), ray_pool (the same workers as Ray
actors), check / make_tasks (CLIs).
"""

from coder.env.episode import Episode
from coder.env.sandbox import InfraError, Limits, Result, Sandbox, SandboxError, Snapshot
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
