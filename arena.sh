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
# the project's own Python (.venv/, set up the first time: ~1 min); at full scale the environment setup_gpu.sh built, as
# it is (ACL_VENV=0), or ACL_PYTHON=/path/to/python
[ "$ARENA" = tiny ] || ACL_VENV=${ACL_VENV:-0}
source ./venv.sh
QUICK=${QUICK:-0}       # 1: the whole study reduced to a smoke test (a step or two per stage, 10 tasks per split, ~3
                        # min) in runs/tiny-quick; its numbers mean nothing, it checks that every step runs and connects
SUFFIX=""; if [ "$QUICK" = 1 ]; then SUFFIX=-quick; fi   # (a failing `[ ] &&` here would end the script: set -e)
RUNS=${RUNS:-runs/$ARENA$SUFFIX}
# evaluate.py names a checkpoint by its path under runs/<name>/ (runs/tiny/seq/1-math -> seq-1-math)
case "$RUNS" in runs/?*|*/runs/?*) ;; *) echo "RUNS=$RUNS: must be a directory runs/<name> (anywhere)" >&2; exit 2;; esac
case "$ARENA" in tiny|qwen3-8b) ;; *) echo "ARENA=$ARENA: tiny or qwen3-8b (train_seq.py's presets)" >&2; exit 2;; esac
if [ "$ARENA" = tiny ]; then
    RUN="python"
    SUITE=tiny
    EVAL_BACKEND=hf
else
    RUN="torchrun --nproc_per_node=${NPROC:-8} ${TORCHRUN_ARGS:-}"
    SUITE=full
    EVAL_BACKEND=vllm
    # full scale runs one step at a time (LANES=1): each evaluation takes every GPU of node 0, one evaluate.py process
    # per GPU (--devices; the checkpoints dealt round-robin)
    EVAL_DEVICES="--devices $(seq -s, 0 $(( ${NPROC:-8} - 1 )))"
fi
EVAL_DEVICES=${EVAL_DEVICES:-}
TRAIN_ARGS=${TRAIN_ARGS:-}
SEQ_ARGS=${SEQ_ARGS:-}   # train_seq.py's own flags, for the stages and the oracles alone (full scale: the authors' cold
                         # start, --cold-start search=self,ecommerce=expert --expert-data DIR)
EVAL_ARGS=${EVAL_ARGS:-}
# evaluate.py's tasks per split (step 8); the full suite takes each benchmark whole. 800 `test` tasks so that a paired
# difference has an SE <= 0.02: a task's score varies more between tasks than between samples (avg@8 at 300 tasks still
# leaves 0.022 on e-commerce), so more tasks buy precision at a third of avg@k's cost; 200 `ood` tasks to judge the
# oracles' >= 0.10 there (SE 0.02). The gold log-likelihood stays on each split's first 300 (evaluate.py --gold-n)
N_EVAL_DEFAULT=test=800,ood=200
N_MIXED_DEFAULT=test=300,ood=100  # the mixed-domain tasks (step 8's last table)
# each script's reduction under QUICK=1 (empty otherwise)
Q_SEQ="" Q_MERGE="" Q_SDFT="" Q_MMOPD="" Q_MLE="" Q_ANALYZE="" Q_CONT=""
if [ "$QUICK" = 1 ]; then
    [ "$ARENA" = tiny ] || { echo "QUICK=1 is for the tiny arena" >&2; exit 2; }
    # the cold starts large enough that every oracle speaks the protocol (SDFT's filters need a success per domain)
    Q_SEQ="--steps 1 --prompts 4 --group 2 --rft-prompts math=128,search=256,ecommerce=128,if=128 --rft-epochs 2
           --micro-batch 8 --eval-n 2 --max-gen-rounds 1"
    Q_MERGE="--search-n 20 --grid-step 1.0"
    Q_SDFT="--prompts 32 --group 4 --steps 2"
    Q_MMOPD="--steps 2 --prompts 2 --group 2"
    Q_MLE="--steps 1 --prompts 2 --group 2 --router-prompts 16 --router-steps 20"
    Q_ANALYZE="--n 8 --kl-n 4"
    Q_CONT="--refit-steps 1 --refresh-epochs 1"
    N_EVAL_DEFAULT=test=10,ood=5 N_MIXED_DEFAULT=test=10,ood=5
