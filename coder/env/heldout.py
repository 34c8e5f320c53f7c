"""The code of held-out tasks: what training data must not contain (coder.data.decontaminate).

A held-out task's repository is held out as a whole: every version of it the task's repository
holds (for a release task, the next release too: the reference the task asks the agent to
write), the task's own files, its hidden tests and its test patch. The stages index this text
and drop the pretraining and SFT documents that overlap it (`data.exclude_tasks`).
"""
from __future__ import annotations

from coder.env.sources import repo as repo_lib


def code_texts(tasks):
    """Yields the held-out text of `tasks` (Task): each repository once (repo.text_blobs: every
    file of every commit it holds), then each task's files, tests and test patch."""
    seen = set()
    for task in tasks:
        if task.repo and task.repo not in seen:
            seen.add(task.repo)
            yield from repo_lib.text_blobs(task.repo, task.commit)
        yield from task.files.values()
        yield from task.tests.values()
        if task.test_patch:
            yield task.test_patch
