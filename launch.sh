#!/usr/bin/env bash
# Thin launcher: ensures .venv (idempotent setup), then runs `python -m pretrain "$@"`.
#   ./launch.sh setup        create/update .venv
#   ./launch.sh test [ARGS]  setup, then pytest (ARGS are passed to pytest)
#   ./launch.sh CMD ...      setup, then python -m pretrain CMD ...   (train, resume, runs, bench, ...)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

# Quiet, local-only defaults for the whole stack (users may override any of them).
export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
export DS_BUILD_OPS="${DS_BUILD_OPS:-0}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

setup() {
  local stamp="$VENV/.requirements.sha256"
  local want
  want="$(cat "$ROOT/requirements-torch.txt" "$ROOT/requirements.txt" | sha256sum | cut -d' ' -f1)"
  if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    return 0
  fi
  echo "[setup] creating/updating $VENV (pinned stack; first time takes ~2 minutes)" >&2
  local t0=$SECONDS
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  # torch first and exactly pinned: otherwise a dependency pulls the multi-GB CUDA build.
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/requirements-torch.txt"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/requirements-torch.txt" -r "$ROOT/requirements.txt"
  # DeepSpeed compiles a small CPU shared-memory comm op at its first init (~40 s): do it now, cached.
  "$VENV/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 \
    || echo "[setup] note: DeepSpeed shm op prebuild failed; it is built (or skipped) at first use" >&2
  echo "$want" >"$stamp"
  echo "[setup] done in $((SECONDS - t0)) s" >&2
}

cmd="${1:-train}"
case "$cmd" in
  setup)
    setup ;;
  test)
    shift || true
    setup
    cd "$ROOT"
    export HF_HUB_OFFLINE=1
    exec "$VENV/bin/python" -m pytest "$@" ;;
  *)
    setup
    [[ $# -gt 0 ]] && shift
    exec "$VENV/bin/python" -m pretrain "$cmd" "$@" ;;
esac
