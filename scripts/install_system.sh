#!/usr/bin/env bash
# System packages coder needs beyond pip: bubblewrap (the env sandbox).
set -euo pipefail
if command -v bwrap >/dev/null 2>&1; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if command -v apt-get >/dev/null 2>&1; then
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q bubblewrap
else
  echo "coder needs bubblewrap (bwrap): install your distribution's 'bubblewrap' package" >&2
  exit 1
fi
