#!/usr/bin/env bash
# OpenVINO GenAI peer: openvino-genai==2026.4.1.0 with the matching openvino==2026.4.1 and
# openvino-tokenizers==2026.4.1.0 (its [transformers] extra: tokenizer conversion at export), plus
# what the export needs: optimum-intel[openvino]==2.2.0 (optimum 2.3.0), nncf==3.4.0 (int8/int4
# weight compression), torch==2.13.0 (the CPU wheel on disk, held by a constraints file as in
# setup_vllm.sh) and transformers==5.5.4 (optimum-intel 2.2.0 wants transformers<5.6), in
# $PEERS_HOME/openvino-venv. optimum-intel 2.2.0 lists torchvision as a dependency; pip picks
# PyPI's torchvision 0.28.0 (built for PyPI's torch 2.13.0, not the +cpu wheel), which the export
# never imports, so it is uninstalled afterwards as setup_vllm.sh does (`pip check` then names it).
# Then the OpenVINO IRs: for each model in $OPENVINO_MODELS (default smollm2-135m-instruct;
# comma- or space-separated) and each weight format in $OPENVINO_WEIGHT_FORMATS (default
# "fp16 int8 int4"; optimum-cli 2.2.0 also offers fp32, mxfp4, nf4 and cb4, but no bf16),
# `optimum-cli export openvino --task text-generation-with-past --weight-format FORMAT` of kvmesh's
# own dense checkpoint (the directory kvmesh.hub.pull.ensure_dense prints, with $KVMESH_PYTHON,
# default the repo's .venv; no network: HF_HUB_OFFLINE=1) into
# $PEERS_HOME/openvino-models/NAME-FORMAT, with the tokenizer and detokenizer IRs
# (openvino_tokenizer.xml, openvino_detokenizer.xml) that openvino_genai.LLMPipeline loads.
# fp16: f16 weights, and the IR asks for an f16 KV cache (runtime option KV_CACHE_PRECISION);
# int8: per-channel asymmetric int8 (nncf: 211 of SmolLM2's 212 weights, one left in float);
# int4: asymmetric, group size 128, ratio 1.0, no data-aware steps, the tied embedding/lm_head
# weight int8 per-channel; with --group-size-fallback adjust, since an input width the group size
# does not divide (SmolLM2-135M's 576) otherwise stops nncf: those layers get group size 64. $OPENVINO_EXPORT_ARGS adds optimum-cli
# options. An output directory that already has openvino_model.xml is skipped (delete it to
# re-export; --force reinstalls the venv only). Runner: bench/peers/run_openvino.py --model-dir
# $PEERS_HOME/openvino-models/NAME-FORMAT.
# Here (2 Zen 1 cores, shared with a llama.cpp build, PyPI only): install 2 min 10 s, venv
# 1.6 GiB; SmolLM2-135M exports 56 s fp16 (265 MB), 72 s int8 (138 MB), 64 s int4 (90 MB).
# Idempotent.
source "$(dirname "$0")/common.sh"
OV=2026.4.1
TORCH=2.13.0
TRANSFORMERS=5.5.4
PINS="openvino-genai==$OV.0 openvino==$OV openvino-tokenizers==$OV.0 optimum-intel==2.2.0 optimum==2.3.0 nncf==3.4.0 torch==$TORCH transformers==$TRANSFORMERS"
if ! peer_ready openvino "$PINS"; then
  peer_create openvino
  CONS="$(mktemp)"; trap 'rm -f "$CONS"' EXIT
  printf 'torch==%s\ntransformers==%s\nopenvino==%s\n' "$TORCH" "$TRANSFORMERS" "$OV" > "$CONS"
  say "openvino: pip install $PINS (constraints: torch==$TORCH; a few minutes, ~1.5 GiB)"
  nice -n 10 "$PY" -m pip install -c "$CONS" "openvino-genai==$OV.0" "openvino==$OV" \
    "openvino-tokenizers[transformers]==$OV.0" "optimum-intel[openvino]==2.2.0" "optimum==2.3.0" \
    "nncf==3.4.0" "torch==$TORCH" "transformers==$TRANSFORMERS"
  say "openvino: pip uninstall -y torchvision"
  "$PY" -m pip uninstall -y torchvision || true
  "$PY" - <<'PY'
import importlib.metadata as md
import openvino as ov
print({p: md.version(p) for p in ("openvino-genai", "openvino", "openvino-tokenizers", "optimum-intel", "optimum",
                                  "nncf", "torch", "transformers")})
print("CPU:", ov.Core().get_property("CPU", "FULL_DEVICE_NAME"),
      ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
PY
  finish_venv openvino "$PINS"
fi

KVMESH_PY="${KVMESH_PYTHON:-$REPO_ROOT/.venv/bin/python}"
MODELS="${OPENVINO_MODELS:-smollm2-135m-instruct}"
FORMATS="${OPENVINO_WEIGHT_FORMATS:-fp16 int8 int4}"
OUT_ROOT="$PEERS_HOME/openvino-models"
mkdir -p "$OUT_ROOT"
for name in ${MODELS//,/ }; do
  src="$(cd "$REPO_ROOT" && "$KVMESH_PY" -c 'import sys; from kvmesh.hub.pull import ensure_dense; print(ensure_dense(sys.argv[1]))' "$name" | tail -n1)"
  for fmt in ${FORMATS//,/ }; do
    out="$OUT_ROOT/$name-$fmt"
    if [[ -f $out/openvino_model.xml ]]; then
      say "openvino: $name $fmt: already exported in $out"
      continue
    fi
    say "openvino: exporting $name ($src) as $fmt into $out"
    t0=$SECONDS
    rm -rf "$out.partial"
    extra=()   # group-wise 4-bit: a layer whose input width the group size does not divide gets a smaller one
    [[ $fmt == int4 || $fmt == nf4 ]] && extra=(--group-size-fallback adjust)
    # shellcheck disable=SC2086  # OPENVINO_EXPORT_ARGS: more optimum-cli options, word-split
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 nice -n 10 "$VENV/bin/optimum-cli" export openvino --model "$src" \
      --task text-generation-with-past --weight-format "$fmt" "${extra[@]}" ${OPENVINO_EXPORT_ARGS:-} "$out.partial"
    for f in openvino_model.xml openvino_tokenizer.xml openvino_detokenizer.xml; do
      [[ -f $out.partial/$f ]] || { echo "openvino: $name $fmt: export wrote no $f" >&2; exit 1; }
    done
    mv "$out.partial" "$out"
    say "openvino: $name $fmt: exported in $((SECONDS - t0)) s ($(du -sh "$out" | cut -f1))"
  done
done
