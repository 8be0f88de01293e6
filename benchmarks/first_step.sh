#!/usr/bin/env bash
# The first step of `train` on a brand-new machine right after setup, as far as one machine can make one: the page
# cache dropped (as root; else said), an empty user cache (no tokenizer, no MLflow store template), empty torch
# extensions with setup's background comm-op build started just before (nice 19), a new working directory.
#   benchmarks/first_step.sh [CHECKOUT ...]   each checkout (default: this one) in turn, with this venv's Python;
#                                             prints the command's start-up phases and its wall time
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[[ $# -gt 0 ]] || set -- "$ROOT"
for code in "$@"; do
  work="$(mktemp -d)"
  sync
  if ! { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null; then echo "(page cache not dropped: not root)"; fi
  export TORCH_EXTENSIONS_DIR="$work/ext" PRETRAIN_CACHE="$work/cache" PYTHONPATH="$code"
  setsid nice -n 19 "$PY" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >"$work/shm.log" 2>&1 &
  build=$!
  start=$(date +%s.%N)
  (cd "$work" && "$PY" -m pretrain train train.max_steps=2 >"$work/out.txt" 2>&1)
  end=$(date +%s.%N)
  echo "$code ($(git -C "$code" rev-parse --short HEAD)): $(grep -o 'first step.*' "$work/out.txt"); command $(
    awk "BEGIN {printf \"%.1f\", $end - $start}") s"
  kill -- -"$build" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
done
