#!/usr/bin/env bash
# The one GPU check as one call on a machine with one GPU, an installed CUDA torch and no package index:
#
#   benchmarks/gpu_check.sh WHEELHOUSE [OUT_DIR]
#
# 1. `./launch.sh setup --offline WHEELHOUSE` around the environment's torch ($PYTHON, by default the machine's
#    /opt/torch/.venv/bin/python3 where it exists; PRETRAIN_TORCH=system is implied), its log in OUT_DIR/setup.log;
#    quick when .venv is already set up from this wheelhouse (setup is idempotent: a second call on a warm machine);
# 2. `./launch.sh bench --gpu --json --results OUT_DIR` (benchmarks/gpu_check.py): the JSON in OUT_DIR/gpu-check.json,
#    its progress in OUT_DIR/gpu-check.log and each item's result as soon as it ends in OUT_DIR/gpu-check-items.json
#    (what a call cut short by the machine's time limit still brings back), the results file OUT_DIR/<date>-<gpu>.md
#    (copy it to benchmarks/results/); nvidia-smi's view in OUT_DIR/nvidia-smi.txt. Each command is given 240 s.
#
# OUT_DIR defaults to $OUT (what the device tool brings back), else .cache/gpu-check. Exit status: bench's (0: every
# item passed or is not applicable, 1: an item failed), or setup's when it failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELHOUSE="${1:?usage: benchmarks/gpu_check.sh WHEELHOUSE [OUT_DIR]}"
OUT_DIR="${2:-${OUT:-$ROOT/.cache/gpu-check}}"
if [[ -z "${PYTHON:-}" && -x /opt/torch/.venv/bin/python3 ]]; then
  export PYTHON=/opt/torch/.venv/bin/python3
fi
mkdir -p "$OUT_DIR"
cd "$ROOT"
t0=$(date +%s)
./launch.sh setup --offline "$WHEELHOUSE" >"$OUT_DIR/setup.log" 2>&1 || {
  rc=$?  # (setup's status: after `if ! cmd`, $? would be the negation's, 0)
  tail -20 "$OUT_DIR/setup.log" >&2
  echo "[gpu-check] setup --offline failed (exit $rc): $OUT_DIR/setup.log" >&2
  exit "$rc"
}
echo "[gpu-check] setup: $(($(date +%s) - t0)) s" | tee -a "$OUT_DIR/gpu-check.log" >&2
nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1 || true
t1=$(date +%s)
./launch.sh bench --gpu --json --timeout 240 --results "$OUT_DIR" >"$OUT_DIR/gpu-check.json" 2>>"$OUT_DIR/gpu-check.log"
rc=$?
echo "[gpu-check] bench --gpu: $(($(date +%s) - t1)) s, exit $rc" | tee -a "$OUT_DIR/gpu-check.log" >&2
grep '^\[bench\] gpu check: [a-z_0-9]*: ' "$OUT_DIR/gpu-check.log" >&2 || tail -30 "$OUT_DIR/gpu-check.log" >&2
exit "$rc"
