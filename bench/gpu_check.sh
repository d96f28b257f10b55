#!/usr/bin/env bash
# The one-GPU check, prepared for a lent H200 (torch, transformers and peft; no vllm, flash-attn or internet), within
# 8 minutes, its log in $OUT/gpu_check.log (OUT: the device tool's output folder; default runs/gpu_check). The image
# lacks bm25s, langdetect, math-verify and datasets and reaches no index: run `bash bench/gpu_wheels.sh` here first and
# carry .whl (the device tool's `carry: [".whl"]`); the check installs those wheels first, then:
#   1. the install check (train_seq.py --check-install: the GPU, NCCL, bf16, every package imports);
#   2. the GPU tier of the tests (tests/test_gpu.py, pytest -m gpu): the collective helpers, a GRPO update and a DCP
#      resume round trip under torchrun on NCCL; two stages handed off under torchrun with rank 0's writes slowed;
#      bf16 log-probs against the fp32 reference;
#   3. the hf backend on the GPU's stock attention (sdpa with kept caches, padding inside a row, stacked parts; never
#      the project's CPU-only shared-prefix kernel): kept-cache and continuous-batching rollouts against full
#      re-prefill (token ids, masks, rewards) and sampled log-probs against teacher forcing, on every domain (the
#      same checks tests/test_engine.py runs on the CPU with stock sdpa); then the same with every decode step replayed
#      as a CUDA graph (HFBackend(graphs=True), ACL_CUDA_GRAPHS=1); the largest log-prob gaps in the log;
#   4. bench/gpu.sh's step figures: GRPO update tokens/s and MFU against the nominal and the measured bf16 matmul peak,
#      the norms and SwiGLU compiled and LoRA beside full fine-tuning, allocated and reserved memory peaks, hf
#      generation tokens/s eager and graphed;
#   5. memory at the 8B width: Qwen3-8B's layers and vocabulary with 3 layers, one GRPO update's measured peak beside
#      --dry-run's estimate for the same model (the terms the README's 8B memory table extrapolates).
# On a GPU each step has a timeout and the check ends within 480 s (tests/test_bench.py holds it): the step figures get
# what the steps before them left of it, less the last step's 70 s (at least 150 s; a cut-off run keeps its rows).
#   bash bench/gpu_check.sh           # on a GPU
#   bash bench/gpu_check.sh --cpu     # every step at smoke size on the CPU (CI runs it): checks this script, not a GPU
# Each step runs whatever the one before did; the summary names the failed ones; exit 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
CPU=0; [ "${1:-}" = --cpu ] && CPU=1
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: > "$LOG"
FAILED=()
T0=$(date +%s)
left() {   # left N: the seconds of the 480 left, keeping N for the later steps (at least 10: timeout 0 never ends)
    local s=$(( 480 - ($(date +%s) - T0) - $1 )); echo $(( s > 10 ? s : 10 ))
}
step() {   # step NAME command...: runs it, its output into the log and on the terminal, its time and status after
    local name=$1 s rc; shift; s=$(date +%s)
    echo "== $name: $*" | tee -a "$LOG"
    "$@" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $(( $(date +%s) - s )) s" | tee -a "$LOG"
    [ "$rc" = 0 ] || FAILED+=("$name")
}
echo "gpu_check $(date '+%Y-%m-%d %H:%M') at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), cpu mode $CPU" | tee -a "$LOG"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1   # nothing here needs a hub; a lent machine cannot reach one anyway
# what a lent machine's image lacks (bench/gpu_wheels.sh, carried as .whl: CPython 3.12 wheels); with --cpu only from
# a folder that WHL names (rehearsing the lent image in an environment like it)
if [ "$CPU" = 1 ]; then WHL=${WHL:-}; else WHL=${WHL:-.whl}; fi
if [ -n "$WHL" ] && compgen -G "$WHL/*.whl" > /dev/null; then
    step wheels python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "${TMPDIR:-/tmp}/acl-site" "$WHL"/*.whl
    export PYTHONPATH=${TMPDIR:-/tmp}/acl-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$CPU" = 1 ]; then
    export ACL_TEST_DEVICE=cpu OMP_NUM_THREADS=1
    step install python train_seq.py --check-install
    step gpu-tier python -m pytest -q -m gpu tests/test_gpu.py -k "not kept_cache and not graph_decoding"
    step kv-sdpa python -m pytest -q -s -m gpu tests/test_gpu.py -k "kept_cache or graph_decoding"
    step step-figures python bench/gpu_step.py --smoke --lora 4 --compile --profile
    step memory-8b-width python bench/gpu_step.py --smoke --layers 3 --vs-dry-run
else
    step install timeout 30 python train_seq.py --check-install
    step gpu-tier timeout 130 python -m pytest -q -m gpu tests/test_gpu.py -k "not kept_cache and not graph_decoding"
    step kv-sdpa timeout 100 python -m pytest -q -s -m gpu tests/test_gpu.py -k "kept_cache or graph_decoding"
    step step-figures timeout "$(left 70)" bash bench/gpu.sh
    step memory-8b-width timeout 70 torchrun --standalone --nproc_per_node=1 bench/gpu_step.py \
        --config Qwen/Qwen3-8B-Base --layers 3 --vs-dry-run --micro-batch 1 --completion-len 3584 --steps 1
fi
if [ ${#FAILED[@]} = 0 ]; then echo "gpu_check: every step passed (log: $LOG)" | tee -a "$LOG"; exit 0; fi
echo "gpu_check: FAILED: ${FAILED[*]} (log: $LOG)" | tee -a "$LOG"
exit 1
