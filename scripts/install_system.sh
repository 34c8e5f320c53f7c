#!/usr/bin/env bash
# System packages coder needs beyond pip: bubblewrap (the env sandbox) and util-linux's
# setpriv / prlimit (the sandbox drops to an unprivileged uid and sets rlimits with them).
set -euo pipefail
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
{ command -v setpriv >/dev/null 2>&1 && command -v prlimit >/dev/null 2>&1; } || missing+=(util-linux)
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if command -v apt-get >/dev/null 2>&1; then
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q "${missing[@]}"
else
  echo "coder needs these system packages: ${missing[*]} (bwrap, setpriv, prlimit); install them" >&2
  exit 1
fi
