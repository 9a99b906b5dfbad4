#!/usr/bin/env bash
# Every GPU check of a lent device session in one prepared command (about 12 minutes at most on one H100/H200):
#   bash bench/gpu_session.sh [OUT]        # OUT: where the logs go (default ./gpu-session); $OUT on the device tool
# 1. tfcompat check --device cuda --dtype bf16 (every family, the kernels' first-use proofs);
# 2. bench/gpu_recipes.py (checkpointing, inference_mode then training, compile per layer / whole / after warmup,
#    generate() with an image);
# 3. bench/gpu_step.py (the 7B-shaped packed step and the RoPE table; Liger-Kernel where importable: carry its
#    wheel in a folder and pip install --no-deps it first).
# Each part has its own time limit, so one stuck part leaves the others' tables; the versions head every log.
# Copy what it prints into docs/gpu.md with the device and the date.
set -u
out="${1:-${OUT:-gpu-session}}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - <<'PY' | tee "$out/versions.txt"
import importlib.metadata as md, torch
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
for name in ("torch", "triton", "transformers", "flash-attn", "flash_attn_3", "liger-kernel"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: -")
PY
status=0
timeout 120 python -m tfcompat check --device cuda --dtype bf16 2>&1 | tee "$out/check.txt" || status=1
timeout 240 python bench/gpu_recipes.py 2>&1 | tee "$out/recipes.txt" || status=1
timeout 420 python bench/gpu_step.py 2>&1 | tee "$out/step.txt" || status=1
echo "gpu_session: $( [ $status -eq 0 ] && echo PASS || echo FAIL ) (logs in $out)"
exit $status
