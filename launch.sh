#!/usr/bin/env bash
# Thin launcher: ensures .venv (idempotent setup), then runs `python -m pretrain "$@"`.
#   ./launch.sh setup        create/update .venv: exactly one lock (uv, hash-checked) + this project (editable, no deps):
#                            requirements-cuda.lock on a machine with an NVIDIA driver, else requirements.lock (CPU
#                            torch); PRETRAIN_TORCH=cuda|cpu forces either
#   ./launch.sh lock         re-resolve both locks from requirements-torch.txt + requirements.txt (same versions)
#   ./launch.sh lint         setup, then ruff (lint + format check) and mypy, configured in pyproject.toml
#   ./launch.sh test [ARGS]  setup, lint, then pytest (ARGS are passed to pytest)
#   ./launch.sh CMD ...      setup, then python -m pretrain CMD ...   (train, resume, runs, bench, ...)
#   ./launch.sh [help]       setup, then this usage: python -m pretrain --help and these lines (also -h, --help)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
LOCK="$ROOT/requirements.lock"             # CPU torch (this machine's +cpu wheel, pip's find-links)
CUDA_LOCK="$ROOT/requirements-cuda.lock"   # the same versions, torch's default (CUDA) build from the package index
UV_VERSION="0.13.9"   # the installer; fetched with pip, hash-checked against its entry in requirements.lock

# Quiet, local-only defaults for the whole stack (users may override any of them).
export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
export DS_BUILD_OPS="${DS_BUILD_OPS:-0}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
# The project is installed into the venv (editable); PYTHONPATH still puts this checkout first, so that its
# launch.sh runs its own code even through a venv that another checkout of the project installed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

inputs_hash() {  # what requirements.lock was resolved from (recorded in its first line)
  cat "$ROOT/requirements-torch.txt" "$ROOT/requirements.txt" | sha256sum | cut -d' ' -f1
}

ensure_uv() {  # sets UV: uv $UV_VERSION, fetched once per user with this Python's pip and its package index
  local dir="${XDG_CACHE_HOME:-$HOME/.cache}/pretrain/uv-$UV_VERSION"
  UV="$dir/uv"
  [[ -x "$UV" ]] && return 0
  if command -v uv >/dev/null && [[ "$(uv --version 2>/dev/null) " == "uv $UV_VERSION "* ]]; then
    UV="$(command -v uv)"; return 0
  fi
  local tmp hashes=(--require-hashes)
  tmp="$(mktemp -d)"
  # The pin with its hashes, from the lock (pip checks the wheel against them); version-only before the first lock.
  sed -n "/^uv==${UV_VERSION//./\\.} /,/[^\\\\]\$/p" "$LOCK" 2>/dev/null >"$tmp/uv.txt" || true
  [[ -s "$tmp/uv.txt" ]] || { echo "uv==$UV_VERSION" >"$tmp/uv.txt"; hashes=(); }
  if ! "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "${hashes[@]}" \
       -d "$tmp" -r "$tmp/uv.txt" >"$tmp/log" 2>&1; then
    cat "$tmp/log" >&2
    echo "[setup] error: could not fetch uv==$UV_VERSION with '$PY -m pip' (or put uv $UV_VERSION on PATH)" >&2
    exit 1
  fi
  "$PY" - "$tmp" "$dir" <<'PYEOF'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1:]
(wheel,) = glob.glob(os.path.join(tmp, "uv-*.whl"))
os.makedirs(dest, exist_ok=True)
part = os.path.join(dest, f".uv.{os.getpid()}")
with zipfile.ZipFile(wheel) as z, z.open(next(n for n in z.namelist() if n.endswith(".data/scripts/uv"))) as src:
    with open(part, "wb") as out:
        shutil.copyfileobj(src, out)
os.chmod(part, 0o755)
os.replace(part, os.path.join(dest, "uv"))  # atomic: concurrent setups of other clones are fine
PYEOF
  rm -rf "$tmp"
}

uv_sources() {  # $1=all|lock|cuda|cuda-lock. uv reads no pip configuration: pass it the package sources pip uses
  # here (pip.conf files, PIP_* variables). "lock" leaves out extra indexes (local mirrors), so that the lock records
  # the main index's hashes of every file; find-links stays (this machine's CPU torch wheel). The cuda kinds leave out
  # find-links: torch==X also matches a local X+cpu wheel there, and the CUDA lock wants the index's default build.
  # Skipped if UV_* are set.
  [[ -n "${UV_INDEX_URL:-}${UV_DEFAULT_INDEX:-}${UV_INDEX:-}${UV_EXTRA_INDEX_URL:-}${UV_FIND_LINKS:-}" ]] && return 0
  "$PY" - "$1" <<'PYEOF'
import ast, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
conf = {}
for line in out.splitlines():
    key, _, value = line.partition("=")
    try:
        conf[key] = ast.literal_eval(value)
    except (SyntaxError, ValueError):
        pass
def get(name):  # pip's precedence: PIP_* variables, then [install], then [global]
    for section in (":env:", "install", "global"):
        if f"{section}.{name}" in conf:
            return str(conf[f"{section}.{name}"]).split()
    return []
names = {"all": ["index-url", "find-links", "extra-index-url"], "lock": ["index-url", "find-links"],
         "cuda": ["index-url", "extra-index-url"], "cuda-lock": ["index-url"]}[sys.argv[1]]
for name in names:
    for value in get(name):
        print(f"--{name}={value}")
for value in get("cert")[:1]:
    print(f"SSL_CERT_FILE={value}")  # pip's CA bundle (uv otherwise uses its own roots)
PYEOF
}

