#!/usr/bin/env bash
# Thin launcher: ensures .venv (idempotent setup), then runs `python -m pretrain "$@"`.
#   ./launch.sh setup        create/update .venv: exactly one lock (uv, hash-checked) + this project (editable, no deps):
#                            requirements-cuda.lock on a machine with an NVIDIA driver, else requirements.lock (CPU
#                            torch); PRETRAIN_TORCH=cuda|cpu forces either. PRETRAIN_TORCH=system (the default where
#                            $PYTHON has a CUDA torch): keep that torch, install the rest of requirements.lock around it
#   ./launch.sh setup --offline DIR   the same around the environment's torch, from a wheelhouse, with no network
#   ./launch.sh wheelhouse DIR [--python X.Y] [--platform TAG] [--without ray,dev] [--environment FILE]   the wheels
#                            setup --offline needs; FILE (the target's pip list --format=freeze): only what it lacks
#   ./launch.sh lock         re-resolve both locks from requirements-torch.txt + requirements.txt (same versions)
#   ./launch.sh lint         setup, then ruff (lint + format check) and mypy, configured in pyproject.toml
#   ./launch.sh test [ARGS]  setup, lint, then pytest (ARGS are passed to pytest; its help: .venv/bin/pytest -h)
#   ./launch.sh CMD ...      setup, then python -m pretrain CMD ...   (train, resume, runs, bench, ...)
#   ./launch.sh [help]       setup, then this usage: python -m pretrain --help and these lines (also -h, --help)
set -euo pipefail
unset CDPATH  # with it set, cd prints the directory it found, and $(cd DIR && pwd) would hold two lines
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
# What setup was given or chose (the interpreter, the torch: cpu|cuda|system), kept with the venv: a later setup
# that sets neither PYTHON nor PRETRAIN_TORCH keeps them as its defaults, rather than deciding again from a plain
# python3 (which would reinstall another torch, or find no torch where setup kept an environment's, offline).
# (A third line, "asked", when that torch was PRETRAIN_TORCH's, not setup's own pick.)
CHOICE="$VENV/.pretrain-choice" SAVED_PY="" SAVED_KIND="" SAVED_ASKED=""
if [[ -z "${PYTHON:-}" && -z "${PRETRAIN_TORCH:-}" && -f "$CHOICE" ]]; then
  { IFS= read -r SAVED_PY || true; IFS= read -r SAVED_KIND || true; IFS= read -r SAVED_ASKED || true; } <"$CHOICE"
  [[ -x "$SAVED_PY" && "$SAVED_KIND" =~ ^(cpu|cuda|system)$ ]] || SAVED_PY="" SAVED_KIND="" SAVED_ASKED=""
fi
LOCK="$ROOT/requirements.lock"             # CPU torch (this machine's +cpu wheel, pip's find-links)
CUDA_LOCK="$ROOT/requirements-cuda.lock"   # the same versions, torch's default (CUDA) build from the package index
UV_VERSION="0.13.9"   # the installer; fetched with pip, hash-checked against its entry in requirements.lock
INSTALL="$ROOT/cluster/install.py"        # setup's Python half: the environment's torch, wheelhouses (stdlib only)

# Quiet, local-only defaults for the whole stack (users may override any of them).
export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
export DS_BUILD_OPS="${DS_BUILD_OPS:-0}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
# The project is installed into the venv (editable); PYTHONPATH still puts this checkout first, so that its
# launch.sh runs its own code even through a venv that another checkout of the project installed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The commands this one prints (the next step, the fix in an error) start with this launcher (pretrain/invocation.py).
export PRETRAIN_LAUNCHER="$ROOT/launch.sh"

inputs_hash() {  # what requirements.lock was resolved from (recorded in its first line)
  cat "$ROOT/requirements-torch.txt" "$ROOT/requirements.txt" | sha256sum | cut -d' ' -f1
}

