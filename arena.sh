#!/usr/bin/env bash
# ACLArena, the whole study in order, one step per line (like nanochat's speedrun.sh).
# Each line's comment gives its cost on a 2-core CPU for the tiny arena (the default).
# Later issues add the sequential stages, oracles, consolidators and evaluation here.
set -euo pipefail
cd "$(dirname "$0")"
export TOKENIZERS_PARALLELISM=false
RUNS=runs/tiny

# 1. the base: BPE tokenizer + ~1M-parameter Qwen3 pre-trained on the worlds' text and noisy demos (~5 min)
[ -f "$RUNS/base/acl_meta.json" ] || python -m envs.tiny --out "$RUNS/base"
# 2. the base's sampled score on every domain's test and ood split, with rollout speed (~2 min)
python -m envs.rollout --ckpt "$RUNS/base" --n 300 | tee "$RUNS/base_scores.md"
