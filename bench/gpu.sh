#!/usr/bin/env bash
# GPU figures on one H200 (no internet, under 8 minutes): the training-step throughput and MFU of train_seq.py's
# GRPO update under FSDP2 bf16 (eager, with --compile, on a LoRA expert), and the hf backend's generation throughput,
# on a randomly initialised model with the Qwen3-1.7B configuration (bench/gpu_step.py says what is measured and how
# MFU is counted).
#   bash bench/gpu.sh            # prints two markdown tables: without and with activation checkpointing
# Each row prints when it is measured; a row that fails (out of memory, a compiler error) says so and the others run;
# the second line runs whatever the first did; exit 1 if any row failed.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
rc=0
torchrun --standalone --nproc_per_node=1 bench/gpu_step.py --micro-batch 8 --lora 16 --compile --steps 2 || rc=1
torchrun --standalone --nproc_per_node=1 bench/gpu_step.py --micro-batch 16 --grad-ckpt --gen-batch 128 --steps 3 || rc=1
exit $rc
