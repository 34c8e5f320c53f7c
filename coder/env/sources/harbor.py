"""Harbor task directories -> task format v2 (`python -m coder.env.make_tasks --source harbor
DIR... --images LAYOUTS --repos DIR --out T.jsonl [--solutions S.jsonl] [--verify]`).

Harbor (github.com/laude-institute/harbor, now harbor-framework/harbor: Terminal-Bench 2.0's
harness, and the form SWE-bench Pro V2 ships in) keeps one task per directory; the fields read
here were checked against its `TaskConfig`, `Task`, `EnvironmentPaths` and `Verifier` as public
forks of it hold them (2026-11; the upstream repository itself was not at hand):
- `instruction.md` -> the prompt (leading canary comment lines dropped, as Harbor does);
- `task.toml` -> `[task].name` (else the directory's name) the id; `[metadata]` (difficulty,
  category, tags, ...), `[verifier].timeout_sec`, `[agent].timeout_sec` and `[environment]`
  (`docker_image`, `cpus`, `memory_mb`, `allow_internet`, ...) the metadata. A file that is not
  TOML, or a key of the wrong type, is refused naming the file and the key;
- `environment/` -> only a prebuilt image is imported: `[environment].docker_image`, read from
  an OCI layout the user copied beside the others, `skopeo copy docker://NAME
  oci:LAYOUTS/<name>:<tag>` (`layout_of`: the name with `/` and `:` made `_`; the tag, or
  `latest`). A Dockerfile-only environment is skipped with that reason (coder builds no
  Dockerfiles), and so is a `docker-compose.yaml` one (several containers) or a missing layout
  (the skip names the skopeo command);
- `tests/` -> hidden tests, written at `.harbor/tests/` only at scoring; `tests/test.sh` is the
  verifier (required);
- `solution/` -> `solution/solve.sh`, the reference (Harbor's oracle agent runs it).

What coder runs, and how it differs from Harbor's container. The sandbox puts the image's root
filesystem read-only at `/` and the task's workspace, writable, at `/workspace`; commands run
as an unprivileged user with no network (coder.env.runtime.sandbox). So:
- the workspace is the image's working directory (its `WorkingDir`, say `/app`), committed as a
  one-commit repository `REPOS/harbor__<id>` (the task's `repo` / `commit`); an image whose
  working directory is `/` is skipped;
- the instruction, the tests and the solution name Harbor's paths; each text is rewritten, path
  by path (`rewrite`): the working directory -> `/workspace`, `/tests` ->
  `/workspace/.harbor/tests`, `/solution` -> `/workspace/.harbor/solution`, `/logs` ->
  `/tmp/.harbor-logs` (the sandbox's `/tmp` is fresh for every command, so the agent cannot
  leave a reward file behind). A path these rules miss (built at run time, or in a binary
  file: tests or solutions with one are skipped) still names the image's read-only copy;
- what a task does outside its working directory (apt-get, pip install into the image, writing
  `/etc`, starting services as root, fetching from the network) fails here; `--verify` drops
  such a task with the cause.
Scoring (`.harbor/run.sh`, the task's test command, pure bash but for `mkdir`): runs
`bash .harbor/tests/test.sh` in `/workspace`, then reads the reward as Harbor does:
`/logs/verifier/reward.json`'s `"reward"` first, else `reward.txt` (one number). coder's
exit-status scoring (coder.env.scoring.score, a v2 task with no test ids) is pass / fail, so the task
scores 1 iff the reward is 1 (`1`, `1.0`, ...); a fractional reward, no reward file (an error
in Harbor) or an unreadable one score 0, the cause printed in the run's output.

The reference solution: coder's solutions are files, not scripts, so `reference_files` runs
`solve.sh` once in the task's own sandbox and keeps the workspace files it changed or added
(`--solutions`, and the gold of `--verify`); one that deletes a file or writes a binary one is
refused with the reason. `make_tasks --verify` then keeps the tasks whose solution scores 1 and
whose unchanged workspace scores 0 (coder.env.sources.verify).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import tomllib

from coder.env.runtime import environments, images
from coder.env.sources import releases
from coder.env.sources import repo as repo_lib
from coder.env.runtime.sandbox import WORKDIR, Limits, Sandbox, SandboxError
from coder.env.tasks import Task

HIDDEN = ".harbor"  # the workspace directory of the hidden tests and the scoring script
LOGS = "/tmp/.harbor-logs"  # Harbor's /logs, inside the sandbox
RUNNER = f"{HIDDEN}/run.sh"
_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
# task.toml keys read here and the types they must have (Harbor's TaskConfig has more; others
# are kept in the metadata when they are scalars, never interpreted)
_TYPES = {
    ("verifier", "timeout_sec"): (int, float),
    ("agent", "timeout_sec"): (int, float),
    ("environment", "docker_image"): (str,),
    ("environment", "build_timeout_sec"): (int, float),
    ("environment", "cpus"): (int, float),
    ("environment", "memory_mb"): (int,),
    ("environment", "storage_mb"): (int,),
    ("environment", "memory"): (str,),
    ("environment", "allow_internet"): (bool,),
    ("task", "name"): (str,),
}
_TABLES = ("task", "metadata", "verifier", "agent", "environment", "solution")


@dataclasses.dataclass(frozen=True)
class TaskDir:
    """One Harbor task directory, read and checked."""

    path: str
    name: str
    instruction: str
    config: dict
    tests: dict  # path under tests/ -> text
    solution: dict  # path under solution/ -> text ({} without one)

    @property
    def docker_image(self) -> str:
        return self.config.get("environment", {}).get("docker_image") or ""


def strip_canary(text: str) -> str:
    """The instruction without its leading canary comment lines and the blank lines after."""
    lines = text.split("\n")
    i = 0
    while i < len(lines) and _CANARY.match(lines[i].strip()):
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def read_config(path: str) -> dict:
    """task.toml as a dict; ValueError naming the file (and the key) when it is not TOML or a
    key read here has the wrong type."""
    try:
        with open(path, "rb") as f:
            config = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from e
    for table in _TABLES:
        if not isinstance(config.get(table, {}), dict):
            raise ValueError(f"{path}: [{table}] must be a table, got {type(config[table]).__name__}")
    for (table, key), types in _TYPES.items():
        value = config.get(table, {}).get(key)
        if value is not None and (not isinstance(value, types)
                                  or (bool not in types and isinstance(value, bool))):
            raise ValueError(f"{path}: [{table}].{key} must be "
                             f"{' or '.join(t.__name__ for t in types)}, got {value!r}")
    return config


def _texts(root: str, where: str) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                raise ValueError(f"{where}/{rel} is a symbolic link (only text files are carried)")
            try:
                with open(full, encoding="utf-8") as f:
                    out[rel] = f.read()
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}/{rel} is not UTF-8 text: coder's hidden tests and "
                                 "solutions are text") from e
    return out


def read_task_dir(path: str) -> TaskDir:
    """The task directory at `path`; ValueError naming the file that is missing or malformed."""
    path = os.path.abspath(path)
    config = read_config(os.path.join(path, "task.toml"))
    try:
        with open(os.path.join(path, "instruction.md"), encoding="utf-8") as f:
            instruction = strip_canary(f.read()).strip()
    except OSError as e:
        raise ValueError(f"{path}/instruction.md: cannot read: {e}") from e
    if not instruction:
        raise ValueError(f"{path}/instruction.md is empty")
    if not os.path.isfile(os.path.join(path, "tests", "test.sh")):
        raise ValueError(f"{path}/tests/test.sh is missing (Harbor's verifier runs it)")
    tests = _texts(os.path.join(path, "tests"), f"{path}/tests")
    solution = {}
    if os.path.isdir(os.path.join(path, "solution")):
        solution = _texts(os.path.join(path, "solution"), f"{path}/solution")
        if solution and "solve.sh" not in solution:
            raise ValueError(f"{path}/solution has no solve.sh")
    name = config.get("task", {}).get("name") or os.path.basename(path)
    return TaskDir(path, name, instruction, config, tests, solution)


def task_dirs(paths) -> list[str]:
    """Each path that holds a task.toml, or the subdirectories of one that do (a dataset)."""
    out = []
    for p in paths:
        if os.path.isfile(os.path.join(p, "task.toml")):
            out.append(p)
        elif os.path.isdir(p):
            found = sorted(os.path.join(p, d) for d in os.listdir(p)
                           if os.path.isfile(os.path.join(p, d, "task.toml")))
            out += found or [p]  # none: read_task_dir names the missing task.toml
        else:
            out.append(p)
    return out


def layout_of(docker_image: str, layouts: str) -> dict:
    """The image spec {"layout", "ref"} where `docker_image` is expected under `layouts`."""
    name, ref = docker_image, "latest"
    if "@" in name:
        name, digest = name.split("@", 1)
        ref = digest.replace(":", "-")
    elif ":" in name.rsplit("/", 1)[-1]:
        name, ref = name.rsplit(":", 1)
    return {"layout": os.path.join(os.path.abspath(layouts), re.sub(r"[/:@]", "_", name)),
            "ref": ref}


def skip_reason(td: TaskDir, layouts: str) -> str:
    """Why the task cannot be imported ("" when it can): its environment is not a prebuilt image
    coder has as an OCI layout."""
    env_dir = os.path.join(td.path, "environment")
    for compose in ("docker-compose.yaml", "docker-compose.yml"):
        if os.path.isfile(os.path.join(env_dir, compose)):
            return (f"environment/{compose}: a multi-container environment (coder runs a task in "
                    "one image)")
    if not td.docker_image:
        if os.path.isfile(os.path.join(env_dir, "Dockerfile")):
            return ("environment/Dockerfile only: coder does not build Dockerfiles (build and push "
                    "the image, set [environment].docker_image, and copy it with skopeo)")
        return "no [environment].docker_image and no environment/Dockerfile"
    if not layouts:
        return f"image {td.docker_image}: no --images directory of OCI layouts given"
    spec = layout_of(td.docker_image, layouts)
    try:
        images.manifest_digest(spec["layout"], spec["ref"])
    except images.ImageError as e:
        return (f"image {td.docker_image}: {e}; copy it with `skopeo copy docker://"
                f"{td.docker_image} oci:{spec['layout']}:{spec['ref']}`")
    return ""


def working_dir(image: images.Image) -> str:
    """The image's working directory (umoci's runtime config keeps the image's WorkingDir)."""
    with open(os.path.join(image.path, "config.json")) as f:
        return os.path.normpath(json.load(f).get("process", {}).get("cwd") or "/")