run_uv() {  # run_uv SOURCES ARGS... (SOURCES: see uv_sources): uv with pip's package sources and CA bundle
  local kind="$1" line args=() env=()
  shift
  while IFS= read -r line; do
    if [[ "$line" == SSL_CERT_FILE=* ]]; then [[ -n "${SSL_CERT_FILE:-}" ]] || env=("$line"); else args+=("$line"); fi
  done < <(uv_sources "$kind")
  env ${env[@]+"${env[@]}"} UV_PYTHON_DOWNLOADS=never "$UV" "$@" --index-strategy unsafe-best-match ${args[@]+"${args[@]}"}
}

compile_lock() {  # compile_lock SOURCES OUT EXTRA INPUT...: a hash-checked lock of INPUT files + uv's pin + EXTRA
  local sources="$1" out="$2" extra="$3" tmp="$2.tmp.$$"
  shift 3
  # Start from the current lock: uv keeps its pins unless the inputs need others (pip-tools' semantics), so a new
  # lock changes only what changed.
  [[ -f "$out" ]] && cp "$out" "$tmp"
  printf 'uv==%s\n%s' "$UV_VERSION" "$extra" | run_uv "$sources" pip compile -q --generate-hashes --python "$PY" \
    --custom-compile-command "./launch.sh lock" "$@" - -o "$tmp"
  { echo "# inputs-sha256: $(inputs_hash) (requirements-torch.txt + requirements.txt; setup warns when they differ)"
    echo "# plus uv==$UV_VERSION: launch.sh's installer (its UV_VERSION), hash-checked when setup fetches it"
    grep -v '^# \(inputs-sha256\|plus uv==\)' "$tmp"; } >"$tmp.full"
  mv "$tmp.full" "$out"  # atomic: a concurrent setup never syncs a half-written lock
  rm -f "$tmp"
  echo "[lock] wrote $out ($(grep -c '^[A-Za-z0-9]' "$out") packages)" >&2
}

lock() {
  ensure_uv
  local torch tmp
  # CPU: torch is pinned to this machine's CPU build (requirements-torch.txt), so no CUDA wheels get into this lock.
  compile_lock lock "$LOCK" "" "$ROOT/requirements-torch.txt" "$ROOT/requirements.txt"
  # CUDA: the same torch version without its local tag, from the main index only (its default Linux wheel is the
  # CUDA build, with its nvidia-* dependencies); every package the CPU lock has is constrained to its version there.
  torch="$(sed -n 's/^\(torch==[^+ ]*\)+cpu.*/\1/p' "$ROOT/requirements-torch.txt")"
  [[ -n "$torch" ]] || { echo "[lock] error: requirements-torch.txt pins no torch==VERSION+cpu" >&2; exit 1; }
  tmp="$(mktemp -d)"
  sed -n 's/^\([A-Za-z0-9][A-Za-z0-9._-]*==[^ ]*\) .*/\1/p' "$LOCK" | grep -v '^torch==' >"$tmp/shared.txt"
  compile_lock cuda-lock "$CUDA_LOCK" "$torch" "$ROOT/requirements.txt" -c "$tmp/shared.txt"
  sed -i "s#-c $tmp/shared.txt#-c requirements.lock (its versions)#" "$CUDA_LOCK"  # the same text on every lock
  rm -rf "$tmp"
  echo "[lock] ./launch.sh setup installs one of them (PRETRAIN_TORCH=cuda|cpu, default: cuda with an NVIDIA driver)" >&2
}

torch_kind() {  # cpu|cuda: PRETRAIN_TORCH, else cuda on a machine with an NVIDIA driver
  case "${PRETRAIN_TORCH:-}" in
    cpu|cuda) echo "$PRETRAIN_TORCH" ;;
    "") if [[ -e /proc/driver/nvidia/version ]] || command -v nvidia-smi >/dev/null; then echo cuda; else echo cpu; fi ;;
    *) echo "[setup] error: PRETRAIN_TORCH must be cuda or cpu, got '$PRETRAIN_TORCH'" >&2; return 2 ;;
  esac
}