fi
N_EVAL=${N_EVAL:-$N_EVAL_DEFAULT} N_MIXED=${N_MIXED:-$N_MIXED_DEFAULT}
[ "$ARENA" = tiny ] || N_EVAL=""

BASE=${BASE:-$RUNS/base}   # full scale: a local copy of the base model's directory, the --init of every stage and
                           # oracle and SDFT's student (so 16 ranks never hit the hub at once); merge.py and analyze.py
                           # read it: `huggingface-cli download Qwen/Qwen3-8B-Base --local-dir runs/qwen3-8b/base`
if [ "$ARENA" != tiny ] && [ ! -f "$BASE/config.json" ]; then
    echo "BASE=$BASE: no model there; download the base once: huggingface-cli download Qwen/Qwen3-8B-Base --local-dir $BASE" >&2
    exit 2
fi
# every step's wall time: `t NAME command...` runs it and appends "NAME seconds" to $TIMES; the table prints at the end
mkdir -p "$RUNS/logs"
NODE=${NODE_RANK:-0}
# several nodes (full scale, NODE_RANK set, runs/ on a filesystem they share): a torchrun step runs on every node, a
# plain-python one (merge, analyze, evaluate, report) on node 0 alone, which marks it done in runs/<arena>/logs/.done/;
# another node waits for that mark before its next step (torchrun's rendezvous would time out during node 0's hours
# of evaluation). Node 0 clears the marks of an earlier invocation before its first step; the other nodes cannot pass
# that step (a torchrun one, which needs node 0) before it has.
DONE=$RUNS/logs/.done
if [ "$NODE" = 0 ]; then
    mkdir -p "$DONE" && rm -f "$DONE"/*.done "$DONE"/*.failed "$DONE/.abort"
    # full scale: the base evaluated under its name, runs/<arena>/base: a link to BASE when it lives elsewhere
    # (a link this script made, to another BASE before, is replaced; a directory there is the base itself)
    if [ "$ARENA" != tiny ] && { [ -L "$RUNS/base" ] || [ ! -e "$RUNS/base" ]; }; then
        ln -sfn "$(cd "$BASE" && pwd)" "$RUNS/base"
    fi
    # a node-0 exit outside a step's own failure (a kill, a set -e line) tells the other nodes to stop waiting
    trap '[ $? = 0 ] || touch "$DONE/.abort"' EXIT
fi
TIMES=$RUNS/arena_times.txt
[ "$NODE" = 0 ] || TIMES=$RUNS/logs/arena_times.node$NODE.txt   # node 0's table is the arena's
START=$(date +%s)
echo "# arena.sh started $(date '+%Y-%m-%d %H:%M:%S') at $(git rev-parse --short HEAD 2>/dev/null || echo '?') $START" >> "$TIMES"
# LANES (tiny): independent steps run side by side, each a 1-thread process (this tiny model's ops are too small for
# 2 threads to help much: two 1-thread processes do 1.5x the work of one 2-thread process). LANES=1: one at a time,
# at torch's default threads, their output on the terminal too; each step's output is kept in runs/<arena>/logs/.
LANES=${LANES:-2}
PROGRESS=${PROGRESS:-60}   # seconds between the progress lines of the steps running in lanes
[ "$ARENA" = tiny ] || LANES=1
[ "$LANES" -gt 1 ] && export OMP_NUM_THREADS=1
STEPS=(seq oracles analyze-seq merge-uniform merge-grid merge-balanced mmopd sdft mle evaluate-mle-tag
       evaluate-mle-learned evaluate-mle-request evaluate-runs evaluate-oracles analyze evaluate-consolidators evaluate-mixed)
if [ "${LAW_ABLATION:-0}" = 1 ] && [ "$ARENA" = tiny ]; then
    for c in self none; do STEPS+=("law-$c" "law-$c-analyze" "law-$c-evaluate"); done
fi
# ORDERS=1 (tiny, step 8e): the sequential run under three more curricula, tag:order
ORDER_LIST=(rev:if,ecommerce,search,math efirst:ecommerce,math,search,if elast:math,search,if,ecommerce)
if [ "${ORDERS:-0}" = 1 ] && [ "$ARENA" = tiny ]; then
    for o in "${ORDER_LIST[@]}"; do STEPS+=("order-${o%%:*}" "order-${o%%:*}-evaluate"); done
fi
[ "${MLE_CONTINUAL:-0}" != 1 ] || [ "$ARENA" != tiny ] || STEPS+=(mle-continual evaluate-mle-continual)
for ((i = 1; i < ${SEEDS:-1}; i++)); do STEPS+=("seed-$i"); done
# `wait_mark STEP SECONDS`: wait, polling every SECONDS, until node 0 has marked STEP done; stop (status 1) when it
# marked it failed or its arena.sh ended early. Node 0 killed outright leaves no mark: a line every ~10 min says what
# is awaited
wait_mark() {
    local next=$((SECONDS + 600))
    until [ -f "$DONE/$1.done" ]; do
        [ ! -f "$DONE/$1.failed" ] || { echo "[$(date +%H:%M:%S)] $1 failed on node 0: node $NODE stops"; return 1; }
        [ ! -f "$DONE/.abort" ] || { echo "[$(date +%H:%M:%S)] node 0's arena.sh ended early: node $NODE stops"; return 1; }
        sleep "$2"
        if [ "$SECONDS" -ge "$next" ]; then
            echo "[$(date +%H:%M:%S)] node $NODE still waits for node 0's $1"; next=$((SECONDS + 600))
        fi
    done
}
t() {
    local name=$1 s rc=0 i n=0 pid last="" line k=0; shift; s=$(date +%s)
    for i in "${!STEPS[@]}"; do [ "${STEPS[$i]}" = "$name" ] && n=$((i + 1)); done
    # several nodes: a plain-python step is node 0's; the others wait for its mark (above)
    if [ "$NODE" != 0 ] && [ "$1" = python ]; then
        echo "[$(date +%H:%M:%S)] $name: node 0's step; node $NODE waits for it"
        wait_mark "$name" "${NODE_POLL:-10}"
        return
    fi
    echo "[$(date +%H:%M:%S)] [$n/${#STEPS[@]}] $name: started$([ "$LANES" -gt 1 ] && echo " (log: $RUNS/logs/$name.log)")"
    if [ "$LANES" -gt 1 ]; then
        # the step writes to its log; every PROGRESS seconds its newest progress line (step i/n, checkpoint i/n, with
        # the step's own ETA) is echoed here, so the terminal shows where each lane is
        "$@" > "$RUNS/logs/$name.log" 2>&1 & pid=$!
        while kill -0 "$pid" 2>/dev/null; do
            sleep 1; k=$((k + 1))
            [ $((k % PROGRESS)) = 0 ] || continue
            line=$(grep -a "ETA" "$RUNS/logs/$name.log" 2>/dev/null | tail -n 1 || true)
            [ -z "$line" ] || [ "$line" = "$last" ] || echo "[$(date +%H:%M:%S)]   $name: ${line:0:160}"
            last=$line
        done
        wait "$pid" || rc=$?
        [ $rc = 0 ] || { echo "[$(date +%H:%M:%S)] $name FAILED (exit $rc); its log ends:"; tail -n 20 "$RUNS/logs/$name.log"; }
    else
        { "$@" 2>&1 | tee "$RUNS/logs/$name.log"; } || rc=$?
    fi
    local mark=""; [ "$NODE" != 0 ] || [ "$1" != python ] || mark=$DONE/$name   # node 0 marks its python steps
    [ $rc = 0 ] || { [ -z "$mark" ] || touch "$mark.failed"; return $rc; }
    echo "$name $(( $(date +%s) - s ))" >> "$TIMES"
    [ -z "$mark" ] || touch "$mark.done"
    [ "$LANES" -le 1 ] || echo "[$(date +%H:%M:%S)] $name: done in $(( $(date +%s) - s )) s"
}
# `lanes f g ...`: the shell functions f, g, ... (each a chain of steps) at once with LANES > 1, else one after
# another; any failure stops the arena after the others finish
lanes() {
    local f pids=() rc=0
    if [ "$LANES" -le 1 ]; then for f in "$@"; do "$f"; done; return; fi
    for f in "$@"; do "$f" & pids+=($!); done
    for f in "${pids[@]}"; do wait "$f" || rc=1; done
    return $rc
}

SEEDS=${SEEDS:-1}   # training seeds: the whole study once per seed (seed 0 in $RUNS, seed s in $RUNS-seed<s>, step 9)
SEED=${SEED:-0}     # this study's training seed, passed to every training script (step 9 sets it for $RUNS-seed<s>)
# 1. the base: the committed reference base (assets/tiny-base: BPE tokenizer + ~1M-parameter Qwen3, an induction
#    drill, then pre-training on each domain's knowledge in plain text, never the agent protocol), the tiny
#    counterpart of downloading Qwen3-8B-Base (seconds). `python pretrain.py --out runs/tiny/base` rebuilds it (~28 min; float
#    differences between machines give a different base: see the README's base section)
[ "$ARENA" != tiny ] || [ -f "$RUNS/base/acl_meta.json" ] || { mkdir -p "$RUNS" && cp -r assets/tiny-base "$RUNS/base"; }
# the training scripts find the stages and the oracles under $RUNS (their default: runs/<preset>), the tiny ones the base
Q_SEQ="--runs $RUNS --seed $SEED $Q_SEQ" Q_SDFT="--runs $RUNS --seed $SEED $Q_SDFT"
Q_MMOPD="--runs $RUNS --seed $SEED $Q_MMOPD" Q_MLE="--runs $RUNS --seed $SEED $Q_MLE"
# (tiny: no 30-task evaluation after each stage, --eval-n 0: step 8 evaluates every stage and oracle on 800 tasks)
if [ "$ARENA" = tiny ]; then Q_SEQ="--init $RUNS/base --eval-n 0 $Q_SEQ" Q_SDFT="--student $RUNS/base $Q_SDFT"
else Q_SEQ="--init $BASE $Q_SEQ" Q_SDFT="--student $BASE $Q_SDFT"; fi
# 2. the sequential run math -> search -> ecommerce -> if (~6 min), and
# 3. the four single-task oracles, each one stage from the base (~6 min), side by side
seq_run() { t seq $RUN train_seq.py --preset "$ARENA" $Q_SEQ $TRAIN_ARGS $SEQ_ARGS; }
oracles() { t oracles $RUN train_seq.py --preset "$ARENA" --oracle $Q_SEQ $TRAIN_ARGS $SEQ_ARGS; }
lanes seq_run oracles
# steps 4-8, each a function below: in two lanes (tiny), a step that needs another lane's output waiting for its mark
# (`after`); or one after another in the order of the last lines (LANES=1, full scale)
# `after STEP...`: in lanes, wait until node 0 has finished these steps (their marks in runs/<arena>/logs/.done/), and
# stop if one failed; one step at a time, they are done already
after() {
    local s
    if [ "$LANES" -le 1 ]; then return 0; fi
    for s in "$@"; do wait_mark "$s" 2; done
}
# 4. why it forgets: displacement PCA/cosines of the stages and oracles, and token-level consistency of every
#    later checkpoint with seq/1-math on math prompts -> runs/tiny/analysis/seq/ (~15 s)
analyze_seq() {
    t analyze-seq python analyze.py --resume --runs "$RUNS" --base "$BASE" --ckpts "$RUNS"/seq/[0-9]-*/ "$RUNS"/oracle/*/ \
        --out "$RUNS/analysis/seq" $Q_ANALYZE --kl-n 0
}
# 5. model merging: the four stages' task vectors added onto the base (task arithmetic), lambda chosen three
#    ways; grid and balanced score candidates on each domain's val tasks of the tiny worlds, so they run in
#    the tiny arena only: uniform lambda = 1/4 (seconds), the best mean val score on a simplex grid of step 0.5, 11
#    candidates (~2 min), and the best worst-domain val score relative to the oracles on the same candidates (their val
#    scores reused: ~20 s)
STAGES=("$RUNS"/seq/[0-9]-{math,search,ecommerce,if})
MERGES=(merge-uniform); [ "$ARENA" != tiny ] || MERGES+=(merge-grid merge-balanced)
merges() {
    t merge-uniform python merge.py --base "$BASE" --models "${STAGES[@]}" \
        --search uniform --out "$RUNS/merge/uniform" $Q_MERGE
    [ "$ARENA" != tiny ] || t merge-grid python merge.py --base "$BASE" \
        --models "${STAGES[@]}" --search grid --grid-step 0.5 --out "$RUNS/merge/grid" $Q_MERGE
    [ "$ARENA" != tiny ] || t merge-balanced python merge.py --base "$BASE" \
        --models "${STAGES[@]}" --search balanced --grid-step 0.5 --oracles "$RUNS"/oracle/{math,search,ecommerce,if} \
        --scores-from "$RUNS/merge/grid" --out "$RUNS/merge/balanced" $Q_MERGE
}
# 6. SDFT: the oracles' filtered rollouts (runs/tiny/sdft-pool, the funnel printed) -> one student fine-tuned on
#    their balanced union, from the base -> runs/tiny/sdft (~6 min: sized to the other consolidators' cost)
sdft() { t sdft $RUN sdft.py --preset "$ARENA" $Q_SDFT $TRAIN_ARGS; }
# 6b. MMOPD: Seq-Final samples on every domain's prompts, each episode scored by the stage that learned its domain
#    (reverse KL as an advantage, forward KL over the teacher's top-16 where it is unsure) -> runs/tiny/mmopd (~6 min)
mmopd() { t mmopd $RUN mmopd.py --preset "$ARENA" $Q_MMOPD $TRAIN_ARGS; }
# 6c. MLE: the SDFT student frozen as the backbone, one LoRA expert per domain trained with GRPO on its own domain
#    (a k3 KL to the backbone), the learned router fitted on the backbone's prompt features, and each expert also
#    merged into a full checkpoint -> runs/tiny/mle/experts/<domain>, runs/tiny/mle/router.pt, runs/tiny/mle-merged/ (~5 min)
#    and MLE evaluated as 8a does, routed by tag (eval/mle.json, ~4 min), then by each of its learned routers: on the
#    prompt as the policy sees it (eval/mle-learned.json) and on the user's request alone, without tag, system prompt
#    or tools (eval/mle-request.json; issue 42's routing without tags); a benchmark whose every task a router sends
#    where the tag did is copied from eval/mle.json, exactly what sampling it again gives (seconds; ~4 min a router
#    that misroutes everywhere)
mle() {
    t mle $RUN mle.py --preset "$ARENA" --router learned --export merged $Q_MLE $TRAIN_ARGS
    local r
    for r in tag learned request; do
        t "evaluate-mle-$r" python evaluate.py --resume --suite "$SUITE" --backend "$EVAL_BACKEND" ${N_EVAL:+--n $N_EVAL} \
            $EVAL_ARGS --out-dir "$RUNS/eval" --ckpt "$RUNS/mle" --router "$r"
    done
}
# 7. the analysis again with the consolidators, and the forgetting law: every move's KL(before || after) per agent
#    token on each domain's test prompts (--kl-n 50 each; a stage's cold start and RL apart) -> runs/tiny/analysis/
#    (~6 min)
analyze_all() { t analyze python analyze.py --resume --runs "$RUNS" --base "$BASE" $Q_ANALYZE; }
# 8a. evaluation, N_EVAL tasks per split: the base and every stage, with the accuracy matrix (forgetting, BWT, FWT, its
#    heatmap in runs/tiny/eval/; oracle/math has seq/1-math's weights, so its scores are reused) (~7 min); the other
#    three oracles apart (~4 min)
eval_runs() {
    t evaluate-runs python evaluate.py --resume --suite "$SUITE" --backend "$EVAL_BACKEND" ${N_EVAL:+--n $N_EVAL} $EVAL_ARGS $EVAL_DEVICES --out-dir "$RUNS/eval" \
        --ckpt "$RUNS/base" "${STAGES[@]}" "$RUNS/oracle/math"
    [ "$NODE" != 0 ] || cp "$RUNS/logs/evaluate-runs.log" "$RUNS/scores.md" 2>/dev/null || true
}
eval_oracles() {
    t evaluate-oracles python evaluate.py --resume --suite "$SUITE" --backend "$EVAL_BACKEND" ${N_EVAL:+--n $N_EVAL} \
        $EVAL_ARGS $EVAL_DEVICES --out-dir "$RUNS/eval" --ckpt "$RUNS"/oracle/{search,ecommerce,if}
}
# 8b. every merge, SDFT, MMOPD and MLE (tag routing) evaluated as in 8a, then the consolidators on the mixed-domain
#    tasks that need search and arithmetic in one episode and carry no tag (N_MIXED; runs/tiny/eval-mixed/) (~9 min)
eval_consolidators() {
    t evaluate-consolidators python evaluate.py --resume --suite "$SUITE" --backend "$EVAL_BACKEND" ${N_EVAL:+--n $N_EVAL} \
        $EVAL_ARGS $EVAL_DEVICES --out-dir "$RUNS/eval" --ckpt "$RUNS"/merge/* "$RUNS/sdft" "$RUNS/mmopd" "$RUNS/mle"
    [ "$ARENA" != tiny ] || t evaluate-mixed eval_mixed
}
eval_mixed() {   # (MLE routed by each learned router: the mixed tasks carry no tag)
    python evaluate.py --resume --suite tiny --mixed only --n "$N_MIXED" --out-dir "$RUNS/eval-mixed" \
        --ckpt "$RUNS/base" "$RUNS/seq/4-if" "$RUNS"/merge/* "$RUNS/sdft" "$RUNS/mmopd" "$RUNS/mle" --router learned &&
    python evaluate.py --resume --suite tiny --mixed only --n "$N_MIXED" --out-dir "$RUNS/eval-mixed" \
        --ckpt "$RUNS/mle" --router request
}
# the two lanes, about 27 min each (tiny, from the step times of the seed-0 run): the first trains SDFT and MLE, evaluates three oracles and, once the merges
# and MMOPD are done, analyses; the second merges, distils with MMOPD, evaluates the stages and, once SDFT and MLE are
# done, the consolidators
lane_a() { analyze_seq; sdft; mle; eval_oracles; after "${MERGES[@]}" mmopd; analyze_all; }
lane_b() { merges; mmopd; eval_runs; after sdft mle; eval_consolidators; }
if [ "$LANES" -gt 1 ]; then
    lanes lane_a lane_b
else
    analyze_seq; merges; mmopd; sdft; mle; eval_runs; eval_oracles; analyze_all; eval_consolidators
fi
# 8c. SDFT_GRID=1 (opt-in, tiny): the study's SDFT ablation axis on this run's pool: mix (balanced, proportional) x
#    order (interleaved, staged, graded) from the base, the Seq-Final student, and no near-dedup (--dedup-threshold
#    1.0: a pool of its own, collected again from the same oracles), each evaluated as 8a -> runs/tiny/sdft-ablation/
#    <cell>, eval/sdft-ablation-<cell>.json; the report tables them (~70 s a student and ~100 s its evaluation)
if [ "${SDFT_GRID:-0}" = 1 ] && [ "$ARENA" = tiny ]; then
    GRID=()
    for m in balanced proportional; do for o in interleaved staged graded; do
        [ -f "$RUNS/sdft-ablation/$m-$o/acl_meta.json" ] || t "sdft-$m-$o" python sdft.py --preset tiny $Q_SDFT \
            --pool "$RUNS/sdft-pool" --mix $m --order $o --out "$RUNS/sdft-ablation/$m-$o"
        GRID+=("$RUNS/sdft-ablation/$m-$o")
    done; done
    [ -f "$RUNS/sdft-ablation/seqfinal/acl_meta.json" ] || t sdft-seqfinal python sdft.py --preset tiny $Q_SDFT \
        --pool "$RUNS/sdft-pool" --student "$RUNS/seq/4-if" --out "$RUNS/sdft-ablation/seqfinal"
    [ -f "$RUNS/sdft-ablation/nodedup/acl_meta.json" ] || t sdft-nodedup python sdft.py --preset tiny $Q_SDFT \
        --runs "$RUNS/sdft-ablation/nodedup-pool" --dedup-threshold 1.0 --out "$RUNS/sdft-ablation/nodedup" \
        --oracles "math=$RUNS/oracle/math,search=$RUNS/oracle/search,ecommerce=$RUNS/oracle/ecommerce,if=$RUNS/oracle/if"
    t evaluate-sdft-grid python evaluate.py --resume --suite tiny --backend hf --n "$N_EVAL" --out-dir "$RUNS/eval" \
        --ckpt "${GRID[@]}" "$RUNS/sdft-ablation/seqfinal" "$RUNS/sdft-ablation/nodedup"
fi
# 8d. LAW_ABLATION=1 (opt-in, tiny): the forgetting law over the cold start too: the sequential run again from the
#    same base with self-RFT as its cold start ($RUNS-coldself) and with none ($RUNS-coldnone: GRPO alone), each
#    stage's KL and scores measured as above; the report adds their stages to the law's table, fit and plot (~10 min
#    a run: on this base, whose samples never hold the protocol, self-RFT and GRPO alone find little to learn)
LAW_RUNS=()
if [ "${LAW_ABLATION:-0}" = 1 ] && [ "$ARENA" = tiny ]; then
    for c in self none; do
        R=$RUNS-cold$c
        if [ $c = self ]; then COLD="--cold-start self"; else COLD="--rft-prompts 0"; fi
        t "law-$c" python train_seq.py --preset tiny $Q_SEQ --runs "$R" $COLD
        t "law-$c-analyze" python analyze.py --resume --runs "$R" --base "$BASE" --ckpts "$R"/seq/[0-9]-*/ --no-tokens \
            --out "$R/analysis" $Q_ANALYZE
        t "law-$c-evaluate" python evaluate.py --resume --suite tiny --backend hf --n "$N_EVAL" --out-dir "$R/eval" \
            --ckpt "$R"/seq/[0-9]-{math,search,ecommerce,if}
        LAW_RUNS+=("$R")
    done