def rewrite(text: str, workdir: str) -> str:
    """`text` with Harbor's in-container paths made the sandbox's (module docstring): each
    occurrence of a path as a whole path name (`/app`, `/app/x`; never `/apps` or `x/app`)."""
    table = {workdir: WORKDIR, "/tests": f"{WORKDIR}/{HIDDEN}/tests",
             "/solution": f"{WORKDIR}/{HIDDEN}/solution", "/logs": LOGS}
    names = "|".join(re.escape(p) for p in sorted(table, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.~$/-])({names})(?![\w.-])")
    return pattern.sub(lambda m: table[m.group(1)], text)


def runner_script() -> str:
    """The scoring command's script: test.sh, then Harbor's reward file read (pure bash)."""
    v = f"{LOGS}/verifier"
    return f"""# coder.env.sources.harbor: run Harbor's verifier and pass iff its reward is 1
mkdir -p {v} {LOGS}/agent {LOGS}/artifacts || {{ echo "harbor: cannot make {v}"; exit 3; }}
bash {HIDDEN}/tests/test.sh > {v}/test-stdout.txt 2>&1
status=$?
out=$(<{v}/test-stdout.txt)
echo "${{out: -3000}}"
reward="" src=""
if [[ -f {v}/reward.json ]]; then
  json=$(<{v}/reward.json)
  if [[ $json =~ \\"reward\\"[[:space:]]*:[[:space:]]*([-+0-9.eE]+) ]]; then
    reward=${{BASH_REMATCH[1]}} src=reward.json
  fi
fi
if [[ -z $src && -f {v}/reward.txt ]]; then
  reward=$(<{v}/reward.txt) reward=${{reward//[[:space:]]/}} src=reward.txt
fi
if [[ -z $src ]]; then
  echo "harbor: test.sh (exit $status) wrote no reward file ({v}/reward.txt or reward.json)"
  exit 3
fi
echo "harbor: $src reward ${{reward:-<empty>}} (test.sh exit $status)"
[[ $reward =~ ^[+]?0*1([.]0*)?$ ]]
"""


