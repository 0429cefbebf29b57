#!/usr/bin/env bash
# Create the project's virtual environment (.venv) and install everything bionemo-export needs
# on a CPU-only Debian 12 host: PyTorch (local CPU build), the embedded tritonserver from
# nvidia-pytriton, tritonclient's perf_analyzer, ONNX/ONNX Runtime and Triton Model Navigator.
#
# Safe to run again: when the requirements have not changed since the last successful run and
# the environment still imports, it does nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BIONEMO_EXPORT_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
NAVIGATOR_VERSION="0.14.0"
STAMP="$VENV/.bionemo-export-setup"

log() { printf '[setup] %s\n' "$*"; }

# What the environment is built from; a change to any of these re-runs the install.
fingerprint() {
  cat "$ROOT/requirements/constraints.txt" "$ROOT/requirements/runtime.txt" "$ROOT/pyproject.toml" \
    "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1
}

# perf_analyzer from the tritonclient wheel links libb64 (Debian package libb64-0d).
ensure_libb64() {
  if ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then return; fi
  log "installing the Debian package libb64-0d (needed by perf_analyzer)"
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libb64-0d >/dev/null
}

environment_ok() {
  [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(fingerprint)" ] &&
    "$VENV/bin/python" -c "import torch, tritonclient.grpc, onnxruntime, model_navigator, bionemo_export" 2>/dev/null
}

ensure_libb64
if environment_ok; then
  log "environment up to date: $VENV"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# This host's pip.conf lists local index folders that lack most packages; pip warns once per
# package. Keep the log readable by dropping exactly that warning.
pip_quiet() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip_quiet install -q --upgrade pip setuptools wheel

log "installing requirements (torch pinned to the local CPU build; first run takes a few minutes)"
pip_quiet install -q -c "$ROOT/requirements/constraints.txt" -r "$ROOT/requirements/runtime.txt"

log "installing Triton Model Navigator $NAVIGATOR_VERSION without its tensorrt requirement"
pip_quiet install -q --no-deps -c "$ROOT/requirements/constraints.txt" "triton-model-navigator==$NAVIGATOR_VERSION"

# rxnfp ships a real pretrained SMILES BERT (read as files, never imported); its own pins (scipy
# 1.4, scikit-learn 0.23) do not build on Python 3.11, and nothing of it but the weights is used.
log "installing rxnfp $(grep -o 'rxnfp==[0-9.]*' "$ROOT/requirements/constraints.txt") without its dependencies (for its weights)"
pip_quiet install -q --no-deps -c "$ROOT/requirements/constraints.txt" rxnfp

# The KServe SDK's API types validate the InferenceService `deploy k8s` writes (tests); its own
# requirements would replace protobuf with 6.x and add a web-server stack nothing here uses.
log "installing the KServe SDK $(grep -o 'kserve==[0-9.]*' "$ROOT/requirements/constraints.txt") without its dependencies (tests)"
pip_quiet install -q --no-deps -c "$ROOT/requirements/constraints.txt" kserve

log "installing bionemo-export (editable)"
pip_quiet install -q --no-deps --no-build-isolation -e "$ROOT"

fingerprint >"$STAMP"
log "done: activate with 'source $VENV/bin/activate' or run $VENV/bin/bionemo-export"
