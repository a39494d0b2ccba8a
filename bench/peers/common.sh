# Shared by bench/peers/setup_*.sh (sourced, not run). Peers live outside the repo:
#   $KVMESH_PEERS_HOME, else $KVMESH_HOME/peers, else ~/.cache/kvmesh/peers
# Each venv holds a marker file (.kvmesh-peer) naming what was installed; a setup script whose
# marker matches its pins does nothing (pass --force to reinstall).
set -euo pipefail

PEERS_HOME="${KVMESH_PEERS_HOME:-${KVMESH_HOME:-$HOME/.cache/kvmesh}/peers}"
PEERS_PYTHON="${PEERS_PYTHON:-python3}"   # the interpreter each venv is made from
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FORCE=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) echo "usage: $0 [--force]   (venv under $PEERS_HOME)"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

say() { echo "[peers $(date -u +%H:%M:%S)] $*"; }

# peer_ready NAME PINS: sets VENV and PY; true when the venv is already set up with PINS.
peer_ready() {
  VENV="$PEERS_HOME/$1-venv"
  PY="$VENV/bin/python"
  if [[ $FORCE == 0 && -x $PY && -f $VENV/.kvmesh-peer ]] && [[ "$(head -n1 "$VENV/.kvmesh-peer")" == "$2" ]]; then
    say "$1: already set up in $VENV ($2); --force reinstalls"
    return 0
  fi
  return 1
}

# peer_create NAME: (re)creates the venv named by peer_ready (wiped first with --force).
peer_create() {
  if [[ $FORCE == 1 && -d $VENV ]]; then
    say "$1: --force: removing $VENV"
    rm -rf "$VENV"
  fi
  mkdir -p "$PEERS_HOME"
  if [[ ! -x $PY ]]; then
    say "$1: creating venv $VENV with $("$PEERS_PYTHON" -V 2>&1)"
    "$PEERS_PYTHON" -m venv "$VENV"
  fi
  "$PY" -m pip install --quiet --upgrade pip wheel
}

# finish_venv NAME PINS: writes the marker (pins on line 1, then pip freeze) and reports.
finish_venv() {
  { echo "$2"; "$VENV/bin/python" -m pip freeze 2>/dev/null; } > "$VENV/.kvmesh-peer"
  say "$1: done; python: $VENV/bin/python; packages recorded in $VENV/.kvmesh-peer"
}
