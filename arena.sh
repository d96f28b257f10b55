#!/usr/bin/env bash
# ACLArena, the whole study in order, one step per line (like nanochat's speedrun.sh).
# Each line's comment gives its cost on a 2-core CPU for the tiny arena (the default).
#
#   bash arena.sh                      # the tiny arena on the CPU
#   ARENA=qwen3-8b NPROC=8 TRAIN_ARGS="--math-data ... --user-url ..." bash arena.sh
#       full scale: every training line becomes a torchrun launch of the qwen3-8b preset (vLLM rollouts), with
#       TRAIN_ARGS (data and services) appended, TORCHRUN_ARGS for multi-node (--nnodes, --node-rank,
#       --rdzv-endpoint) and EVAL_ARGS for evaluate.py's data flags; see the README's full-scale section
#
# A killed run restarted with the same command skips what is finished and resumes the rest.
set -euo pipefail
cd "$(dirname "$0")"
export TOKENIZERS_PARALLELISM=false
ARENA=${ARENA:-tiny}
RUNS=runs/$ARENA
if [ "$ARENA" = tiny ]; then
    RUN="python"
    SUITE=tiny
    EVAL_BACKEND=hf
else
    RUN="torchrun --nproc_per_node=${NPROC:-8} ${TORCHRUN_ARGS:-}"
    SUITE=full
    EVAL_BACKEND=vllm
fi
TRAIN_ARGS=${TRAIN_ARGS:-}
EVAL_ARGS=${EVAL_ARGS:-}

# every step's wall time: `t NAME command...` runs it and appends "NAME seconds" to $TIMES; the table prints at the end
mkdir -p "$RUNS"
TIMES=$RUNS/arena_times.txt
echo "# arena.sh started $(date '+%Y-%m-%d %H:%M:%S') at $(git rev-parse --short HEAD 2>/dev/null || echo '?')" >> "$TIMES"
t() { local name=$1 s; shift; s=$(date +%s); "$@"; echo "$name $(( $(date +%s) - s ))" >> "$TIMES"; }

