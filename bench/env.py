"""Coding-environment performance, measured side by side in one run.

    python bench/env.py [--episodes 16] [--reps 30]

1. per-command latency: `bash -c true` and `python -c pass` in a plain subprocess vs in the
   sandbox (bwrap + setpriv + prlimit), and the ratio;
2. snapshot / restore time of a toy, a stdlib-task-sized and a 2 MB many-file workspace;
3. a rollout's sandbox start and reset (p50 / p99 ms) for a toy, a stdlib-sized and a
   repository-sized workspace: built from the task (every file written) against forked from one
   prepared tree (coder.env.runtime.prepared: overlayfs copy-on-write where the host allows it), and the
   bytes each rollout's workspace adds on disk;
4. episodes/s of the pool with 1, 2 and 4 workers (toy tasks, scripted fix + submit + scoring).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coder.env.sources import mutate  # noqa: E402
from coder.env.pool import EpisodePool  # noqa: E402
from coder.env.runtime.prepared import PreparedWorkspaces  # noqa: E402
from coder.env.protocol import render_tool_call  # noqa: E402
from coder.env.runtime.sandbox import Sandbox, Snapshot  # noqa: E402
from coder.env.tasks import Task, toy_tasks  # noqa: E402


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def latency(reps: int) -> None:
    print("== per-command latency (median ms)")
    with Sandbox() as sb:
        for label, argv in (
            ("bash -c true", ["/bin/bash", "-c", "true"]),
            ("python -c pass", [sys.executable, "-c", "pass"]),
        ):
            inner = "true" if argv[0] == "/bin/bash" else "python -c pass"
            plain = _median_ms(
                lambda a=argv: subprocess.run(a, capture_output=True, check=False), reps
            )
            boxed = _median_ms(lambda c=inner: sb.run(c), reps)
            print(
                f"{label:16s} plain {plain:7.2f}  sandbox {boxed:7.2f}  ratio {boxed / plain:5.2f}x  "
                f"overhead {boxed - plain:+.2f} ms"
            )


def snapshots(reps: int) -> None:
    print(
        "== snapshot / restore (median ms): restore after a rollout edited one file, and "
        "into an empty workspace"
    )
    mod, test = mutate.module_files("argparse")
    cases = {
        "toy (2 files)": toy_tasks(1, 0)[0][0].files,
        "stdlib argparse (2 files)": {"argparse.py": mod, "test_argparse.py": test},
        "200 files x 10 KB": {f"pkg{i % 10}/m{i}.py": ("x = 1\n" * 1700) for i in range(200)},
    }
    for label, files in cases.items():
        with Sandbox(Task("b", "", files, {})) as sb:
            snap = sb.snapshot()
            empty = Snapshot((), (), ())
            first = sorted(files)[0]
            s = _median_ms(sb.snapshot, reps)

            def edited(snap=snap, first=first, sb=sb):
                sb.write(first, "changed\n")
                t0 = time.perf_counter()
                sb.restore(snap)
                return time.perf_counter() - t0

            def fresh(snap=snap, empty=empty, sb=sb):
                sb.restore(empty)
                t0 = time.perf_counter()
                sb.restore(snap)
                return time.perf_counter() - t0

            r_edit = 1000 * statistics.median(edited() for _ in range(reps))
            r_fresh = 1000 * statistics.median(fresh() for _ in range(reps))
            print(
                f"{label:28s} {snap.nbytes / 1e6:6.2f} MB  snapshot {s:7.2f}  "
                f"restore-after-edit {r_edit:7.2f}  restore-fresh {r_fresh:7.2f}"
            )


def _percentiles_ms(times: list[float]) -> str:
    q = statistics.quantiles(times, n=100, method="inclusive")
    return f"p50 {1000 * q[49]:7.2f}  p99 {1000 * q[98]:7.2f}"


def _disk_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(dirpath, f)).st_blocks * 512 for f in files)
    return total


def rollout_start(reps: int) -> None:
    print(
        "== rollout start / reset (ms): from the task (files written) vs forked from one "
        "prepared tree; bytes on disk per rollout"
    )
    mod, test = mutate.module_files("argparse")
    cases = {
        "toy (2 files)": toy_tasks(1, 0)[0][0].files,
        "stdlib argparse (2 files)": {"argparse.py": mod, "test_argparse.py": test},
        "repository (2000 x 10 KB)": {
            f"pkg{i % 40}/m{i}.py": ("x = 1\n" * 1700) for i in range(2000)
        },
    }
    cache = PreparedWorkspaces()
    try:
        for label, files in cases.items():
            task = Task("b", "", files, {})
            base = cache.get(task)
            plain, forked, resets, plain_bytes, fork_bytes = [], [], [], 0, 0
            for _ in range(reps):
                t0 = time.perf_counter()
                with Sandbox(task) as sb:
                    plain.append(time.perf_counter() - t0)
                    plain_bytes = _disk_bytes(sb.workspace)
                t0 = time.perf_counter()
                with Sandbox(task, base=base) as sb:
                    forked.append(time.perf_counter() - t0)
                    cow = sb.copy_on_write
                    fork_bytes = _disk_bytes(os.path.join(sb.dir, "upper" if cow else "ws"))
                    sb.write(sorted(files)[0], "changed\n")
                    t0 = time.perf_counter()
                    sb.reset()
                    resets.append(time.perf_counter() - t0)
            print(
                f"{label:28s} from task {_percentiles_ms(plain)} ({plain_bytes / 1e6:6.2f} MB)"
                f" | forked{' (overlay)' if cow else ' (copy)'} {_percentiles_ms(forked)} "
                f"({fork_bytes / 1e6:6.3f} MB) | reset {_percentiles_ms(resets)}"
            )
    finally:
        cache.close()


def _episode_texts(solution: dict) -> list[str]:
    return [
        render_tool_call("write_file", {"path": "answer.py", "content": solution["answer.py"]}),
        render_tool_call("submit", {}),
    ]


def pool_throughput(n_episodes: int) -> None:
    print(f"== pool: {n_episodes} toy episodes (write fix, submit, score)")
    pairs = (toy_tasks(45, 0) * (n_episodes // 45 + 1))[:n_episodes]
    base = None
    for workers in (1, 2, 4):
        with EpisodePool(workers, token_count=len) as pool:
            pool.map(len, ["warm"] * workers)  # workers started and imported
            t0 = time.perf_counter()
            pool.reset([(i, t, None) for i, (t, _) in enumerate(pairs)])
            texts = [_episode_texts(s) for _, s in pairs]
            rewards = []
            for turn in range(2):
                outs = pool.step([(i, texts[i][turn]) for i in range(len(pairs))])
                rewards += [o[2]["reward"] for o in outs if o[1]]
            dt = time.perf_counter() - t0
        assert rewards == [1.0] * len(pairs), rewards
        rate = len(pairs) / dt
        base = base or rate
        print(
            f"workers {workers}: {rate:6.2f} episodes/s  ({dt:5.1f} s)  speed-up {rate / base:4.2f}x"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    print(f"cpus: {os.cpu_count()}  load average: {os.getloadavg()[0]:.1f}")
    latency(args.reps)
    snapshots(max(5, args.reps // 3))
    rollout_start(max(10, args.reps))
    pool_throughput(args.episodes)


if __name__ == "__main__":
    main()
