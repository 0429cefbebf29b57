#!/usr/bin/env bash
# Create the project's virtual environment (.venv) and install everything bionemo-export needs
# on a CPU-only Debian 12 host: PyTorch (local CPU build), the embedded tritonserver from
# nvidia-pytriton, tritonclient's perf_analyzer, ONNX/ONNX Runtime and Triton Model Navigator.
#
# It installs requirements/lock.txt with uv (scripts/uv.sh): every package at an exact version, each
# file checked against the lock's sha256 hashes, and nothing else (a package the lock does not list
# is removed).
# `make lock` (scripts/lock.sh) refreshes the lock from requirements/runtime.txt and constraints.txt.
#
# Safe to run again: when the lock has not changed since the last successful run and the
# environment still imports, it does nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BIONEMO_EXPORT_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
LOCK="$ROOT/requirements/lock.txt"
STAMP="$VENV/.bionemo-export-setup"

log() { printf '[setup] %s\n' "$*"; }

# What the environment is built from; a change to any of these re-runs the install.
fingerprint() {
  cat "$LOCK" "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" "$ROOT/scripts/uv.sh" | sha256sum | cut -d' ' -f1
}

# Debian packages: libb64-0d (perf_analyzer from the tritonclient wheel links it) and qemu-user
# (`qemu-x86_64 -cpu Haswell`: the tests run int8 graphs on an emulated AVX2-only CPU, whatever
# this host's CPU is).
ensure_debian_packages() {
  local missing=()
  ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d' || missing+=(libb64-0d)
  command -v qemu-x86_64 >/dev/null 2>&1 || missing+=(qemu-user)
  if [ ${#missing[@]} -eq 0 ]; then return; fi
  log "installing the Debian packages ${missing[*]} (perf_analyzer's libb64; qemu-user for the AVX2-only int8 tests)"
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

environment_ok() {
  [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(fingerprint)" ] &&
    "$VENV/bin/python" -c "import torch, tritonclient.grpc, onnxruntime, model_navigator, bionemo_export" 2>/dev/null
}

ensure_debian_packages
if environment_ok; then
  log "environment up to date: $VENV"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# Every package at the lock's version (torch: the local CPU build, found through pip.conf's
# find-links), each file checked against the lock's hashes, and nothing else: `uv pip sync`
# installs exactly the lock (no requirement of a package is added: the lock is the whole
# environment, including triton-model-navigator, rxnfp and kserve, which are locked without their
# requirements; requirements/runtime.txt says why) and removes any package it does not list
# (tests/unit/test_lock.py checks the environment is the lock). uv installs in parallel: a fresh
# environment in about 15 s here, where pip took 3 minutes.
# --compile-bytecode: uv, unlike pip, installs no .pyc files, and these hosts set
# PYTHONDONTWRITEBYTECODE=1, so Python never caches them either: every process compiled each
# module it imported, again and again (importing the package's model code cost 7.3 s of CPU
# instead of 3.8 s, and a test run starts hundreds of Python processes). Compiling once here costs
# about 27 s of CPU (measured in a clean clone); Python reads .pyc files whatever PYTHONDONTWRITEBYTECODE says.
# shellcheck source=scripts/uv.sh
source "$ROOT/scripts/uv.sh"
log "installing requirements/lock.txt ($(grep -c '^[A-Za-z0-9]' "$LOCK") packages, exact versions and hashes)"
"$UV" pip sync --quiet --compile-bytecode --python "$VENV/bin/python" --require-hashes "${UV_SOURCES[@]}" "$LOCK"

log "installing bionemo-export (editable)"
"$UV" pip install --quiet --python "$VENV/bin/python" --no-deps --no-build-isolation -e "$ROOT"

fingerprint >"$STAMP"
log "done: activate with 'source $VENV/bin/activate' or run $VENV/bin/bionemo-export"