fi
# 8e. ORDERS=1 (opt-in, tiny; issue 42): the sequential run under three more curricula (the study's reversed, e-commerce
#    first, e-commerce last) with the same budgets and seed -> $RUNS-order-<tag>; a stage the study's run finished after
#    the same stages (math, search for e-commerce last) is copied from it, not retrained (train_seq.py --reuse); each
#    order's stages evaluated on the `test` tasks of N_EVAL; the report's stage-order section compares them (~3 min a
#    stage, ~1.5 min a checkpoint's evaluation: ~30 min a seed in two lanes)
ORDER_RUNS=()
order_train() {   # order_train TAG: train_seq.py under ORDER_LIST's curriculum of that tag
    local o; for o in "${ORDER_LIST[@]}"; do [ "${o%%:*}" = "$1" ] && break; done
    t "order-$1" python train_seq.py --preset tiny $Q_SEQ --runs "$RUNS-order-$1" --curriculum "${o#*:}" --reuse "$RUNS"
}
order_eval() {
    t "order-$1-evaluate" python evaluate.py --resume --suite tiny --backend hf --splits test --n "$N_EVAL" \
        --out-dir "$RUNS-order-$1/eval" --ckpt "$RUNS-order-$1"/seq/[0-9]-{math,search,ecommerce,if}
}
# two lanes of ~the same length: three new stages each for rev and efirst, two for elast
order_a() { order_train rev; order_eval rev; after order-elast; order_eval elast; }
order_b() { order_train efirst; order_train elast; order_eval efirst; }
if [ "${ORDERS:-0}" = 1 ] && [ "$ARENA" = tiny ]; then
    if [ "$LANES" -gt 1 ]; then lanes order_a order_b
    else order_train rev; order_eval rev; order_b; order_eval elast; fi
    for o in "${ORDER_LIST[@]}"; do ORDER_RUNS+=("$RUNS-order-${o%%:*}"); done
