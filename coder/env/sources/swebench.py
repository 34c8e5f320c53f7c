"""SWE-bench-style instances -> task format v2 (`python -m coder.env.make_tasks --source swebench
--input I.jsonl --repos DIR --out T.jsonl [--solutions S.jsonl]`).

One instance per JSONL line, or per row of a Parquet file (`read_instances`: Hugging Face's
format; pyarrow reads it). Fields read (SWE-bench's names):
- `instance_id` -> the task id; `problem_statement` -> the prompt (nothing else is shown);
- `repo` ("owner/name") -> the local mirror `DIR/owner__name` (a git repository, or an archive
  `DIR/owner__name.tar.gz` / `.tgz` / `.zip`); no network is used;
- `base_commit` -> the commit the workspace starts from (checked to exist in the mirror);
- `test_patch` -> the task's hidden `test_patch` (applied only at scoring);
- `FAIL_TO_PASS` / `PASS_TO_PASS` -> `fail_to_pass` / `pass_to_pass`: JSON strings of lists
  (the released SWE-bench files) or lists (SWE-Gym, SWE-smith);
- `patch` -> the gold solution written by `--solutions` as {"id", "patch"}, and the metadata's
  size of the reference change (`lines_added`, `lines_removed`, `files_changed`);
- `version`, `environment_setup_commit`, `created_at`, `hints_text` (optional) -> metadata.

Variants whose fields were checked against their dataset cards (Hugging Face, 2026-11):
- SWE-bench / Lite / Verified, SWE-Gym, nebius/SWE-bench-extra: the fields above (SWE-Gym and
  SWE-bench-extra carry FAIL_TO_PASS / PASS_TO_PASS as lists; SWE-bench-extra adds `meta`).
- SWE-rebench: SWE-bench's fields plus `install_config` (a dict, or a JSON string of one; its
  `test_cmd`, when it runs pytest, becomes the task's test command), `docker_image`, `meta`
  (kept in the metadata).
- SWE-smith: `instance_id`, `repo` ("swesmith/owner__name.<sha8>", the mirror is
  `DIR/owner__name.<sha8>` or `DIR/owner__name`), `patch`, FAIL_TO_PASS / PASS_TO_PASS lists,
  `image_name`, `problem_statement`; no `base_commit` nor `test_patch`. The workspace is the
  mirror's branch named after the instance (checked to exist), taken to hold the bug; `patch`
  is read as the diff that introduced it, so the gold solution is its reverse when that applies
  to the branch (checked against a throwaway index), else `patch` itself when that applies, else
  the instance is an error. Not confirmed against SWE-smith's own harness.
- R2E-Gym: `repo_name`, `commit_hash`, `parsed_commit_content`, `execution_result_content`,
  `expected_output_json` (no FAIL_TO_PASS list, tests inside its images): coder.env.sources.r2egym
  derives the split from the rows' own logs; `--environments` keys it by `repo_name`.
Test ids are read the way SWE-bench's harness reads them (`Task.test_format`, coder.env.scoring.runners;
the rule, coder.env.scoring.grading): a row's `log_parser` (SWE-bench 5's rows, SWE-rebench's
`install_config`) names its parser, else its repository's parser in SWE-bench's harness does
(`HARNESS_FORMATS`), else SWE-bench's pytest parser's: pytest ids cut at their first space, the
images' /testbed for the workspace's path. Django's and sympy's instances run the harness's own
command on the files their `test_patch` writes (`runner_command`: `./tests/runtests.py
--verbosity 2 --settings=test_sqlite --parallel 1 <labels>`, `bin/test -C --verbose <files>`)
and their ids (`test_x (module.Class)`, a docstring's first line, sympy's bare names) are read
from its output; `--test-command` is the command of the pytest instances only.
A pytest command on a `src/` layout (the base commit has a top-level `src/`) gets
`-o pythonpath=src`, as the releases importer's do, unless it sets pythonpath itself.

`make_tasks --verify` keeps the tasks whose gold patch scores 1 and whose unchanged workspace
scores 0 in this machine's sandbox, names each drop's cause and ends with a table per
repository (coder.env.sources.verify).

The environment: without one the sandbox runs the host's Python read-only, so a repository's
dependencies must already be installed there (`pip install -e .` inside is impossible offline).
`--environments MAP.json` gives tasks a Python environment (Task.environment, a venv built once
per spec: coder.env.runtime.environments) by repository: {"owner/name@version": spec, "owner/name":
spec}, the version key first, as SWE-bench's harness keys its environment specs; a spec's
`python.version` ("3.9", SWE-bench's specs' "python") builds its venv with that Python, and a
spec without one takes the version a row's `install_config` names (SWE-rebench's "python";
`with_python`). The instances themselves carry no requirements to map: SWE-bench keeps them in its harness, and SWE-rebench's
`install_config` (`pip_packages`, unpinned, plus an `install` command that installs the project
itself into the environment, which a read-only venv shared by tasks cannot take) stays in the
metadata. `--setup` gives every task a setup command run in its sandbox after checkout.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex

import fsspec

from coder.env.runtime import environments
from coder.env.sources import r2egym
from coder.env.sources import repo as repo_lib
from coder.env.scoring.score import pytest_args
from coder.env.tasks import DEFAULT_TEST_COMMAND, Task, read_jsonl


def _json_field(row: dict, key: str, kind, default):
    value = row.get(key)
    if value is None or value == "":
        return default
    if isinstance(value, str) and kind is not str:
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"instance {row.get('instance_id')!r}: {key} is not JSON: {e}")
    if not isinstance(value, kind):
        raise ValueError(f"instance {row.get('instance_id')!r}: {key} must be a {kind.__name__}")
    return value


def _test_ids(row: dict, key: str) -> tuple:
    ids = _json_field(row, key, list, [])
    if not all(isinstance(i, str) for i in ids):
        raise ValueError(f"instance {row.get('instance_id')!r}: {key} must list test ids")
    return tuple(ids)


def mirror_path(repos: str, repo: str) -> str:
    """The local mirror of `repo` ("owner/name", SWE-smith's "swesmith/owner__name.sha8", or
    R2E-Gym's bare "name") under `repos`: a directory or an archive. ValueError naming the paths tried."""
    owner, slash, name = repo.partition("/")
    if not slash:  # R2E-Gym names no owner: DIR/name, else the one DIR/<owner>__name
        root = os.path.abspath(repos)
        names = {repo + s for s in ("", *repo_lib.ARCHIVE_SUFFIXES)}
        owners = sorted({e.partition("__")[0] for e in (os.listdir(root) if os.path.isdir(root)
                                                         else ()) if e.partition("__")[2] in names})
        if len(owners) > 1:
            raise ValueError(f"mirrors of {repo!r} under {root} from several owners: {owners}")
        stems = [repo] + [f"{o}__{repo}" for o in owners]
    else:
        stems = [] if owner == "swesmith" else [f"{owner}__{name}"]
    if owner == "swesmith" or "__" in name:  # SWE-smith: the mirror is named owner__name.sha8
        stems += [name, name.rsplit(".", 1)[0]]
    tried = []
    for stem in stems:
        for suffix in ("", *repo_lib.ARCHIVE_SUFFIXES):
            path = os.path.join(os.path.abspath(repos), stem + suffix)
            tried.append(path)
            if os.path.exists(path):
                return path
    raise ValueError(f"no local mirror of {repo!r}: tried {tried}")


def reverse_patch(patch: str) -> str:
    """The unified diff that undoes `patch` (git's format: renames, modes and new / deleted
    files swap too)."""
    out, old_line = [], None
    swaps = {
        "new file mode ": "deleted file mode ",
        "deleted file mode ": "new file mode ",
        "old mode ": "new mode ",
        "new mode ": "old mode ",
        "rename from ": "rename to ",
        "rename to ": "rename from ",
        "copy from ": "copy to ",
        "copy to ": "copy from ",
    }
    in_hunk = [0, 0]
    for line in patch.split("\n"):
        if in_hunk[0] > 0 or in_hunk[1] > 0:
            if line.startswith("+"):
                out.append("-" + line[1:])
                in_hunk[1] -= 1
            elif line.startswith("-"):
                out.append("+" + line[1:])
                in_hunk[0] -= 1
            else:
                out.append(line)
                if not line.startswith("\\"):
                    in_hunk = [in_hunk[0] - 1, in_hunk[1] - 1]
            continue
        m = re.match(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@(.*)$", line)
        if m:
            old, new = m.group(1), m.group(2)
            out.append(f"@@ -{new} +{old} @@{m.group(3)}")
            in_hunk = [int(old.split(",")[1]) if "," in old else 1,
                       int(new.split(",")[1]) if "," in new else 1]
            continue
        if (g := re.match(r"^diff --git a/(.+) b/(.+)$", line)) is not None:
            out.append(f"diff --git a/{g.group(2)} b/{g.group(1)}")
        elif (g := re.match(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(.*)$", line)) is not None:
            out.append(f"index {g.group(2)}..{g.group(1)}{g.group(3)}")
        elif line.startswith("--- "):
            old_line = line[4:]
            continue
        elif line.startswith("+++ ") and old_line is not None:
            new_path = line[4:]
            out.append("--- " + _reprefix(new_path, "a/"))
            out.append("+++ " + _reprefix(old_line, "b/"))
            old_line = None
        else:
            for a, b in swaps.items():
                if line.startswith(a):
                    line = b + line[len(a):]
                    break
            out.append(line)
    return "\n".join(out)


def _reprefix(path: str, prefix: str) -> str:
    if path.startswith(("a/", "b/")):
        return prefix + path[2:]
    return path


def check_environments(specs: dict) -> dict:
    """`--environments`' map, validated and normalised: {"owner/name@version" or "owner/name":
    environment spec (coder.env.runtime.environments)}; ValueError naming the key."""
    if not isinstance(specs, dict):
        raise ValueError("environments must map 'owner/name[@version]' to environment specs")
    return {k: environments.normalize(v, f"environments[{k!r}]") for k, v in specs.items()}


def with_python(environment: dict, install: dict, iid: str) -> dict:
    """A venv `environment` given the Python version its row names (SWE-rebench's
    `install_config` "python", as SWE-bench's specs name one per repository and version) when
    the spec itself names none: the spec's own `version` / `interpreter` wins. ValueError naming
    the instance when the row's value is not a version such as "3.9"."""
    want = install.get("python")
    py = environment.get("python")
    if py is None or want in (None, "") or py.get("version") or py.get("interpreter"):
        return environment
    version = environments.check_version(want, f"instance {iid!r}: install_config's python")
    return {"python": {**py, "version": version}}


def environment_of(row: dict, specs: dict) -> dict:
    """The environment of an instance: its `repo@version`'s spec, else its `repo`'s, else {}
    (SWE-bench's harness keys environments the same way: per repository and version)."""
    repo, version = row.get("repo", ""), row.get("version")
    if version not in (None, "") and f"{repo}@{version}" in specs:
        return specs[f"{repo}@{version}"]
    return specs.get(repo, {})


# The log parser SWE-bench's harness reads each of its repositories' test output with (swebench
# 5.0.2, harness/log_parsers/python.py: MAP_REPO_TO_PARSER_PY), as coder's test format: the ids
# its released FAIL_TO_PASS / PASS_TO_PASS lists hold are that parser's (coder.env.scoring.runners).
HARNESS_FORMATS = {
    "astropy/astropy": "swebench-pytest-v2",
    "django/django": "django",
    "marshmallow-code/marshmallow": "swebench-pytest",
    "matplotlib/matplotlib": "swebench-matplotlib",
    "mwaskom/seaborn": "swebench-seaborn",
    "pallets/flask": "swebench-pytest",
    "psf/requests": "swebench-pytest-options",
    "pvlib/pvlib-python": "swebench-pytest",
    "pydata/xarray": "swebench-pytest",
    "pydicom/pydicom": "swebench-pytest-options",
    "pylint-dev/astroid": "swebench-pytest",
    "pylint-dev/pylint": "swebench-pytest-options",
    "pytest-dev/pytest": "swebench-pytest",
    "pyvista/pyvista": "swebench-pytest",
    "scikit-learn/scikit-learn": "swebench-pytest-v2",
    "sqlfluff/sqlfluff": "swebench-pytest",
    "sphinx-doc/sphinx": "swebench-pytest-v2",
    "sympy/sympy": "sympy",
}
# A log parser named by the row itself (SWE-bench 5's rows and SWE-rebench's install_config carry
# `log_parser`): the package's registry names of its Python parsers.
PARSER_FORMATS = {
    **{f"parse_log_{n}": "swebench-pytest" for n in (
        "pytest", "astroid", "flask", "marshmallow", "pvlib", "pyvista", "sqlfluff", "xarray")},
    **{f"parse_log_{n}": "swebench-pytest-options" for n in ("pytest_options", "pydicom", "requests", "pylint")},
    **{f"parse_log_{n}": "swebench-pytest-v2" for n in ("pytest_v2", "astropy", "scikit", "sphinx")},
    "parse_log_matplotlib": "swebench-matplotlib",
    "parse_log_seaborn": "swebench-seaborn",
    "parse_log_django": "django",
    "parse_log_sympy": "sympy",
}
# The harness's test commands of the formats that are not pytest (its constants/python.py:
# TEST_DJANGO, TEST_DJANGO_NO_PARALLEL for Django 1.9, TEST_SYMPY), run on `test_directives`.
RUNNER_COMMANDS = {
    "django": "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
    "django@1.9": "./tests/runtests.py --verbosity 2",
    "sympy": "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
}
_NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")


def test_directives(test_patch: str, django: bool = False) -> list[str]:
    """What the harness passes its test command: the files `test_patch` writes, data files left
    out; for Django, as test labels (`tests/a/tests.py` -> `a.tests`). SWE-bench's
    `get_test_directives`."""
    out = [p for p in re.findall(r"diff --git a/.* b/(.*)", test_patch) if not p.endswith(_NON_TEST_EXTS)]
    if django:
        out = [p.removesuffix(".py").removeprefix("tests/").replace("/", ".") for p in out]
    return out


def runner_command(row: dict, test_format: str) -> str:
    """The harness's command for a Django or sympy instance, on its test directives."""
    base = RUNNER_COMMANDS.get(f"{test_format}@{row.get('version')}", RUNNER_COMMANDS[test_format])
    directives = test_directives(row.get("test_patch") or "", django=test_format == "django")
    return " ".join([base, *(shlex.quote(d) for d in directives)])


def upstream_repo(repo: str) -> str:
    """"owner/name" of a row's repository (SWE-smith's "swesmith/owner__name.sha8" included)."""
    owner, _, name = repo.partition("/")
    if owner == "swesmith" and "__" in name:
        return name.rsplit(".", 1)[0].replace("__", "/", 1)
    return repo


def test_format_of(row: dict, install: dict) -> str:
    """The instance's test format: the log parser the row names, else its repository's in
    SWE-bench's harness, else SWE-bench's pytest parser's (the one SWE-Gym, SWE-rebench and
    SWE-smith use for the repositories they add). ValueError for a parser coder does not read."""
    name = row.get("log_parser") or install.get("log_parser")
    if name:
        if name not in PARSER_FORMATS:
            raise ValueError(f"instance {row.get('instance_id')!r}: log parser {name!r} is not one "
                             f"coder reads ({sorted(PARSER_FORMATS)})")
        return PARSER_FORMATS[name]
    return HARNESS_FORMATS.get(upstream_repo(row["repo"]), "swebench-pytest")


def _with_src_layout(test_command: str, mirror: str, commit: str) -> str:
    """A pytest command for a `src/` layout gets `-o pythonpath=src` (the package is importable
    from the workspace root only through it), unless it sets pythonpath itself."""
    try:
        pytest_args(test_command)
    except ValueError:
        return test_command
    if "pythonpath" in test_command or not repo_lib.is_dir(mirror, commit, "src"):
        return test_command
    return test_command + " -o pythonpath=src"


def instance_to_task(
    row: dict, repos: str, test_command: str = DEFAULT_TEST_COMMAND, setup: str = "",
    environment_specs: dict | None = None,
) -> tuple[Task, str]:
    """(the task, its gold patch) of one instance; ValueError naming the instance and field.
    `environment_specs`: `check_environments`' map, the task's environment by its repository.
    An R2E-Gym row goes to coder.env.sources.r2egym (its mirror and environment by `repo_name`)."""
    if r2egym.is_row(row):
        name = row.get("repo_name")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"an R2E-Gym row's repo_name must be a repository name: {name!r}")
        env = environment_of({"repo": name}, environment_specs or {})
        return r2egym.to_task(row, mirror_path(repos, name), test_command, setup, env)
    iid = row.get("instance_id")
    if not isinstance(iid, str) or not iid:
        raise ValueError(f"an instance lacks instance_id: keys {sorted(row)[:12]}")
    for key in ("repo", "problem_statement"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise ValueError(f"instance {iid!r}: {key} missing")
    mirror = mirror_path(repos, row["repo"])
    smith = not row.get("base_commit") and (
        "image_name" in row or row["repo"].startswith("swesmith/")
    )
    gold = row.get("patch") or ""
    if smith:
        commit = iid  # the mirror's branch holding this instance's bug
    elif row.get("base_commit"):
        commit = row["base_commit"]
    else:
        raise ValueError(f"instance {iid!r}: base_commit missing")
    try:
        commit = repo_lib.resolve(mirror, commit)
    except repo_lib.RepoError as e:
        raise ValueError(f"instance {iid!r}: commit {commit!r} not in {mirror}: {e}") from e
    if smith and gold:  # `patch` made the bug: its reverse is the fix (whichever applies)
        if repo_lib.applies(mirror, commit, reverse_patch(gold)):
            gold = reverse_patch(gold)
        elif not repo_lib.applies(mirror, commit, gold):
            raise ValueError(f"instance {iid!r}: patch applies to {commit[:12]} in neither way")
    install = _json_field(row, "install_config", dict, {})
    cmd = install.get("test_cmd")
    if isinstance(cmd, list) and len(cmd) == 1:
        cmd = cmd[0]
    if isinstance(cmd, str) and re.match(r"^(python\S* -m )?pytest\b", cmd.strip()):
        test_command = cmd.strip()
    test_format = test_format_of(row, install)
    if test_format in RUNNER_COMMANDS:
        test_command = runner_command(row, test_format)
    else:
        test_command = _with_src_layout(test_command, mirror, commit)
    stats = repo_lib.patch_stats(gold)  # the reference fix (SWE-smith: the reversed patch)
    meta = {
        "source": "swebench",
        "variant": "swe-smith" if smith else "swe-rebench" if install else "swe-bench",
        "repo": row["repo"],
        "instance_id": iid,
        "base_commit": commit,
        "lines_added": stats["lines_added"],
        "lines_removed": stats["lines_removed"],
        "files_changed": stats["files"],
    }
    for key in ("version", "environment_setup_commit", "created_at", "hints_text",
                "image_name", "docker_image"):
        if row.get(key) not in (None, ""):
            meta[key] = row[key]
    if install:
        meta["install_config"] = install
    if isinstance(row.get("meta"), dict):
        meta["meta"] = row["meta"]
    task = Task(
        id=iid,
        prompt=row["problem_statement"],
        files={},
        tests={},
        test_command=test_command,
        source="swebench",
        repo=mirror,
        commit=commit,
        setup=setup,
        fail_to_pass=_test_ids(row, "FAIL_TO_PASS"),
        pass_to_pass=_test_ids(row, "PASS_TO_PASS"),
        test_patch=row.get("test_patch") or "",
        metadata=meta,
        environment=with_python(environment_of(row, environment_specs or {}), install, iid),
        test_format=test_format,
    )
    return task, gold


def row_repo(row: dict) -> str:
    """The repository a row names (`repo`, R2E-Gym's `repo_name`), as its task's metadata does."""
    return row.get("repo") or row.get("repo_name") or "?"


def read_instances(path: str) -> list[dict]:
    """The rows of an instances file, local or an fsspec URL: JSONL, or Parquet (`.parquet`,
    as Hugging Face serves SWE-bench, SWE-Gym, SWE-rebench and R2E-Gym), read a batch at a time
    (an R2E-Gym row carries its commit's whole files)."""
    if not os.fspath(path).endswith(".parquet"):
        return read_jsonl(path)
    import pyarrow.parquet as pq  # heavy: pyarrow (parquet files only)

    rows = []
    with fsspec.open(os.fspath(path), "rb") as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=64):
            rows += batch.to_pylist()
    return rows


def import_instances(
    rows: list[dict], repos: str, test_command: str = DEFAULT_TEST_COMMAND, setup: str = "",
    environment_specs: dict | None = None, skipped: dict | None = None,
) -> list[tuple[Task, str]]:
    """Every instance as (task, gold patch); duplicate ids are an error. `environment_specs`:
    {"owner/name@version" or "owner/name": environment spec} (`environment_of`). An instance
    that cannot be converted raises, or with `skipped` (a dict) is left out and its reason
    recorded there under its row's number and id (a released set has such rows: an R2E-Gym row
    whose logs lack the summary its split is read from, a SWE-bench row whose mirror is missing)."""
    specs = check_environments(environment_specs or {})
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(instance_to_task(row, repos, test_command, setup, specs))
        except ValueError as e:
            if skipped is None:
                raise
            skipped[f"row {i} ({row.get('instance_id') or row.get('repo_name') or '?'})"] = str(e)
    dup = sorted(i for i, n in collections.Counter(t.id for t, _ in out).items() if n > 1)
    if dup:
        raise ValueError(f"duplicate instance ids {dup[:5]}")
    return out