SEEDS=${SEEDS:-1}           # tiny: training seeds of the sequential run (seed 0 in runs/tiny, seed s in runs/tiny-seed<s>)
BASE=${BASE:-$RUNS/base}   # full scale: a local copy of the base model's directory (merge.py, analyze.py read it)
# 1. the base: the committed reference base (assets/tiny-base: BPE tokenizer + ~1M-parameter Qwen3, an induction
#    drill, then pre-training on the worlds' text and noisy demos), the tiny counterpart of downloading
#    Qwen3-8B-Base (seconds). `python -m envs.tiny --out runs/tiny/base` rebuilds it (~12.5 min; float
#    differences between machines give a different base: see the README's base section)
[ "$ARENA" != tiny ] || [ -f "$RUNS/base/acl_meta.json" ] || { mkdir -p "$RUNS" && cp -r assets/tiny-base "$RUNS/base"; }
# 2. the sequential run math -> search -> ecommerce -> if, each stage evaluated on every domain (~5 min)
t seq $RUN train_seq.py --preset "$ARENA" $TRAIN_ARGS
# 3. the four single-task oracles, each one stage from the base (~9 min)
t oracles $RUN train_seq.py --preset "$ARENA" --oracle $TRAIN_ARGS
# 4. why it forgets: displacement PCA/cosines of the stages and oracles, and token-level consistency of every
#    later checkpoint with seq/1-math on math prompts -> runs/tiny/analysis/seq/ (~15 s)
t analyze-seq python analyze.py --runs "$RUNS" --base "$BASE" --ckpts "$RUNS"/seq/[0-9]-*/ "$RUNS"/oracle/*/ --out "$RUNS/analysis/seq"
# 5. model merging: the four stages' task vectors added onto the base (task arithmetic), lambda chosen three
#    ways; grid and balanced score candidates on each domain's val tasks of the tiny worlds, so they run in
#    the tiny arena only
STAGES=("$RUNS"/seq/[0-9]-{math,search,ecommerce,if})
# uniform lambda = 1/4 (seconds)
[ -f "$RUNS/merge/uniform/acl_meta.json" ] || t merge-uniform python merge.py --base "$BASE" --models "${STAGES[@]}" --search uniform --out "$RUNS/merge/uniform"
# the best mean val score on a simplex grid of step 0.5, 11 candidates (~2.5 min)
[ "$ARENA" != tiny ] || [ -f "$RUNS/merge/grid/acl_meta.json" ] || t merge-grid python merge.py --base "$BASE" --models "${STAGES[@]}" \
    --search grid --grid-step 0.5 --out "$RUNS/merge/grid"
# the best worst-domain val score relative to the oracles, same grid (~3 min)
[ "$ARENA" != tiny ] || [ -f "$RUNS/merge/balanced/acl_meta.json" ] || t merge-balanced python merge.py --base "$BASE" --models "${STAGES[@]}" \
    --search balanced --grid-step 0.5 --oracles "$RUNS"/oracle/{math,search,ecommerce,if} --out "$RUNS/merge/balanced"
# 6. SDFT: the oracles' filtered rollouts (runs/tiny/sdft-pool, the funnel printed) -> one student fine-tuned on
#    their balanced union, from the base -> runs/tiny/sdft (~3 min)
t sdft $RUN sdft.py --preset "$ARENA" $TRAIN_ARGS
# 6b. MMOPD: Seq-Final samples on every domain's prompts, each episode scored by the stage that learned its domain
#    (reverse KL as an advantage, forward KL over the teacher's top-16 where it is unsure) -> runs/tiny/mmopd (~8 min)
t mmopd $RUN mmopd.py --preset "$ARENA" $TRAIN_ARGS
# 6c. MLE: the SDFT student frozen as the backbone, one LoRA expert per domain trained with GRPO on its own domain
#    (a k3 KL to the backbone), the learned router fitted on the backbone's prompt features, and each expert also
#    merged into a full checkpoint -> runs/tiny/mle/experts/<domain>, runs/tiny/mle/router.pt, runs/tiny/mle-merged/ (~9 min)
t mle $RUN mle.py --preset "$ARENA" --router learned --export merged $TRAIN_ARGS
# 7. the analysis again with the consolidators -> runs/tiny/analysis/ (~15 s)
t analyze python analyze.py --runs "$RUNS" --base "$BASE"
# 8. evaluation at 300 tasks per split: the base, every stage, every oracle, every merge, SDFT, MMOPD, MLE; the accuracy
#    matrix with forgetting, BWT and FWT, and its heatmap in runs/tiny/eval/ (~29 min: 14 checkpoints x ~2.1 min)
t evaluate python evaluate.py --suite "$SUITE" --backend "$EVAL_BACKEND" $EVAL_ARGS --ckpt "$RUNS/base" "${STAGES[@]}" \
    "$RUNS"/oracle/{math,search,ecommerce,if} "$RUNS"/merge/* "$RUNS/sdft" "$RUNS/mmopd" "$RUNS/mle" | tee "$RUNS/scores.md"
# 8b. MLE routed by its learned router instead of the task's tag (eval/mle-learned.json), and every consolidator on
#    the mixed-domain tasks that need search and arithmetic in one episode, which carry no tag (runs/tiny/eval-mixed/)
t evaluate-mle-learned python evaluate.py --suite "$SUITE" --backend "$EVAL_BACKEND" $EVAL_ARGS --ckpt "$RUNS/mle" --router learned
[ "$ARENA" != tiny ] || t evaluate-mixed python evaluate.py --suite tiny --mixed --domains search --out-dir "$RUNS/eval-mixed" \
    --ckpt "$RUNS/base" "$RUNS/seq/4-if" "$RUNS"/merge/* "$RUNS/sdft" "$RUNS/mmopd" "$RUNS/mle" --router learned
# 9. tiny, SEEDS > 1: the sequential run again with training seeds 1 .. SEEDS-1 from the same base, each evaluated
#    like step 8 (its base row is step 8's), then the accuracy matrices as mean ± std over training seeds
#    (~17 min a seed)
if [ "$ARENA" = tiny ] && [ "$SEEDS" -gt 1 ]; then
    ALL=("$RUNS")
    for s in $(seq 1 $((SEEDS - 1))); do
        R=runs/tiny-seed$s
        python train_seq.py --preset tiny --seed "$s" --runs "$R" --init "$RUNS/base" $TRAIN_ARGS
        mkdir -p "$R/eval" && cp "$RUNS/eval/base.json" "$R/eval/base.json"
        python evaluate.py --suite tiny $EVAL_ARGS --ckpt "$R"/seq/[0-9]-{math,search,ecommerce,if} | tee "$R/scores.md"
        ALL+=("$R")
    done
    python evaluate.py --across "${ALL[@]}" | tee "$RUNS/scores_seeds.md"
fi
# the time table of this run (the steps after the last "started" line) and its total
awk '/^# arena.sh started/ {n = 0; delete rows; head = $0; next} {rows[++n] = $0} END {print head;
    for (i = 1; i <= n; i++) {split(rows[i], f, " "); printf "%-22s %6d s\n", f[1], f[2]; total += f[2]}
    printf "%-22s %6d s (%.1f min)\n", "total", total, total / 60}' "$TIMES" | tee "$RUNS/arena_times.md"