ensure_uv() {  # [WHEELHOUSE] sets UV: uv $UV_VERSION, fetched once per user with this Python's pip and its package index
  # (or taken from the wheelhouse: no pip, no network; UV empty for a wheelhouse without one: setup uses pip)
  local dir="${XDG_CACHE_HOME:-$HOME/.cache}/pretrain/uv-$UV_VERSION"
  UV="$dir/uv"
  [[ -x "$UV" ]] && return 0
  if command -v uv >/dev/null && [[ "$(uv --version 2>/dev/null) " == "uv $UV_VERSION "* ]]; then
    UV="$(command -v uv)"; return 0
  fi
  local tmp hashes=(--require-hashes)
  tmp="$(mktemp -d)"
  # The pin with its hashes, from the lock (pip checks the wheel against them); version-only for `lock` alone, which
  # writes the pin (the first lock, or one after UV_VERSION changed): setup installs nothing with an unchecked uv.
  sed -n "/^uv==${UV_VERSION//./\\.} /,/[^\\\\]\$/p" "$LOCK" 2>/dev/null >"$tmp/uv.txt" || true
  if [[ ! -s "$tmp/uv.txt" ]]; then
    [[ -n "${LOCKING:-}" ]] || { rm -rf "$tmp"; echo "[setup] error: $(basename "$LOCK") pins no uv==$UV_VERSION with its hashes (launch.sh's UV_VERSION): ./launch.sh lock, or put uv $UV_VERSION on PATH" >&2; exit 2; }
    echo "uv==$UV_VERSION" >"$tmp/uv.txt"; hashes=()
  fi
  if [[ -n "${1:-}" ]]; then
    local wheel
    wheel="$(find "$1" -maxdepth 1 -name "uv-$UV_VERSION-*.whl" | head -n1)"
    [[ -n "$wheel" ]] || { rm -rf "$tmp"; UV=""; return 0; }  # a wheelhouse without uv: setup installs with pip
    grep -q "sha256:$(sha256sum "$wheel" | cut -d' ' -f1)" "$tmp/uv.txt" \
      || { echo "[setup] error: $1 holds no uv $UV_VERSION wheel with a sha256 of the lock's" >&2; exit 1; }
    cp "$wheel" "$tmp/"
  elif ! "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: ${hashes[@]+"${hashes[@]}"} \
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

uv_sources() {  # $1=all|lock|cuda|cuda-lock: pip's package sources (pip.conf, PIP_*) as uv's environment variables,
  # NAME=VALUE a line, and SSL_CERT_FILE=pip's CA bundle; what each kind leaves out and why: cluster/lockfile.py
  "$PY" "$INSTALL" uv-sources "$1"
}

run_uv() {  # run_uv SOURCES ARGS... (SOURCES: see uv_sources): uv with pip's package sources and CA bundle, exported
  # in a subshell (an index URL may hold credentials: never on a command line, which any local user can read)
  local kind="$1" sources
  shift
  sources="$(uv_sources "$kind")" || exit 2  # (it said why: an interpreter too old, a pip.conf it cannot read)
  (
    while IFS= read -r line; do
      [[ -z "$line" || ("$line" == SSL_CERT_FILE=* && -n "${SSL_CERT_FILE:-}") ]] || export "${line?}"
    done <<<"$sources"
    export UV_PYTHON_DOWNLOADS=never
    exec "$UV" "$@" --index-strategy unsafe-best-match
  )
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

unit_only() {  # unit_only PYTEST_ARGS...: they name tests/unit paths only, and no -n or -p (then: every core)
  local unit=1 named=0 a
  for a in "$@"; do
    case "$a" in
      -n|-n*|--numprocesses*|-p|-p*) return 1 ;;
      tests/unit|tests/unit/*) named=1 ;;
      tests|tests/*|./*|/*) unit=0 ;;
    esac
  done
  [[ $named -eq 1 && $unit -eq 1 ]]
}

lock() {
  LOCKING=1 ensure_uv
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

torch_kind() {  # [WHEELHOUSE] sets KIND=cpu|cuda|system (PRETRAIN_TORCH; else system where $PY has a CUDA torch or
  # setup is offline, cuda on a machine with an NVIDIA driver, else cpu) and, for system, TORCH="VERSION CUDA SITE_DIR"
  KIND="${PRETRAIN_TORCH:-}" TORCH=""
  [[ -n "$KIND" || -n "${1:-}" ]] || KIND="$SAVED_KIND"  # the earlier setup's choice (not forced: not offline)
  case "$KIND" in
    cpu|cuda) [[ -z "${1:-}" ]] || { echo "[setup] error: setup --offline keeps the environment's torch (a wheelhouse holds none): PRETRAIN_TORCH=$KIND contradicts it" >&2; return 2; } ;;
    system) ;;
    "") local rc=0
        [[ -n "${1:-}" ]] && KIND=system || "$PY" "$INSTALL" probe --auto "$VENV" >/dev/null || rc=$?
        if [[ -n "$KIND" || $rc -eq 0 ]]; then KIND=system
        elif [[ $rc -ne 1 ]]; then return 2  # a CUDA torch outside the supported range: probe said so
        elif [[ -e /proc/driver/nvidia/version ]] || command -v nvidia-smi >/dev/null; then KIND=cuda
        else KIND=cpu; fi ;;
    *) echo "[setup] error: PRETRAIN_TORCH must be cuda, cpu or system, got '$KIND'" >&2; return 2 ;;
  esac
  [[ "$KIND" != system ]] || TORCH="$("$PY" "$INSTALL" probe ${1:+--offline} "$VENV")" || return 2
}

driver_version() {  # [VERSION_FILE] the NVIDIA driver's version (580.65.06), '' where none is found
  # The kernel module's banner ("... Kernel Module  580.65.06 ...", or "... Open Kernel Module for x86_64  580.65.06
  # ..."): its first field that is a version; else nvidia-smi's answer when it is one (not its error text).
  local file="${1:-/proc/driver/nvidia/version}" v=""
  [[ -r "$file" ]] && v="$(head -1 "$file" | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+\.[0-9]+(\.[0-9]+)?$/) {print $i; exit}}')"
  if [[ -z "$v" ]] && command -v nvidia-smi >/dev/null; then
    v="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  fi
  [[ "$v" =~ ^[0-9]+\.[0-9]+ ]] && echo "$v" || true
}

check_cuda_driver() {  # LOCK: a driver older than the CUDA of the lock's torch needs is refused in one line (a warning
  # where PRETRAIN_TORCH=cuda asks for that lock, or asked for it at the setup whose choice this one keeps: an
  # image built on one machine runs on others; not where setup picked CUDA itself, for a driver since replaced)
  local cuda need have
  cuda="$(sed -n 's/^nvidia-cuda-runtime[a-z0-9-]*==\([0-9]*\)\..*/\1/p' "$1" | head -1)"
  case "$cuda" in 13) need=580 ;; 12) need=525 ;; *) return 0 ;; esac  # NVIDIA's minimum Linux driver per CUDA
  have="$(driver_version)"
  [[ -z "$have" || "${have%%.*}" -ge "$need" ]] && return 0
  if [[ "${PRETRAIN_TORCH:-}" == cuda || ("$SAVED_KIND" == cuda && "$SAVED_ASKED" == asked) ]]; then
    echo "[setup] warning: NVIDIA driver $have is older than $need, which the CUDA $cuda torch of $(basename "$1")" \
      "needs: torch will not see this machine's GPU (PRETRAIN_TORCH=cuda installs it anyway)" >&2
    return 0
  fi
  echo "[setup] error: NVIDIA driver $have is older than $need, which the CUDA $cuda torch of $(basename "$1") needs" \
    "(torch would not see the GPU): update the driver, or set up around a CUDA torch this driver runs" \
    "(PYTHON=/path/to/its/python PRETRAIN_TORCH=system), or PRETRAIN_TORCH=cpu" >&2
  return 2
}

