#!/usr/bin/env bash
# Install coder on this machine, from a fresh checkout:
#   1. the system packages the env sandbox needs (coder/env/runtime/sandbox.py), with apt-get when a tool
#      is missing (sudo when not root): bubblewrap (bwrap), util-linux (setpriv, prlimit) and
#      umoci (tasks whose environment is an OCI image, coder/env/runtime/images.py);
#   2. the package itself, editable: `pip install -e .`, or `pip install -e ".[EXTRAS]"`.
#
#   bash scripts/setup.sh            # what `python main.py --config=configs/quickstart.py` needs
#   bash scripts/setup.sh test,tpu   # + the test extras (what .ci/run and the README's tests use)
#
# PYTHON=/path/to/python selects the interpreter (default: `python` on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
extras="${extras#.}"; extras="${extras#[}"; extras="${extras%]}"  # "test", "[test]", ".[test]"
PYTHON="${PYTHON:-python}"

# --- system packages ---------------------------------------------------------------------------
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v umoci >/dev/null 2>&1 || missing+=(umoci)  # OCI image environments (coder/env/runtime/images.py)
{ command -v setpriv >/dev/null 2>&1 && command -v prlimit >/dev/null 2>&1; } || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "setup: coder needs the system packages ${missing[*]} (bwrap, setpriv, prlimit, umoci);" \
           "not root and no sudo: install them as root, then re-run this script" >&2
      exit 1
    fi
    SUDO="sudo"
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: coder needs the system packages ${missing[*]} (bwrap, setpriv, prlimit, umoci);" \
         "no apt-get here: install them with this system's package manager, then re-run" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]} (apt-get)"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
for tool in bwrap setpriv prlimit umoci; do
  command -v "$tool" >/dev/null 2>&1 || { echo "setup: $tool is still not on PATH" >&2; exit 1; }
done
# bwrap needs user / pid namespaces (some containers forbid them): say so now, not in the sft stage.
if ! bwrap --unshare-all --die-with-parent --ro-bind / / --proc /proc --dev /dev true 2>/tmp/coder-bwrap-check.$$; then
  echo "setup: warning: bwrap is installed but cannot create a sandbox here" \
       "($(head -c 300 /tmp/coder-bwrap-check.$$)); the sft / grpo / eval stages need it" >&2
fi
rm -f /tmp/coder-bwrap-check.$$

# --- the package -------------------------------------------------------------------------------
spec="."
[ -n "$extras" ] && spec=".[$extras]"
echo "setup: $PYTHON -m pip install -e \"$spec\""
"$PYTHON" -m pip install -e "$spec"
