"""Test setup: CPU backend with 8 fake devices, so sharding tests run anywhere.

This must run before jax is imported by any test module.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

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
