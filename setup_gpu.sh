#!/usr/bin/env bash
# The GPU install, in the order that works (a plain `pip install -r requirements.txt -r requirements-gpu.txt`
# does not: vllm pins its own transformers range, and flash-attn is an sdist that needs --no-build-isolation).
#   bash setup_gpu.sh                # torch + vllm, then the project's requirements under vllm's pins; sdpa attention
#   FLASH_ATTN=1 bash setup_gpu.sh   # and flash-attn, compiled against the installed torch (needs nvcc; long)
# Ends with `python train_seq.py --check-install`, which exits 1 on any problem.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# 1. torch (PyPI's Linux wheel of 2.13.0 is the CUDA build) and vllm, which pins that same torch
"$PY" -m pip install torch==2.13.0 -r requirements-gpu.txt
# 2. the project's requirements, leaving torch, transformers and tokenizers at the versions vllm accepts
grep -v -E '^(torch|transformers|tokenizers)==' requirements.txt > /tmp/aclarena-requirements-under-vllm.txt
"$PY" -m pip install -r /tmp/aclarena-requirements-under-vllm.txt
# 3. optional: flash-attn for the trainer's attention (vLLM brings its own kernels for generation)
if [ "${FLASH_ATTN:-0}" = 1 ]; then
    "$PY" -m pip install ninja packaging
    "$PY" -m pip install --no-build-isolation flash-attn==2.8.3.post2
fi
"$PY" train_seq.py --check-install
