"""Installing coder: the README's two blocks, scripts/setup.sh, .ci/run, and `pip install .`
(not editable) giving importable `coder` and `configs` packages."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.abspath(sys.executable)


def _readme_blocks() -> list[list[str]]:
    """The bash blocks of the README's "Two commands" section, as lists of commands."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Two commands"):]
    section = section[: section.index("\n## ", 3)]
    return [[line.strip() for line in block.strip().splitlines()]
            for block in re.findall(r"```bash\n(.*?)```", section, re.DOTALL)]


def test_readme_blocks_and_ci_agree():
    main_block, test_block = _readme_blocks()
    assert main_block == ["bash scripts/setup.sh", "python main.py --config=configs/quickstart.py"]
    assert test_block[0] == "bash scripts/setup.sh test,tpu"
    assert test_block[1] == "JAX_PLATFORMS=cpu python -m pytest -q -n 2 tests"
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    commands = [line for line in ci if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert commands == test_block  # .ci/run runs exactly the README's test block
    assert os.access(os.path.join(ROOT, "scripts", "setup.sh"), os.X_OK)


STUB = """#!/bin/bash
echo "$(basename "$0") $*" >> "{log}"
"""


def _stub_path(tmp_path, uid: int, tools: bool, sudo: bool = True) -> tuple[str, str]:
    """A PATH of stubs: apt-get (its `install` puts bwrap / setpriv / prlimit / umoci stubs on the PATH),
    sudo (runs its command), id -u, python (records its arguments and cwd); and the real programs
    setup.sh uses. Returns (PATH, log file)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for prog in ("bash", "dirname", "head", "rm", "basename"):
        (bin_dir / prog).symlink_to(shutil.which(prog))

    def stub(name, body=""):
        (bin_dir / name).write_text(STUB.format(log=log) + body)
        (bin_dir / name).chmod(0o755)

    chmod = shutil.which("chmod")
    tool_stubs = "".join(f'printf "#!/bin/bash\\nexit 0\\n" > "{bin_dir}/{t}"; {chmod} +x "{bin_dir}/{t}"\n'
                         for t in ("bwrap", "setpriv", "prlimit", "umoci"))
    stub("apt-get", f'if [ "$1" = install ]; then\n{tool_stubs}fi\n')
    if sudo:
        stub("sudo", 'exec "$@"\n')
    stub("id", f'echo {uid}\n')
    stub("python", f'echo "cwd $PWD" >> "{log}"\n')
    if tools:
        for t in ("bwrap", "setpriv", "prlimit", "umoci"):
            stub(t)
    return str(bin_dir), str(log)


def _setup(tmp_path, *args, uid=1000, tools=False, sudo=True):
    path, log = _stub_path(tmp_path, uid, tools, sudo)
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup.sh"), *args], cwd=str(tmp_path),
                       env={"PATH": path, "HOME": str(tmp_path)}, capture_output=True, text=True,
                       timeout=60)
    calls = open(log).read().splitlines() if os.path.exists(log) else []
    return p, calls


def test_setup_installs_missing_system_packages_then_the_package(tmp_path):
    p, calls = _setup(tmp_path, "test,tpu")
    assert p.returncode == 0, p.stderr
    assert "sudo apt-get update -q" in calls
    install = [c for c in calls if c.startswith("sudo apt-get install")]
    assert install and install[0].endswith("bubblewrap umoci util-linux"), calls
    assert calls[-2:] == ["python -m pip install -e .[test,tpu]", f"cwd {ROOT}"], calls


def test_setup_as_root_with_the_tools_installs_only_the_package(tmp_path):
    p, calls = _setup(tmp_path, uid=0, tools=True)
    assert p.returncode == 0, p.stderr
    assert not any(c.startswith(("apt-get", "sudo")) for c in calls), calls
    assert "python -m pip install -e ." in calls


def test_setup_without_sudo_says_what_to_install(tmp_path):
    p, calls = _setup(tmp_path, sudo=False)
    assert p.returncode != 0
    assert "bubblewrap umoci util-linux" in p.stderr and "no sudo" in p.stderr
    assert not any(c.startswith("python") for c in calls)


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, n_group=2, topk_group=1,
            num_mtp_layers=1, dtype="float32")

CHECK = """
import json, sys
import numpy as np
from flax import nnx
import coder, configs
from configs.base import model_config, get_config
from configs import quickstart
from coder.model.hf_import import load_hf

assert quickstart.get_config().stages[0] == "pretrain"
cfg, model = load_hf(sys.argv[1])
flat = {str(k): float(np.asarray(v.get_value()).astype(np.float64).sum())
        for k, v in nnx.to_flat_state(nnx.state(model))}
print(json.dumps(dict(coder=coder.__file__, configs=configs.__file__, hidden=cfg.hidden_size,
                      defaults=model_config().hidden_size, sums=flat)))
"""


@pytest.mark.slow
def test_pip_install_outside_the_checkout(tmp_path):
    """`pip install .` (not editable) into a fresh venv; from another directory `configs` and
    `coder` are the installed copies and load_hf reads a checkpoint save_hf wrote."""
    import numpy as np
    from flax import nnx

    from coder.model import Transformer, hf_export
    from configs.base import model_config

    cfg = model_config()
    cfg.update(TINY)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    ckpt = tmp_path / "hf"
    hf_export.save_hf(cfg, model, str(ckpt))
    want = {str(k): float(np.asarray(v.get_value()).astype(np.float64).sum())
            for k, v in nnx.to_flat_state(nnx.state(model))}

    # A copy of the sources (the build writes build/ and *.egg-info next to setup.py).
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("coder", "configs"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=ignore)
    shutil.copy(os.path.join(ROOT, "setup.py"), src / "setup.py")
    # A venv of its own whose only other packages are this environment's (a .pth line: its
    # dependencies, and the pip / setuptools that build the wheel, pinned by the `test` extra):
    # never the base interpreter's site-packages, which on a fresh machine hold neither jax nor
    # a setuptools that can build a wheel. A path from a .pth file is not a site directory, so
    # an editable coder install there (its finder is a .pth of its own) stays inactive; the
    # venv's copy must win, which the check below proves with coder.__file__.
    import site
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpython = str(venv / "bin" / "python")
    vsite = subprocess.run([vpython, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, capture_output=True, text=True).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                          *site.getsitepackages()])
    with open(os.path.join(vsite, "outer-env.pth"), "w") as f:
        f.write("".join(f"{d}\n" for d in ours if os.path.isdir(d)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "elsewhere"
    out.mkdir()
    p = subprocess.run([vpython, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation",
                        str(src)], cwd=str(out), env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]

    p = subprocess.run([vpython, "-c", CHECK, str(ckpt)], cwd=str(out), env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for pkg in ("coder", "configs"):
        assert got[pkg].startswith(str(venv)), got[pkg]  # not the checkout, not the editable install
        assert not got[pkg].startswith(ROOT)
    assert got["hidden"] == TINY["hidden_size"] and got["defaults"] == model_config().hidden_size
    assert got["sums"].keys() == want.keys()
    for k in want:
        assert got["sums"][k] == pytest.approx(want[k], rel=1e-6, abs=1e-6), k


def _requirements() -> dict[str, list[str]]:
    """setup.py's install_requires ("") and extras_require, read from its source."""
    import ast

    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return {"": kw["install_requires"], **kw["extras_require"]}


def test_every_remote_store_has_its_filesystem_installed_by_some_extra():
    """The stores the docs name (gs://, s3://: the seed's weight deltas in an S3 bucket) open
    through fsspec, whose implementation for each is a package of its own (gcsfs, s3fs)."""
    from fsspec.registry import known_implementations

    names = {re.split(r"[<>=!\[ ;]", r, maxsplit=1)[0].lower() for reqs in _requirements().values() for r in reqs}
    for protocol in ("gs", "s3"):
        package = known_implementations[protocol]["class"].split(".")[0]
        assert package in names, f"{protocol}:// needs {package}, which neither install_requires nor an extra installs"
