#!/usr/bin/env bash
# ONNX Runtime GenAI peer: onnxruntime-genai==0.18.0 with onnxruntime==1.32.0 (genai 0.18.0 asks
# for onnxruntime>=1.31.0 and loads the onnxruntime package's libonnxruntime.so; CPU execution
# provider), plus what its model builder (`python -m onnxruntime_genai.models.builder`) needs:
# torch==2.13.0 (the CPU wheel on disk, held by a constraints file as in setup_vllm.sh),
# transformers==5.24.0 (as kvmesh's venv), onnx==1.23.2, onnx-ir==1.1.0, safetensors, tqdm, in
# $PEERS_HOME/ort-venv.
# Then the ONNX models: for each model in $ORT_MODELS (default smollm2-135m-instruct; comma- or
# space-separated) and each precision in $ORT_PRECISIONS (default "fp32 int4"), the builder
# (`-p PRECISION -e cpu`) on kvmesh's own dense checkpoint (the directory
# kvmesh.hub.pull.ensure_dense prints, with $KVMESH_PYTHON, default the repo's .venv; no network:
# HF_HUB_OFFLINE=1) into $PEERS_HOME/ort-models/NAME-PRECISION (model.onnx + model.onnx.data,
# genai_config.json, the tokenizer files). fp32: fp32 weights, activations and KV cache (the tied
# embedding / LM head stored twice); int4: MatMulNBits with the builder's CPU defaults (symmetric,
# block size 32, accuracy_level 4: int8 activations in the MatMuls), the LM head int4 too and
# shared with the embedding (GatherBlockQuantized), fp32 activations and KV cache. No bf16: the
# builder lists "FP32 CPU, INT8 CPU, INT4 CPU" as the CPU combinations (bf16 only for CUDA /
# TRT-RTX); `-p bf16 -e cpu` does write a model, but ONNX Runtime 1.32's CPU execution provider
# cannot load it ("Could not find an implementation for Where(16)": no bf16 kernels). Builder
# options can be added with $ORT_BUILDER_ARGS (e.g. "--extra_options block_size=128"). An output
# directory that already has genai_config.json is skipped (delete it to rebuild; --force
# reinstalls the venv only). Runner: bench/peers/run_ort.py --model-dir
# $PEERS_HOME/ort-models/NAME-PRECISION.
# Here (2 Zen 1 cores, shared, PyPI only): install 1 min 40 s, venv 1.3 GiB; SmolLM2-135M builds
# in 12 s fp32 (519 MB; 59 s beside another job) and 15 s int4 (86 MB).
# Idempotent.
source "$(dirname "$0")/common.sh"
GENAI=0.18.0
ORT=1.32.0
TORCH=2.13.0
TRANSFORMERS=5.24.0
ONNX=1.23.2
ONNX_IR=1.1.0
PINS="onnxruntime-genai==$GENAI onnxruntime==$ORT torch==$TORCH transformers==$TRANSFORMERS onnx==$ONNX onnx-ir==$ONNX_IR"
if ! peer_ready ort "$PINS"; then
  peer_create ort
  CONS="$(mktemp)"; trap 'rm -f "$CONS"' EXIT
  printf 'torch==%s\ntransformers==%s\nonnxruntime==%s\nonnx==%s\n' "$TORCH" "$TRANSFORMERS" "$ORT" "$ONNX" > "$CONS"
  say "ort: pip install $PINS safetensors tqdm (constraints: torch==$TORCH; a few minutes, ~1.4 GiB)"
  nice -n 10 "$PY" -m pip install -c "$CONS" "onnxruntime-genai==$GENAI" "onnxruntime==$ORT" "torch==$TORCH" \
    "transformers==$TRANSFORMERS" "onnx==$ONNX" "onnx-ir==$ONNX_IR" safetensors tqdm
  "$PY" - <<'PY'
import importlib.metadata as md
import onnxruntime as ort
import onnxruntime_genai  # noqa: F401  (loads libonnxruntime.so of the onnxruntime package)
print({p: md.version(p) for p in ("onnxruntime-genai", "onnxruntime", "torch", "transformers", "onnx", "onnx-ir")})
print("execution providers:", ort.get_available_providers())
PY
  finish_venv ort "$PINS"
fi

KVMESH_PY="${KVMESH_PYTHON:-$REPO_ROOT/.venv/bin/python}"
MODELS="${ORT_MODELS:-smollm2-135m-instruct}"
PRECISIONS="${ORT_PRECISIONS:-fp32 int4}"
OUT_ROOT="$PEERS_HOME/ort-models"
mkdir -p "$OUT_ROOT"
for name in ${MODELS//,/ }; do
  src="$(cd "$REPO_ROOT" && "$KVMESH_PY" -c 'import sys; from kvmesh.hub.pull import ensure_dense; print(ensure_dense(sys.argv[1]))' "$name" | tail -n1)"
  for prec in ${PRECISIONS//,/ }; do
    out="$OUT_ROOT/$name-$prec"
    if [[ -f $out/genai_config.json ]]; then
      say "ort: $name $prec: already built in $out"
      continue
    fi
    say "ort: building $name ($src) as $prec for cpu into $out"
    t0=$SECONDS
    rm -rf "$out.partial" "$out.cache"
    # shellcheck disable=SC2086  # ORT_BUILDER_ARGS: more builder options, word-split
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 nice -n 10 "$PY" -m onnxruntime_genai.models.builder \
      -i "$src" -o "$out.partial" -p "$prec" -e cpu -c "$out.cache" ${ORT_BUILDER_ARGS:-}
    for f in genai_config.json model.onnx; do
      [[ -f $out.partial/$f ]] || { echo "ort: $name $prec: the builder wrote no $f" >&2; exit 1; }
    done
    rm -rf "$out.cache"
    mv "$out.partial" "$out"
    say "ort: $name $prec: built in $((SECONDS - t0)) s ($(du -sh "$out" | cut -f1))"
  done
done
