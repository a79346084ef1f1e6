#!/usr/bin/env bash
# Wheels a bare CUDA machine without network needs to run scripts/gpu_check.sh (its image has
# torch, transformers, peft, safetensors, pytest; not the planner's solver or Hydra). Run here,
# then pass `carry: [".whl"]` to the device tool. Usage: bash scripts/fetch_device_wheels.sh [PYVER]
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${1:-3.12}"
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
rm -rf .whl && mkdir .whl
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
for pkg in pulp==3.3.2 highspy==1.16.0 hydra-core==1.3.8 omegaconf==2.3.1; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLAT[@]}" -d .whl "$pkg"
done
# antlr4-python3-runtime (Hydra's parser) ships as an sdist only: build its pure-Python wheel here
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -la .whl
du -sh .whl