setup() {
  # The stamp records which lock (name, sha256) and which pyproject.toml the venv was made from.
  local stamp="$VENV/.pretrain-setup" kind lock want_lock want_project
  kind="$(torch_kind)" || exit 2
  lock="$LOCK"
  [[ "$kind" == cuda ]] && lock="$CUDA_LOCK"
  [[ -f "$lock" ]] || { echo "[setup] error: $lock is missing: ./launch.sh lock" >&2; exit 1; }
  want_lock="$(basename "$lock") sha256=$(sha256sum "$lock" | cut -d' ' -f1)"
  want_project="pyproject.toml sha256=$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
  grep -q "^# inputs-sha256: $(inputs_hash) " "$lock" \
    || echo "[setup] warning: requirements*.txt changed since $(basename "$lock") was made (setup installs the lock): ./launch.sh lock" >&2
  if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want_lock"$'\n'"$want_project" ]]; then
    return 0
  fi
  local t0=$SECONDS
  ensure_uv
  if [[ ! -x "$VENV/bin/python" || ! -f "$stamp" || "$(head -n1 "$stamp")" != "$want_lock" ]]; then
    echo "[setup] creating/updating $VENV from $(basename "$lock") ($kind torch; first time takes under a minute)" >&2
    [[ -x "$VENV/bin/python" ]] || UV_PYTHON_DOWNLOADS=never "$UV" venv -q --clear --python "$PY" "$VENV"
    # Exactly the lock (extraneous packages removed), every file hash-checked, sdist builds (deepspeed) with the
    # lock's setuptools; wheels come from uv's user-level cache (~/.cache/uv) when there. Bytecode compiled now like
    # pip does: with PYTHONDONTWRITEBYTECODE set, every process would otherwise recompile what it imports.
    run_uv "$([[ "$kind" == cuda ]] && echo cuda || echo all)" pip sync -q --python "$VENV/bin/python" \
      --require-hashes --compile-bytecode --build-constraints "$lock" "$lock"
  fi
  # This project, editable and without dependencies (the lock has them), built by the lock's setuptools: the
  # `pretrain` command, and the packages importable by any process of this venv (Ray workers need no PYTHONPATH).
  run_uv all pip install -q --python "$VENV/bin/python" --no-deps --no-build-isolation -e "$ROOT"
  printf '%s\n%s\n' "$want_lock" "$want_project" >"$stamp"
  sha256sum "$lock" | cut -d' ' -f1 >"$VENV/.requirements.sha256"  # the lock's sha256 alone: a second, simpler stamp
  [[ "$kind" == cpu ]] || { echo "[setup] done in $((SECONDS - t0)) s" >&2; return 0; }
  # DeepSpeed JIT-builds a small CPU shared-memory comm op at its first init (tens of CPU-seconds). Build it now
  # in the background, detached, cached in $TORCH_EXTENSIONS_DIR: a DeepSpeed init that comes first waits for
  # it (torch's lock file in the build directory) rather than building it again; if it fails, DeepSpeed builds it (or
  # falls back to gloo) at first use. SIGTERM still releases that lock; after a kill -9 mid-build, delete the
  # leftover .cache/torch_extensions/deepspeed_shm_comm/lock (torch would wait on it forever). Not with the CUDA
  # lock: GPUs communicate through NCCL, and a container build (Dockerfile) would kill it mid-build.
  mkdir -p "$ROOT/.cache"
  local detach=()
  command -v setsid >/dev/null && detach=(setsid)
  ${detach[@]+"${detach[@]}"} nohup "$VENV/bin/python" -c "import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
from deepspeed.comm.torch import build_shm_op
build_shm_op()" </dev/null >"$ROOT/.cache/deepspeed-shm-op.log" 2>&1 &
  echo "[setup] done in $((SECONDS - t0)) s (DeepSpeed's CPU comm op builds in the background: .cache/deepspeed-shm-op.log)" >&2
}

lint() {  # ruff (lint + format) and mypy over the repository, as configured in pyproject.toml; exit 1 on a finding
  cd "$ROOT"
  local t0=$SECONDS
  "$VENV/bin/ruff" check --quiet . || { echo "[lint] ruff check failed (fix: .venv/bin/ruff check --fix .)" >&2; exit 1; }
  "$VENV/bin/ruff" format --check --quiet . \
    || { echo "[lint] ruff format: files above need formatting (fix: .venv/bin/ruff format .)" >&2; exit 1; }
  "$VENV/bin/mypy" || { echo "[lint] mypy failed" >&2; exit 1; }
  echo "[lint] ruff and mypy clean in $((SECONDS - t0)) s" >&2
}

usage() {  # python -m pretrain --help (every command), then this launcher's own commands (the header above)
  "$VENV/bin/python" -m pretrain --help
  echo "launch.sh: the commands above set up .venv first (idempotent), then run python -m pretrain CMD; its own:"
  sed -n 's/^#   /  /p' "$ROOT/launch.sh"
}

cmd="${1:-help}"
case "$cmd" in
  help|-h|--help)
    setup
    usage ;;
  setup)
    setup ;;
  lock)
    lock ;;
  lint)
    setup
    lint ;;
  test)
    shift || true
    setup
    lint
    cd "$ROOT"
    export HF_HUB_OFFLINE=1
    exec "$VENV/bin/python" -m pytest "$@" ;;
  *)
    setup
    [[ $# -gt 0 ]] && shift
    exec "$VENV/bin/python" -m pretrain "$cmd" "$@" ;;
esac
