"""Test setup: CPU backend with 8 fake devices, so sharding tests run anywhere.

This must run before jax is imported by any test module.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 fake CPU devices; and LLVM -O0 for XLA:CPU's generated code: the suite compiles hundreds of
# small programs and runs most a few times, so compiling dominates (a tiny model's train step:
# 16 s to compile at the default level, 8-10 s at -O0, its steps 2x slower). The arithmetic is
# XLA's own either way: the sync GRPO learning run gave the same rewards to the last digit.
# Inherited by the processes the tests start. A user's own level is left alone.
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in _flags:
        _flags = (_flags + " " + _flag).strip()
os.environ["XLA_FLAGS"] = _flags

# One persistent XLA compilation cache per test session, shared by the xdist workers and the
# processes tests start (main.py, the two-process jobs, Ray actors, which all compile the same
# small programs again). The first process to load this file (pytest's controller) creates it;
# the others inherit the variable. A user's JAX_COMPILATION_CACHE_DIR is left alone.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="coder-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# Artifacts every test process of the session shares (the fitted toy policy): made by whichever
# process needs one first, under a file lock, in a directory the controller creates and removes.
if "CODER_TEST_SHARED_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _shared_dir = tempfile.mkdtemp(prefix="coder-test-shared-")
    os.environ["CODER_TEST_SHARED_DIR"] = _shared_dir
    atexit.register(shutil.rmtree, _shared_dir, ignore_errors=True)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def toy_policy():
    """tests/rl_toy.py's tiny model SFT-ed on the submit-call format, fitted once per test
    session (every xdist worker loads the same file) and checked right after fitting:
    `rl_toy.ToyPolicy(tokenizer, stage_len, state, format)`."""
    from tests import rl_toy

    return rl_toy.fitted_policy(os.environ["CODER_TEST_SHARED_DIR"])
