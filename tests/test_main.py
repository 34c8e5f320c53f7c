"""main.py's start-up: a missing sandbox tool or a config error stops the run at once with one
paragraph (no traceback) naming what to do; stages that need no tool do not ask for them."""
import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.abspath(sys.executable)


def _main(tmp_path, *args, path=None):
    """Run main.py with the quickstart config in a subprocess; PATH = `path` (default: unchanged)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    if path is not None:
        env["PATH"] = path
    t0 = time.perf_counter()
    p = subprocess.run(
        [PYTHON, "main.py", "--config=configs/quickstart.py", f"--config.workdir={tmp_path / 'run'}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    return p, time.perf_counter() - t0


# XLA's own C++ log lines (absl's format before absl::InitializeLog, no date): jax's CUDA plugin prints
# "Could not find cuda drivers" on a machine without CUDA; they are not main.py's words
_XLA_LOG = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called|[IWEF]0000 00:00:\d+\.\d+ +\d+ \S+:\d+\])")


def _own_lines(stderr: str) -> list[str]:
    """main.py's stderr lines, XLA's C++ log lines left out."""
    return [line for line in stderr.strip().splitlines() if not _XLA_LOG.match(line)]


def _path_without_bwrap(tmp_path) -> str:
    """A PATH holding only the interpreter (bwrap, setpriv and prlimit are not on it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(PYTHON)
    return str(bin_dir)


def test_missing_bwrap_stops_at_start_up(tmp_path):
    p, seconds = _main(tmp_path, path=_path_without_bwrap(tmp_path))
    assert p.returncode != 0
    assert seconds < 60, seconds
    err = p.stderr
    assert "Traceback" not in err, err
    assert "bubblewrap" in err and "scripts/setup.sh" in err, err
    assert "stages sft, grpo, eval need" in err and "bwrap" in err, err
    assert len(_own_lines(err)) == 1, err  # one paragraph
    assert not (tmp_path / "run").exists()  # no stage started


def test_stages_without_the_sandbox_do_not_need_bwrap(tmp_path):
    """pretrain alone passes the tool check: it stops later, at the mesh / batch check (a cheap way
    to show it got past the tools without training), with the key named and no traceback."""
    path = _path_without_bwrap(tmp_path)
    p, _ = _main(tmp_path, "--config.stages=('pretrain',)", "--config.train.grad_accum=3", path=path)
    assert p.returncode != 0
    assert "bwrap" not in p.stderr and "bubblewrap" not in p.stderr, p.stderr
    assert "train.grad_accum=3" in p.stderr and "Traceback" not in p.stderr, p.stderr
    # sft on a JSONL file needs no transcripts of the toy tasks, so no sandbox either
    p, _ = _main(tmp_path, "--config.stages=('pretrain', 'sft')", "--config.sft.data=/nonexistent.jsonl",
                 "--config.train.grad_accum=3", path=path)
    assert "bubblewrap" not in p.stderr and "train.grad_accum=3" in p.stderr, p.stderr


def test_unknown_stage_and_config_file_typo_are_one_line(tmp_path):
    p, _ = _main(tmp_path, "--config.stages=('pretrain', 'sfft')")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "config.stages: unknown stage 'sfft'" in p.stderr

    p, _ = _main(tmp_path, "--config.train.lrr=3")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert "--config.train.lrr=3: unknown key 'lrr'" in p.stderr and 'Did you mean "lr"' in p.stderr

    config = tmp_path / "typo.py"
    config.write_text("from configs.quickstart import get_config as q\n\n\ndef get_config():\n"
                      "    c = q()\n    c.sft.seq_lne = 512\n    return c\n")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    p = subprocess.run([PYTHON, "main.py", f"--config={config}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert f"{config}:6" in p.stderr and '"seq_lne" does not exist' in p.stderr, p.stderr


def test_library_info_lines_are_silenced_at_their_loggers():
    """orbax / grain log through absl's "absl" logger, jax through "jax.*": WARNING by default,
    coder's own root-logger INFO lines still show; --logger_levels overrides."""
    code = (
        "import logging, sys; sys.argv = ['main.py']; import main; from absl import flags; "
        "flags.FLAGS(['main.py', '--logger_levels=jax:INFO']); "
        "print(dict(main.QUIET_LOGGERS)['absl'], flags.FLAGS['logger_levels'].default['absl'], "
        "flags.FLAGS.logger_levels['jax'], 'absl' in flags.FLAGS.logger_levels)"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    p = subprocess.run([PYTHON, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["WARNING", "WARNING", "INFO", "False"]


def test_a_key_that_moved_is_named_where_it_is_now():
    """configs/base.py's MOVED: setting an old key (here in a config file's line, as a
    `--config.` override does the same) says the new one; every old key is gone and every new
    one exists."""
    import main
    from configs import base

    c = base.get_config()
    for old, new in base.MOVED.items():
        assert _has(c, new) and not _has(c, old), (old, new)
    errors = []
    try:
        c.rl.num_actors = 2
    except AttributeError as e:
        errors.append(main._config_error(e, []))
    try:
        c.grpo["async"] = True
    except KeyError as e:
        errors.append(main._config_error(e, []))
    assert errors[0].endswith("; it is rl.topology.actors now"), errors[0]
    assert errors[1].endswith("; it is rl.topology.asynchronous now"), errors[1]


def _has(config, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        if part not in node:
            return False
        node = node[part]
    return True