remember_choice() {  # the interpreter and torch kind this setup used (CHOICE: read at the top of this script)
  local py asked="" text
  py="$("$PY" -c 'import sys; print(sys.executable)' 2>/dev/null)" && [[ -n "$py" ]] || return 0
  [[ -n "${PRETRAIN_TORCH:-}" || "$SAVED_ASKED" == asked ]] && asked="asked"
  text="$(printf '%s\n%s\n%s' "$py" "$KIND" "$asked")"
  [[ -f "$CHOICE" && "$(cat "$CHOICE")" == "$text" ]] && return 0  # commands started together all find it so
  # A name of this process's own (a concurrent command writes its own), renamed into place: readers see one whole.
  { printf '%s\n' "$text" >"$CHOICE.tmp.$$" && mv -f "$CHOICE.tmp.$$" "$CHOICE"; } 2>/dev/null || rm -f "$CHOICE.tmp.$$"
  return 0
}

setup() {  # setup [--offline WHEELHOUSE]
  # The stamp records which lock (name, sha256; the environment's torch, the wheelhouse) and which pyproject.toml the
  # venv was made from. A venv made offline stays offline: later setups install from the wheelhouse its stamp names.
  local stamp="$VENV/.pretrain-setup" lock want_lock want_project offline="" req old_stamp="" version
  [[ -z "$SAVED_PY" ]] || PY="$SAVED_PY"  # the interpreter the earlier setup used (PYTHON unset)
  version="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2]); sys.exit(sys.version_info < (3, 11))')" \
    || { echo "[setup] error: $PY is Python ${version:-(none found)}; the project needs 3.11 or later (PYTHON=/path/to/python3.11)" >&2; exit 2; }
  if [[ $# -gt 0 ]]; then
    [[ "$1" == --offline && $# -eq 2 ]] \
      || { echo "[setup] error: usage: ./launch.sh setup [--offline WHEELHOUSE_DIR]" >&2; exit 2; }
    [[ -f "$2/wheelhouse.json" ]] \
      || { echo "[setup] error: --offline $2: not a wheelhouse (no wheelhouse.json; ./launch.sh wheelhouse DIR makes one)" >&2; exit 2; }
    offline="$(cd "$2" && pwd)"
  elif [[ -f "$stamp" ]]; then
    offline="$(sed -n '1s/.* from wheelhouse //p' "$stamp")"
  fi
  torch_kind "$offline" || exit 2
  lock="$LOCK"
  [[ "$KIND" == cuda ]] && lock="$CUDA_LOCK"
  [[ -f "$lock" ]] || { echo "[setup] error: $lock is missing: ./launch.sh lock" >&2; exit 1; }
  [[ "$KIND" != cuda ]] || check_cuda_driver "$lock" || exit 2
  want_lock="$(basename "$lock") sha256=$(sha256sum "$lock" | cut -d' ' -f1) python $version"
  [[ "$KIND" == system ]] && want_lock+=" around the environment's torch $TORCH"
  [[ -n "$offline" ]] && want_lock+=" from wheelhouse $offline"
  want_project="pyproject.toml sha256=$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
  grep -q "^# inputs-sha256: $(inputs_hash) " "$lock" \
    || echo "[setup] warning: requirements*.txt changed since $(basename "$lock") was made (setup installs the lock): ./launch.sh lock" >&2
  if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want_lock"$'\n'"$want_project" ]]; then
    remember_choice
    return 0
  fi
  local t0=$SECONDS uv_offline=()
  [[ -n "$offline" ]] && uv_offline=(--offline --no-index --find-links "$offline")
  ensure_uv "$offline"
  if [[ -z "$UV" ]] && ! "$PY" -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (22, 3))' 2>/dev/null; then
    echo "[setup] error: $offline holds no uv and none of version $UV_VERSION is at hand, and $PY has no pip 22.3 or later to install with: put uv $UV_VERSION on PATH" >&2
    exit 2
  fi
  # From here the venv changes: its stamp says "incomplete" until it is whole again, so an interrupted setup is not
  # taken as done by the next command, whatever that one asks for (an offline venv's stays offline: the wheelhouse).
  [[ -f "$stamp" ]] && old_stamp="$(cat "$stamp")"
  local incomplete="incomplete${offline:+ from wheelhouse $offline}"
  if [[ -f "$VENV/pyvenv.cfg" ]]; then
    echo "$incomplete" >"$stamp"  # (a venv made below gets it once made)
  elif [[ -d "$VENV" ]]; then  # not a venv (uv clears only a venv): setup's own files alone are removed
    rm -f "$stamp" "$CHOICE"
    rmdir "$VENV" 2>/dev/null || true
  fi
  if [[ ! -x "$VENV/bin/python" || "$(head -n1 <<<"$old_stamp")" != "$want_lock" ]]; then
    echo "[setup] creating/updating $VENV from $(basename "$lock") ($([[ "$KIND" == system ]] && echo "the environment's torch ${TORCH%% *}" || echo "$KIND torch")${offline:+, offline}; first time takes under a minute)" >&2
    req="$lock"
    if [[ "$KIND" == system ]]; then  # the lock less torch and what only torch needs (and a wheelhouse's --without)
      req="$(mktemp)"
      "$PY" "$INSTALL" requirements "$LOCK" ${offline:+--wheelhouse "$offline"} >"$req" || { local rc=$?; rm -f "$req"; exit $rc; }
    fi
    local py_version='import sys; print(*sys.version_info[:2])'
    if [[ -z "$UV" ]]; then  # pip installs into a new venv (it removes no extraneous package, as uv pip sync does)
      "$PY" -m venv --clear --without-pip "$VENV"
    elif [[ ! -x "$VENV/bin/python" || "$("$VENV/bin/python" -c "$py_version")" != "$("$PY" -c "$py_version")" ]]; then
      UV_PYTHON_DOWNLOADS=never "$UV" venv -q --clear --python "$PY" "$VENV"
    fi
    echo "$incomplete" >"$stamp"
    if [[ "$KIND" == system ]]; then mv "$req" "$VENV/.pretrain-requirements.txt"; req="$VENV/.pretrain-requirements.txt"; fi
    # Exactly the lock (extraneous packages removed), every file hash-checked, sdist builds (deepspeed) with the
    # lock's setuptools; wheels come from uv's user-level cache (~/.cache/uv) when there, or only from the wheelhouse.
    # Bytecode compiled now like pip does: with PYTHONDONTWRITEBYTECODE set, every process would otherwise recompile
    # what it imports. Offline with no uv (a wheelhouse made for one environment carries none): the environment's pip,
    # into the new venv, each wheel hash-checked, nothing resolved (the wheelhouse's lock is complete).
    if [[ -z "$UV" ]]; then
      PIP_CONFIG_FILE=/dev/null "$PY" -m pip --python "$VENV/bin/python" install -q --isolated --disable-pip-version-check --no-index \
        --find-links "$offline" --no-deps --require-hashes -r "$req" || exit 1
    elif [[ -n "$offline" ]]; then
      UV_PYTHON_DOWNLOADS=never "$UV" pip sync -q --python "$VENV/bin/python" --require-hashes --compile-bytecode \
        "${uv_offline[@]}" "$req"
    else
      run_uv "$([[ "$KIND" == cuda ]] && echo cuda || echo all)" pip sync -q --python "$VENV/bin/python" \
        --require-hashes --compile-bytecode --build-constraints "$lock" "$req"
    fi
  fi
  # system: the venv sees the environment's packages after its own (a .pth file of the venv), else none of them.
  if [[ "$KIND" == system ]]; then
    "$PY" "$INSTALL" link "$VENV" "${TORCH#* * }"  # TORCH: "VERSION CUDA SITE_DIR" (a SITE_DIR may hold spaces)
  else
    rm -f "$VENV"/lib/python*/site-packages/_pretrain_environment.pth
  fi
  # This project, editable and without dependencies (the lock has them), built by the lock's setuptools: the
  # `pretrain` command, and the packages importable by any process of this venv (Ray workers need no PYTHONPATH).
  if [[ -z "$UV" ]]; then
    PIP_CONFIG_FILE=/dev/null PYTHONWARNINGS=ignore "$PY" -m pip --python "$VENV/bin/python" install -q --isolated --disable-pip-version-check \
      --no-index --no-deps --no-build-isolation -e "$ROOT" || exit 1  # (setuptools' warning on editable installs)
  elif [[ -n "$offline" ]]; then
    UV_PYTHON_DOWNLOADS=never "$UV" pip install -q --python "$VENV/bin/python" "${uv_offline[@]}" --no-deps \
      --no-build-isolation -e "$ROOT"
  else
    run_uv all pip install -q --python "$VENV/bin/python" --no-deps --no-build-isolation -e "$ROOT"
  fi
  # system: torch imports from the environment, and every package it requires is there in a version it accepts.
  [[ "$KIND" != system ]] || "$VENV/bin/python" "$INSTALL" verify "${TORCH%% *}" --installed "$VENV/.pretrain-requirements.txt" \
    || exit 1
  printf '%s\n%s\n' "$want_lock" "$want_project" >"$stamp.tmp.$$" && mv -f "$stamp.tmp.$$" "$stamp"
  remember_choice
  sha256sum "$lock" | cut -d' ' -f1 >"$VENV/.requirements.sha256"  # the lock's sha256 alone: a second, simpler stamp
  if [[ "$KIND" == cuda || ( "$KIND" == system && "$(cut -d' ' -f2 <<<"$TORCH")" != cpu ) ]]; then
    echo "[setup] done in $((SECONDS - t0)) s" >&2  # a CUDA torch: no CPU comm op to build
    return 0
  fi
  # DeepSpeed JIT-builds a small CPU shared-memory comm op at its first init of several workers (tens of
  # CPU-seconds; a run of one process never builds nor waits for it). Build it now in the background, detached, at
  # the lowest CPU priority (the first run goes first), cached in $TORCH_EXTENSIONS_DIR: a DeepSpeed init that
  # comes first waits for it (torch's lock file in the build directory) rather than building it again; if it fails, DeepSpeed builds it (or
  # falls back to gloo) at first use. SIGTERM still releases that lock; after a kill -9 mid-build, delete the
  # leftover .cache/torch_extensions/deepspeed_shm_comm/lock (torch would wait on it forever). Not with a CUDA
  # torch: GPUs communicate through NCCL, and a container build (Dockerfile) would kill it mid-build.
  mkdir -p "$ROOT/.cache"
  local detach=(nice -n 19)
  command -v setsid >/dev/null && detach=(setsid nice -n 19)
  ${detach[@]+"${detach[@]}"} nohup "$VENV/bin/python" -c "import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
from deepspeed.comm.torch import build_shm_op
build_shm_op()" </dev/null >"$ROOT/.cache/deepspeed-shm-op.log" 2>&1 &
  echo "[setup] done in $((SECONDS - t0)) s (DeepSpeed's CPU comm op builds in the background: .cache/deepspeed-shm-op.log)" >&2
}

wheelhouse() {  # DIR [--python X.Y] [--platform TAG] [--without ray,dev] [--environment FILE]: what setup --offline
  # installs (no .venv needed)
  [[ $# -ge 1 && "$1" != -* ]] \
    || { echo "[wheelhouse] error: usage: ./launch.sh wheelhouse DIR [--python X.Y] [--platform TAG] [--without ray,dev] [--environment FILE]" >&2; exit 2; }
  ensure_uv
  exec "$PY" "$INSTALL" wheelhouse "$@" --lock "$LOCK" --uv "$UV"
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

own_help() {  # CMD: its lines of the header above, for ./launch.sh CMD --help (which then does nothing else)
  awk -v cmd="$1" '/^#   \.\/launch\.sh /{on = ($3 == cmd)} !/^#  /{on = 0} on {sub(/^#  /, ""); print}' "$ROOT/launch.sh"
}

cmd="${1:-help}"
case "$cmd" in
  setup|wheelhouse|lock|lint|test)
    for arg in "${@:2}"; do
      if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then own_help "$cmd"; exit 0; fi
    done ;;
esac
case "$cmd" in
  help|-h|--help)
    setup
    usage ;;
  setup)
    shift
    setup "$@" ;;
  wheelhouse)
    shift
    wheelhouse "$@" ;;
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
    # The project's bytecode, once: with PYTHONDONTWRITEBYTECODE set, every process a test starts (CLI commands,
    # gloo ranks, Ray workers) would otherwise compile each module it imports again.
    "$VENV/bin/python" -m compileall -q -j 0 -x "tests/fixtures" pretrain cluster eval benchmarks tests >/dev/null
    # One session, two files at a time (pytest-xdist): the multi-process tests (gloo ranks, Ray workers, CLI
    # commands) spend much of their time waiting on processes to start and import, which a second file's work
    # fills; the longest files go first and the unit tests last (tests/conftest.py), so both workers end together
    # (--no-loadscope-reorder: pytest-xdist would otherwise hand out the files with the most tests first).
    # The single-process tests alone (arguments naming only tests/unit) run on every core.
    if [[ $# -eq 0 ]]; then
      exec "$VENV/bin/python" -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests
    elif unit_only "$@"; then
      exec "$VENV/bin/python" -m pytest -n auto "$@"
    fi
    exec "$VENV/bin/python" -m pytest "$@" ;;
  *)
    setup
    [[ $# -gt 0 ]] && shift
    exec "$VENV/bin/python" -m pretrain "$cmd" "$@" ;;
esac