def _commit_workspace(tree: str, repos: str, tid: str) -> tuple[str, str]:
    mirror = os.path.join(os.path.abspath(repos), f"harbor__{re.sub(r'[^A-Za-z0-9._-]', '_', tid)}")
    if not os.path.isdir(mirror):
        os.makedirs(repos, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=repos, prefix=".harbor-")
        repo_lib.git("init", "-q", "--bare", tmp)
        try:
            os.rename(tmp, mirror)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    who = {"GIT_AUTHOR_NAME": "harbor image", "GIT_AUTHOR_EMAIL": "harbor@coder.invalid",
           "GIT_AUTHOR_DATE": "1970-01-01T00:00:00+0000"}
    env = {**who, "GIT_COMMITTER_NAME": who["GIT_AUTHOR_NAME"],
           "GIT_COMMITTER_EMAIL": who["GIT_AUTHOR_EMAIL"], "GIT_COMMITTER_DATE": who["GIT_AUTHOR_DATE"]}
    return mirror, releases.commit_tree(mirror, tree, f"{tid}: the image's working directory", env=env)


def to_task(td: TaskDir, layouts: str, repos: str, limits: Limits | None = None) -> Task:
    """The coder task of an importable task directory (`skip_reason` is ""): the image unpacked
    (coder.env.runtime.images), its working directory committed as the workspace. ValueError why not."""
    spec = layout_of(td.docker_image, layouts)
    limits = limits or Limits()
    try:
        image = images.ensure(spec, environments.check_dir(limits.environments_dir))
    except images.ImageError as e:
        raise ValueError(f"image {td.docker_image}: {e}") from e
    workdir = working_dir(image)
    if workdir == "/":
        raise ValueError(f"image {td.docker_image} has no working directory (WorkingDir /): the "
                         "whole root filesystem cannot be the workspace")
    with tempfile.TemporaryDirectory() as empty:
        tree = image.host_path(workdir)
        repo, commit = _commit_workspace(tree if os.path.isdir(tree) else empty, repos, td.name)
    tests = {f"{HIDDEN}/tests/{p}": rewrite(t, workdir) for p, t in td.tests.items()}
    tests[RUNNER] = runner_script()
    cfg = td.config
    meta = {"source": "harbor", "repo": f"harbor/{os.path.basename(os.path.dirname(td.path))}",
            "task_dir": td.path, "docker_image": td.docker_image, "workdir": workdir}
    for table in ("metadata", "verifier", "agent", "environment"):
        for key, value in cfg.get(table, {}).items():
            if isinstance(value, (str, int, float, bool)) or (
                    isinstance(value, list) and all(isinstance(v, str) for v in value)):
                meta[key if table == "metadata" else f"{table}_{key}"] = value
    return Task(id=re.sub(r"[^A-Za-z0-9._-]", "__", td.name), prompt=rewrite(td.instruction, workdir),
                files={}, tests=tests, test_command=f"bash {RUNNER}", language="shell",
                source="harbor", repo=repo, commit=commit, metadata=meta,
                environment={"image": spec})