fi
# 8f. MLE_CONTINUAL=1 (opt-in, tiny; issue 42): MLE as a continual learner on SDFT's pools (mle.py --continual: per
#    arriving domain a backbone refresh by SDFT on the pools seen so far, a new expert, and the earlier experts kept
#    or re-fitted) -> runs/tiny/mle-continual/; each step's two MLE directories evaluated on the `test` tasks of the
#    domains seen (eval/mle-continual-<k>-<domain>[-refit].json); the report's continual section and cost table
if [ "${MLE_CONTINUAL:-0}" = 1 ] && [ "$ARENA" = tiny ]; then
    t mle-continual python mle.py --preset tiny --continual $Q_MLE $Q_CONT
    cont_eval() {
        local k=0 d seen="" c=()
        for d in math search ecommerce if; do
            k=$((k + 1)); seen=${seen:+$seen,}$d
            c=("$RUNS/mle-continual/$k-$d"); [ $k = 1 ] || c+=("$RUNS/mle-continual/$k-$d-refit")
            python evaluate.py --resume --suite tiny --backend hf --splits test --n "$N_EVAL" --domains "$seen" \
                --out-dir "$RUNS/eval" --ckpt "${c[@]}" || return 1
        done
    }
    t evaluate-mle-continual cont_eval
