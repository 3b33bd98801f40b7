#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, fetched here (where a package index is reachable) into .gpu-kit/ (git-ignored),
# to travel with scripts/gpu_check.sh (`run` carries at most 64 MiB with the working tree).
#
#   scripts/gpu_kit.sh fetch          # Python 3.12, x86-64 manylinux wheels; prints each with its size and the total
#
# The lent machine (an H200, Python 3.12) has PyTorch, transformers, peft, accelerate, msgpack, cloudpickle, psutil,
# toolz and pyyaml (and their own dependencies: numpy, jinja2, fsspec, huggingface_hub, ...), and no dask,
# distributed, tornado, zict, tblib, partd, locket, structlog, megatron-core, cryptography, TRL or datasets.
# The kit holds the project's dependencies it lacks, at the versions CI tests (scripts/cpu-constraints.txt's
# machine). TRL is left out: it needs datasets, which needs pyarrow (a 55 MB wheel for cp312) and pandas (12 MB),
# over the kit's 48 MiB by themselves, so the check's TRL comparison cannot travel (gpu_check.sh says so).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.gpu-kit
LIMIT_MIB=48
PACKAGES=(
  dask==2026.8.0 distributed==2026.8.0 tornado==6.6.1 zict==3.0.0 tblib==3.2.2 partd==1.4.2 locket==1.0.0
  sortedcontainers==2.4.0 click==8.5.1 structlog==26.1.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  megatron-core==0.16.1
)

case "${1:-}" in
  fetch) ;;
  *) echo "usage: scripts/gpu_kit.sh fetch   (downloads the lent GPU machine's missing wheels into $KIT/)"; exit 2 ;;
esac

mkdir -p "$KIT"
rm -f "$KIT"/*.whl
# --isolated: this machine's pip configuration caps torch and adds local indexes meant for its own Python
pip download --isolated -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$KIT" "${PACKAGES[@]}"
total=0
for w in "$KIT"/*.whl; do
  size=$(stat -c %s "$w")
  total=$((total + size))
  printf '%10.2f MiB  %s\n' "$(echo "$size / 1048576" | bc -l)" "$(basename "$w")"
done
printf '%10.2f MiB  total (%d wheels; limit %d MiB)\n' "$(echo "$total / 1048576" | bc -l)" \
  "$(ls "$KIT"/*.whl | wc -l)" "$LIMIT_MIB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "the kit is over $LIMIT_MIB MiB: it would not travel with the working tree"; exit 1
fi