def reference_files(task: Task, td: TaskDir, limits: Limits | None = None) -> dict:
    """{path: text} the workspace holds after `solve.sh` ran in the task's sandbox, for the
    files it changed or added; ValueError when there is no solution, it deletes a file or writes
    one that is not text."""
    if "solve.sh" not in td.solution:
        raise ValueError(f"{td.path}/solution/solve.sh is missing: nothing to verify with")
    timeout = float(td.config.get("agent", {}).get("timeout_sec") or 600.0)
    limits = limits or Limits()
    limits = dataclasses.replace(limits, timeout_s=max(limits.timeout_s, timeout),
                                 cpu_s=max(limits.cpu_s, int(timeout)))
    workdir = task.metadata.get("workdir", "/")
    try:
        with Sandbox(task, limits) as sb:
            before = _tree(sb.workspace)
            for path, text in td.solution.items():
                sb.write(f"{HIDDEN}/solution/{path}", rewrite(text, workdir))
            res = sb.run(f"bash {HIDDEN}/solution/solve.sh", timeout_s=timeout)
            shutil.rmtree(os.path.join(sb.workspace, HIDDEN), ignore_errors=True)
            after = _tree(sb.workspace)
    except SandboxError as e:
        raise ValueError(f"solve.sh could not run: {e}") from e
    tail = (res.stdout + res.stderr)[-800:]
    if res.timed_out:
        raise ValueError(f"solve.sh timed out after {timeout:g} s: {tail}")
    gone = sorted(set(before) - set(after))
    if gone:
        raise ValueError(f"solve.sh deletes {gone[:5]}: a coder solution writes files, it cannot "
                         "delete them")
    changed = {p: data for p, data in after.items() if before.get(p) != data}
    out = {}
    for path, data in changed.items():
        try:
            out[path] = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"solve.sh writes {path}, which is not UTF-8 text") from e
    if not out:
        raise ValueError(f"solve.sh (exit {res.exit_code}) changes nothing in the workspace "
                         f"({workdir}): {tail}")
    return out


def _tree(root: str) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__")]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:
                    out[os.path.relpath(full, root)] = f.read()
    return out


def import_dirs(paths, layouts: str, repos: str, skipped: dict, solutions: bool = True,
                limits: Limits | None = None) -> list[tuple[Task, dict]]:
    """[(task, solution files)] of the task directories under `paths` (`task_dirs`); each one
    not imported lands in `skipped` {directory: why}. `solutions`: run each solve.sh
    (`reference_files`; a task whose solution cannot be had is skipped), else solutions are {}."""
    pairs = []
    for path in task_dirs(paths):
        try:
            td = read_task_dir(path)
            why = skip_reason(td, layouts)
            if why:
                skipped[path] = why
                continue
            task = to_task(td, layouts, repos, limits)
            pairs.append((task, reference_files(task, td, limits) if solutions else {}))
        except ValueError as e:
            skipped[path] = str(e)
    return pairs