fi
# 9. SEEDS > 1: the whole study (steps 2-8) again with training seeds 1 .. SEEDS-1 from the same base, each in
#    $RUNS-seed<s> with its own report; each is one step here (~23 min a seed, tiny), and the report below gives
#    every number as mean ± std over the seeds
SEED_RUNS=()
for s in $(seq 1 $((SEEDS - 1))); do
    R=$RUNS-seed$s
    CHILD_BASE=$BASE   # full scale: the one local copy of the base model
    if [ "$ARENA" = tiny ]; then
        CHILD_BASE=$R/base
        [ -f "$R/base/acl_meta.json" ] || { mkdir -p "$R" && cp -r "$RUNS/base" "$R/base"; }
    fi
    t "seed-$s" env SEEDS=1 SEED="$s" RUNS="$R" BASE="$CHILD_BASE" LAW_ABLATION=0 bash ./arena.sh
    SEED_RUNS+=("$R")
    if [ "${ORDERS:-0}" = 1 ] && [ "$ARENA" = tiny ]; then   # (each seed ran its own orders: ORDERS is inherited)
        for o in "${ORDER_LIST[@]}"; do ORDER_RUNS+=("$R-order-${o%%:*}"); done
    fi
done
# the time table of this run (the steps after the last "started" line; with lanes, steps overlap, so the total is the
# wall time from the start, beside the sum of the steps); then the report: node 0's alone
[ "$NODE" = 0 ] || { echo "[$(date +%H:%M:%S)] node $NODE: done (node 0 writes the time table and the report)"; exit 0; }
awk -v now="$(date +%s)" '/^# arena.sh started/ {n = 0; delete rows; head = $0; start = $NF; next} {rows[++n] = $0}
    END {print head; for (i = 1; i <= n; i++) {split(rows[i], f, " "); printf "%-24s %6d s\n", f[1], f[2]; sum += f[2]}
    printf "%-24s %6d s (%.1f min)\n", "sum of the steps", sum, sum / 60
    printf "%-24s %6d s (%.1f min)\n", "total (wall)", now - start, (now - start) / 60}' "$TIMES" | tee "$RUNS/arena_times.md"
# 10. the report: the study's table, the normalised table, the accuracy matrices, the plots, the ten findings
#    checked, and the time table above -> runs/tiny/report.md (seconds)
python report.py --runs "$RUNS" ${SEED_RUNS[@]+--seed-runs "${SEED_RUNS[@]}"} ${LAW_RUNS[@]+--law-runs "${LAW_RUNS[@]}"} \
    ${ORDER_RUNS[@]+--orders "${ORDER_RUNS[@]}"}
