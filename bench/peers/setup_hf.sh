#!/usr/bin/env bash
# Hugging Face transformers peer: torch 2.13.0 (CPU wheel, as kvmesh's own venv), transformers,
# safetensors, in $PEERS_HOME/hf-venv. Idempotent. Runner: bench/peers/run_hf.py.
source "$(dirname "$0")/common.sh"
TORCH=2.13.0
TRANSFORMERS="${HF_TRANSFORMERS_VERSION:-5.24.0}"   # same as kvmesh's venv (transformers 5.24.0)
PINS="torch==$TORCH transformers==$TRANSFORMERS"
if peer_ready hf "$PINS"; then exit 0; fi
peer_create hf
CONS="$(mktemp)"; trap 'rm -f "$CONS"' EXIT
echo "torch==$TORCH" > "$CONS"   # like constraints-cpu.txt: the +cpu wheel on disk (find-links)
say "hf: pip install torch==$TORCH transformers==$TRANSFORMERS safetensors (constraints: torch==$TORCH)"
"$PY" -m pip install -c "$CONS" "torch==$TORCH" "transformers==$TRANSFORMERS" safetensors jinja2
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
finish_venv hf "$PINS"
