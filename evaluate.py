"""Evaluate checkpoints on every benchmark of a suite: sampled score, mean ± std over sampling seeds.

Each benchmark is a set of (env, task) pairs from envs/; a seed is one full pass that samples k rollouts per task
(top_k 0; temperature 1 on the tiny suite, the policy's own distribution; full: the released evaluation's math 0.6
and tau 0.7, search and IF 1.0, SUITE_TEMPERATURE) and scores their mean reward; the
result is the mean and the sample standard deviation of that score over seeds. Results go to
runs/<preset>/eval/<name>.json (<name>: the checkpoint's path under runs/<preset>/ with / -> -, so
runs/tiny/seq/1-math -> seq-1-math), a markdown table across checkpoints is printed, and when the checkpoints
include sequential stages (runs/<preset>/seq/<i>-<domain>) the accuracy matrix stage x domain is printed and
plotted with forgetting, BWT and FWT (eval/seq_matrix.png, eval/seq_matrix.json).

    python evaluate.py --ckpt runs/tiny/base --suite tiny                                # ~1.5 min on 2 cores
    python evaluate.py --ckpt runs/tiny/base runs/tiny/seq/* --suite tiny --seeds 3      # + the accuracy matrix
    python evaluate.py --ckpt runs/tiny/seq/4-if --suite tiny --matrix                   # matrix with saved rows
    python evaluate.py --ckpt runs/qwen3-8b/seq/4-if --suite full --backend vllm \\
        --source aime26=MathArena/aime_2026 --search-data data/flashrag --search-corpus data/wiki18.jsonl \\
        --tau-data data/tau2/domains/retail --source tau_mock=data/tau2/domains/mock \\
        --source tau_telecom=data/tau2/domains/telecom --user-url http://localhost:8000/v1 --user-model Qwen/Qwen3-32B
    python evaluate.py --ckpt runs/qwen3-8b/base runs/qwen3-8b/seq/[0-9]-* --suite full --backend vllm \\
        --devices 0,1,2,3,4,5,6,7 $EVAL          # $EVAL: the data and service flags above; one process per GPU
    python evaluate.py --ckpt runs/qwen3-8b/seq/4-if --suite full --backend vllm --harness lm-eval $EVAL

Suites. tiny: each domain's `test` (in-domain) and `ood` split of the tiny worlds, 300 tasks, k=1. full: AIME26
(avg@16), GPQA-Diamond, MMLU-Redux, NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue, Bamboogle, tau-retail (test),
tau-mock and tau-telecom (tau3's two other domains, their `base` splits: out-of-domain; telecom's user works a
simulated phone), IFEval, IFBench; every data source is a flag (HF ids
by default where the env has one, local paths otherwise). The
table adds the study's search columns: single_hop (TriviaQA, PopQA) and multi_hop (HotpotQA, 2Wiki, MuSiQue, Bamboogle).

--devices 0,1,...: one evaluation process per device (each sees only its own GPU: CUDA_VISIBLE_DEVICES; `cpu`
entries are CPU processes), checkpoint i going to device i mod D in the order given (a fixed deal: which process
scores a checkpoint never depends on timing); each process writes its checkpoints' records as a one-process run
does, and the launching process prints the table and the accuracy matrix once every process has ended. Why a
launcher and not torchrun: the processes share nothing, and under torchrun every rank's vLLM engine joins one
world-wide group at its start (a collective: a rank left with nothing to do by --resume would hang the others),
ranks that finish hours apart would wait on a collective's timeout, and one failed checkpoint would kill the
other ranks' work. One node; training scripts call evaluate_model() on the in-memory model.

--harness lm-eval: also score the non-agentic benchmarks with lm-eval (`pip install "lm-eval[ifeval,vllm]"`; an
optional package, imported only then), its vLLM backend on the same checkpoint in a process of its own (so its
engine's memory is returned before ours wakes): its task configs, prompts, greedy decoding and answer extraction,
the chat template applied, LM_EVAL_TASKS naming its task for each of our benchmarks (None: lm-eval has none). Its
scores go to the record's `benchmarks_lm_eval`, never into `benchmarks`: the table, the matrix and report.py read
our own harness only, and the lm-eval table is printed apart.

Differences from the paper / notes:
1. tau-telecom's phone and records follow tau2-bench's telecom tools (envs/tau_telecom.py); the status bar is
   written in words where tau2 draws emoji, and a bill made by refuel_data gets a derived id instead of a random one.
2. IFBench ids without a checker in envs/instruct.py are dropped (counted in the log), so IFBench is scored on
   the implemented subset.
3. --backend hf generates with transformers (CPU or GPU); --backend vllm runs one vLLM engine (a GPU at full
   scale) and streams each further checkpoint's weights into it. --backend hf with more than HF_CPU_MAX_GB of
   weights (an 8B checkpoint) on a machine without a GPU is refused in one line: it would take days.
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys
import time

import torch

from acl import routing
from acl.common import (
    Parser,
    check_output,
    check_writable,
    code_revision,
    eta,
    identity,
    is_checkpoint,
    numerics,
    print0,
    run_name,
    save_json,
    source_files,
    source_hash,
    usage_exit,
    write_atomically,
    write_meta,
)
from acl.engine import HFBackend, make_backend
from acl.forgetting import (
    FULL_BENCHMARKS,
    accuracy_matrix,
    bench_domain,
    benchmarks_of,
    load_results,
    markdown_table,
    matrix_table,
    plot_matrix,
)
from envs import DOMAINS, add_data_flags, env_options, make_env, parse_domains
from envs.base import SPLITS, UsageError
from envs.rollout import MAX_TOKENS, MAX_TURN_TOKENS, episode_record, rollout

SUITES = ("tiny", "full")
# Per-suite defaults: tasks per benchmark (None = all), token limits per episode and per assistant turn.
# Full scale uses Qwen3's native 32k context; the tiny model is built for 1-2k tokens.
SUITE_DEFAULTS = {"tiny": {"n": 300, "max_tokens": MAX_TOKENS, "max_turn_tokens": MAX_TURN_TOKENS},
                  "full": {"n": None, "max_tokens": 32768, "max_turn_tokens": 16384}}
TAU_SPLIT = {"tau_retail": "test", "tau_mock": "base", "tau_telecom": "base"}   # tau3's base splits: 10 and 114 tasks
# the gold log-likelihood's tasks per split (--gold-n): the first 300 of the split's tasks at this --n (which 300 may
# depend on n: search draws its questions anew past the ~430 of a split); deterministic, so more tasks narrow nothing
# that matters while costing as much as the sampling
GOLD_N = 300
DEFAULT_K = {"aime26": 16}  # AIME is reported as avg@16; every other benchmark samples once per task
# Sampling temperature per domain. Full: the released evaluation's math 0.6 and tau 0.7; it sets none for search and
# IF, which are sampled at 1.0 (the rollout temperature their in-training evaluation inherits). Tiny: 1.0 everywhere
# (the policy's own distribution). --temperature overrides all, or some domains (math=0.6,...).
SUITE_TEMPERATURE = {"tiny": {"math": 1.0, "search": 1.0, "ecommerce": 1.0, "if": 1.0},
                     "full": {"math": 0.6, "search": 1.0, "ecommerce": 0.7, "if": 1.0}}
# --harness lm-eval: lm-eval's task for each of our non-agentic benchmarks and the metric taken as its score (the
# headline of its task config). None: lm-eval (0.4.13, checked) has no such task, AIME 2024/2025 only and no IFBench,
# so our harness alone scores it. GPQA: the generative chain-of-thought variant, as our harness samples an answer.
LM_EVAL_TASKS = {"aime26": None, "gpqa_diamond": ("gpqa_diamond_cot_zeroshot", "exact_match,flexible-extract"),
                 "mmlu_redux": ("mmlu_redux_generative", "exact_match,default"),
                 "ifeval": ("ifeval", "prompt_level_strict_acc,none"), "ifbench": None}
STAGE_RE = re.compile(r"^seq-(\d+)-(\w+)$")  # a sequential stage: seq-<i>-<domain> (seq-<i>-<domain>-rft is not one)


# ----------------------------------------------------------------------------- benchmarks

def load_benchmarks(suite="tiny", domains=DOMAINS, splits=("test", "ood"), n=None, env_opts=None, sources=None,
                    benchmarks=None, mixed=False) -> dict:
    """{benchmark: (env, tasks)} of a suite; raises UsageError on a bad name, split or data source.

    tiny: `<domain>/<split>` for every domain and split, n tasks each (default 300; or {split: n}) from the tiny worlds (task
    seed 0, so every checkpoint and every seed sees the same tasks); with mixed, also `mixed/<split>` for the test
    and ood splits among `splits`: envs/mixed.py's search-then-arithmetic tasks, which carry no domain tag.
    full: the benchmarks of `domains` (or the names in `benchmarks`), n tasks each (default all); `sources` maps a
    benchmark to an HF id or local path, `env_opts` maps a domain to its Env's constructor arguments (search:
    data/corpus/retriever_url; ecommerce: data/user_url/user_model). `splits` is not used by the full suite."""
    env_opts, sources = env_opts or {}, sources or {}
    if suite not in SUITES:
        raise UsageError(f"unknown suite {suite!r}; expected one of {', '.join(SUITES)}")
    for d in domains:
        if d not in DOMAINS:
            raise UsageError(f"unknown domain {d!r}; expected one of {', '.join(DOMAINS)}")
    n = SUITE_DEFAULTS[suite]["n"] if n is None else n
    if isinstance(n, dict) and suite != "tiny":
        raise UsageError("tasks per split (--n test=N,ood=M) is for the tiny suite")
    n_of = (lambda split: n.get(split, SUITE_DEFAULTS[suite]["n"])) if isinstance(n, dict) else (lambda split: n)
    out = {}
    if suite == "tiny":
        for d in domains:
            env = make_env(d, **env_opts.get(d, {}))
            for split in splits:
                out[f"{d}/{split}"] = (env, env.tasks(split, n=n_of(split), seed=0))
        if mixed:
            from envs.mixed import MixedEnv
            env = MixedEnv()
            for split in [x for x in splits if x in ("test", "ood")]:
                out[f"mixed/{split}"] = (env, env.tasks(split, n=n_of(split), seed=0))
    else:
        names = list(benchmarks) if benchmarks else [b for b, d in FULL_BENCHMARKS.items() if d in domains]
        unknown = [b for b in list(names) + list(sources) if b not in FULL_BENCHMARKS]
        if unknown:
            raise UsageError(f"unknown full-suite benchmark {unknown[0]!r}; expected one of {', '.join(FULL_BENCHMARKS)}")
        envs = {}  # one env per domain: the search env may hold a BM25 index over all of wiki-18
        for b in names:
            d = FULL_BENCHMARKS[b]
            opts = env_opts.get(d, {})
            if d == "ecommerce":  # a tau-bench directory per benchmark; its TAU_SPLIT split is the benchmark
                data = sources.get(b) or (opts.get("data") if b == "tau_retail" else None)
                if not data:
                    flag = "--tau-data DIR or --source tau_retail=DIR" if b == "tau_retail" else f"--source {b}=DIR"
                    raise UsageError(f"{b} needs a tau-bench/tau2 data directory: pass {flag}")
                env = make_env(d, **dict(opts, data=data))
                env.check_services()
                tasks = env.tasks(TAU_SPLIT[b], n=n)
            elif d == "if":  # IFBench has ids without a checker here: drop those rows (counted) rather than fail
                env = make_env(d, **dict(opts, skip_unknown=b == "ifbench"))
                tasks = env.benchmark(b, source=sources.get(b), n=n)
            else:
                if d not in envs:
                    envs[d] = make_env(d, **opts)
                    envs[d].check_services()
                env = envs[d]
                tasks = env.benchmark(b, source=sources.get(b), n=n)
            out[b] = (env, tasks)
    for name, (_, tasks) in out.items():
        if not tasks:
            raise UsageError(f"benchmark {name} has no tasks")
    return out


# ----------------------------------------------------------------------------- evaluation

def evaluate_model(model, tok, suite="tiny", domains=DOMAINS, splits=("test", "ood"), n=None, seeds=1, k=None,
                   temperature=1.0, batch=64, max_tokens=None, max_turn_tokens=None, env_opts=None, backend=None,
                   sources=None, benchmarks=None, tasks=None, label="", gold=True, episodes=None, route=None,
                   reuse=None) -> dict:
    """Score an in-memory model on a suite: {benchmark: {mean, std, n, k, seeds, per_seed, metrics,
    response_tokens (policy-sampled tokens per episode), wall_s, task_ids, per_task, gold}}.

    seeds: a count (sampling seeds 0..seeds-1) or a list of seeds; each seed is one pass over every benchmark,
        whose score is the mean reward over n tasks x k samples. mean/std are over seeds (std: sample standard
        deviation, 0 for one seed); metrics are the env's named metrics (f1, searches, ...) averaged the same way.
    k: samples per task (default 16 for aime26, else 1). n, max_tokens, max_turn_tokens: None = the suite's default.
    temperature: one value for every benchmark, or {domain: value} (bench_domain; a domain not in it samples at 1.0).
    tasks: {benchmark: (env, tasks)} from load_benchmarks(), to reuse across calls; otherwise it is built from
        suite, domains, splits, n, env_opts, sources and benchmarks (see load_benchmarks).
    backend: any rollout backend (default: HFBackend(model, tok, batch)); model may then be None. The sampled
        stream depends on the batch size too (batches are sampled together), so compare runs at the same batch.
    per_task: each task's mean reward over seeds and samples, in task_ids' order: two checkpoints evaluated with
        the same tasks and seeds are compared task by task (paired_difference).
    gold: also score the model teacher-forced on the scripted expert's episodes of the same tasks (gold_likelihood;
        True: every task, an int N: the first N of them (GOLD_N; which ones may depend on n: search past its questions),
        0/False: none; tasks with an expert only, and only with the whole model in this process: an FSDP-sharded policy, which
        train_seq's in-run evaluation hands over under --backend vllm on rank 0 alone, would wait for the other
        ranks forever); deterministic, seconds.
    episodes: a dict to collect every scored episode into, {benchmark: [envs.rollout.episode_record, ...]}.
    route: an MLE router, route(env, task) -> the LoRA adapter directory the task is sampled (and gold-scored) with.
    reuse: (name, {benchmark: result}) of the same MLE directory routed by tag, same tasks and settings: a benchmark
        whose tasks this router sends to the same experts as the tag did is copied from it (marked reused_from: name),
        not sampled again. Exact: the same weights, adapters, tasks, seeds and batches sample the same episodes (a
        rollout reseeds itself; an adapter's first use does not move the stream: tests/test_mle.py).
    The model is put in eval mode and its training mode restored; the global torch RNG is restored too, so
    evaluating in the middle of training does not change the training's random stream."""
    defaults = SUITE_DEFAULTS[suite] if suite in SUITES else {}
    tasks = tasks if tasks is not None else load_benchmarks(suite, domains, splits, n, env_opts, sources, benchmarks)
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list:
        raise UsageError("seeds must be a positive count or a non-empty list")
    max_tokens = max_tokens or defaults.get("max_tokens", MAX_TOKENS)
    max_turn_tokens = max_turn_tokens or defaults.get("max_turn_tokens", MAX_TURN_TOKENS)
    backend = backend or HFBackend(model, tok, batch)
    was_training = model.training if model is not None else False
    gold = gold if model is not None and not any(hasattr(p, "full_tensor") for p in model.parameters()) else False
    if model is not None:
        model.eval()
    results = {}
    try:
        # this process's own GPU only: forking every device's RNG would open a CUDA context on each of them
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            for name, (env, items) in tasks.items():
                kk = k or DEFAULT_K.get(name, 1)
                temp = temperature.get(bench_domain(name), 1.0) if isinstance(temperature, dict) else temperature
                per_seed, per_seed_metrics, lengths, t0 = [], [], [], time.time()
                per_task = [0.0] * len(items)
                adapters = [route(env, t) for t in items] if route else None   # an expert's dir ends in its domain
                routed = [os.path.basename(x.rstrip(os.sep)) for x in adapters] if adapters else None
                prior = reuse[1].get(name) if reuse and adapters else None
                if prior and prior.get("routed_to") == routed:
                    results[name] = dict(prior, reused_from=reuse[0], wall_s=0.0)
                    print0(f"{label}{name}: every task routed as by {reuse[0]}: its scores reused")
                    continue
                for s in seed_list:
                    t1 = time.time()
                    eps = rollout(backend, tok, [(env, t) for t in items], kk, temp, max_tokens=max_tokens,
                                  max_turn_tokens=max_turn_tokens, seed=s, adapters=adapters)
                    dt = time.time() - t1
                    for i, e in enumerate(eps):   # items x samples order: episode i is task i // kk's
                        per_task[i // kk] += e.reward / (kk * len(seed_list))
                    if episodes is not None:
                        episodes.setdefault(name, []).extend(episode_record(e, items[i // kk]) for i, e in enumerate(eps))
                    per_seed.append(sum(e.reward for e in eps) / len(eps))
                    lengths.append(sum(e.n_sampled for e in eps) / len(eps))
                    keys = sorted({m for e in eps for m in e.metrics})
                    per_seed_metrics.append({m: sum(e.metrics.get(m, 0.0) for e in eps) / len(eps) for m in keys})
                    print0(f"{label}{name} seed {s}: {per_seed[-1]:.3f} ({len(items)} tasks x {kk}, {dt:.1f}s, "
                           f"{sum(e.n_sampled for e in eps) / max(dt, 1e-9):.0f} sampled tok/s)")
                keys = sorted({m for ms in per_seed_metrics for m in ms})
                results[name] = {
                    "mean": statistics.mean(per_seed), "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
                    "n": len(items), "k": kk, "temperature": temp, "seeds": len(seed_list), "per_seed": per_seed,
                    "metrics": {m: statistics.mean(ms.get(m, 0.0) for ms in per_seed_metrics) for m in keys},
                    "response_tokens": statistics.mean(lengths), "wall_s": round(time.time() - t0, 1),
                    "task_ids": [t.id for t in items], "per_task": per_task}
                if adapters:   # MLE: which expert served each task (a blend: its directory's name), for router accuracy
                    results[name]["routed_to"] = routed
                if gold:
                    ctx = getattr(model.config, "max_position_embeddings", None) or max_tokens   # the expert is never cut
                    m = len(items) if gold is True else int(gold)
                    g = routed_gold(backend, tok, env, items[:m], adapters and adapters[:m], ctx) if route else \
                        gold_likelihood(model, tok, env, items[:m], max_tokens=ctx, max_turn_tokens=ctx)
                    if g:
                        results[name]["gold"] = g
                        print0(f"{label}{name} gold: log-lik {g['loglik']:.3f}/token, top-1 {g['top1']:.3f} "
                               f"({g['n']} expert episodes, {g['tokens']} agent tokens)")
    finally:
        if model is not None:
            model.train(was_training)
    return results


@torch.no_grad()
def gold_likelihood(model, tok, env, tasks, *, batch_tokens: int = 4096, max_tokens=MAX_TOKENS,
                    max_turn_tokens=MAX_TURN_TOKENS):
    """The dense metric: the model teacher-forced on the scripted expert's clean episodes of `tasks`
    (envs.rollout.expert_episodes), on the expert's (agent) tokens only. Per task: the mean log-likelihood per
    agent token and the fraction of agent tokens that are the model's top-1 prediction; the benchmark's values
    are their means over tasks. Deterministic: no sampling. None when no task has an expert (real data).
    Episodes run as whole sequences batched by length (acl.step.micro_batches, at most batch_tokens padded tokens),
    right-padded and with no attention mask: under causal attention no token sees the padding after it, and without
    a mask attention takes its fast causal path (e-commerce's ~1,000-token episodes: 1.6x faster than left-padded
    prompts with a mask).
    -> {loglik, top1, n, tokens, expert_reward, task_ids, per_task_loglik, per_task_top1}"""
    from acl.step import micro_batches, pad_id
    eps = _expert_episodes(tok, env, tasks, max_tokens, max_turn_tokens)
    if not eps:
        return None
    dev, pad = next(model.parameters()).device, pad_id(model)
    lls, tops = [0.0] * len(eps), [0.0] * len(eps)
    for idx in micro_batches(eps, len(eps), batch_tokens):
        T = max(len(eps[i].token_ids) for i in idx)
        ids, mask = torch.full((len(idx), T), pad, dtype=torch.long), torch.zeros((len(idx), T))
        for row, i in enumerate(idx):
            ids[row, :len(eps[i].token_ids)] = torch.tensor(eps[i].token_ids)
            mask[row, :len(eps[i].token_ids)] = torch.tensor(eps[i].loss_mask, dtype=torch.float)
        ids, target, mask = ids.to(dev), ids[:, 1:].to(dev), mask[:, 1:].to(dev)   # position t predicts token t + 1
        logits = model(input_ids=ids).logits[:, :-1].float()                          # (B, T - 1, V)
        logp = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]   # log p(expert token)
        top1 = (logits.argmax(-1) == target).float()
        n = mask.sum(1).clamp(min=1)
        for i, ll, t in zip(idx, ((logp * mask).sum(1) / n).tolist(), ((top1 * mask).sum(1) / n).tolist()):
            lls[i], tops[i] = ll, t
    return {"loglik": statistics.mean(lls), "top1": statistics.mean(tops), "n": len(eps),
            "tokens": sum(e.n_sampled for e in eps), "expert_reward": statistics.mean(e.reward for e in eps),
            "task_ids": [e.task_id for e in eps], "per_task_loglik": lls, "per_task_top1": tops}


_EXPERT = {}


def _expert_episodes(tok, env, tasks, max_tokens, max_turn_tokens) -> list:
    """envs.rollout.expert_episodes, kept per process: every checkpoint of an evaluate.py call is gold-scored on the
    same expert episodes, whose rendering (a rollout per task through the chat template) costs more than scoring them.
    Keyed by the tokenizer's vocabulary and template, the environment object, the tasks and the limits."""
    import hashlib

    from envs.rollout import expert_episodes
    vocab = hashlib.sha256(json.dumps([sorted(tok.get_vocab().items()), tok.chat_template or ""]).encode()).hexdigest()
    key = (vocab, id(env), tuple(t.id for t in tasks), max_tokens, max_turn_tokens)
    if key not in _EXPERT:
        if len(_EXPERT) >= 64:
            _EXPERT.clear()
        _EXPERT[key] = (env, expert_episodes(tok, env, tasks, max_tokens=max_tokens, max_turn_tokens=max_turn_tokens))
    return _EXPERT[key][1]   # (the env is kept with them, so that its id is not reused while the key lives)


def routed_gold(backend, tok, env, items, adapters, ctx):
    """gold_likelihood with every task scored under the adapter it is routed to (an MLE checkpoint): one pass per
    adapter through the hf backend's model, the per-task values merged back in task order."""
    parts = []
    for adapter in dict.fromkeys(adapters):
        mine = [t for t, x in zip(items, adapters) if x == adapter]
        with backend.with_adapter(adapter):
            parts.append(gold_likelihood(backend.model, tok, env, mine, max_tokens=ctx, max_turn_tokens=ctx))
    parts = [g for g in parts if g]
    if not parts:
        return None
    order = {t.id: i for i, t in enumerate(items)}
    rows = sorted((order[tid], tid, ll, t1) for g in parts
                  for tid, ll, t1 in zip(g["task_ids"], g["per_task_loglik"], g["per_task_top1"]))
    n = sum(g["n"] for g in parts)
    return {"loglik": statistics.mean(r[2] for r in rows), "top1": statistics.mean(r[3] for r in rows), "n": n,
            "tokens": sum(g["tokens"] for g in parts),
            "expert_reward": sum(g["expert_reward"] * g["n"] for g in parts) / n,
            "task_ids": [r[1] for r in rows], "per_task_loglik": [r[2] for r in rows], "per_task_top1": [r[3] for r in rows]}


def evaluate_ckpt(path, suite="tiny", backend_name="hf", router="tag", router_mix=False, max_lora_rank=0,
                  bf16: bool = False, sleep_after: bool = False, **kwargs) -> dict:
    """Load a Hugging Face checkpoint directory and evaluate it (keyword arguments as evaluate_model's).
    The backend comes from acl.engine.make_backend: "vllm" starts one engine with the first checkpoint and
    streams each later one into it tensor by tensor (they must share the first one's architecture); bf16: the engine
    computes in bf16 (as training's rollouts do on GPUs; fp32 doubles the memory and slows prefill several times).
    sleep_after: put the engine to sleep when done (lm-eval's engine comes next on the same GPU).
    Returns the record that main() saves: {ckpt, suite, settings, wall_s, code_revision, benchmarks}."""
    from transformers import AutoTokenizer

    weights = routing.backbone_of(path) if routing.is_mle(path) else path   # an MLE directory: its backbone + experts
    if not is_checkpoint(weights):
        raise UsageError(f"not a checkpoint directory (no config.json): {path}")
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(weights)
    kwargs.setdefault("label", f"[{path}] ")
    if weights != path:
        kwargs["route"] = routing.router(path, router, tok, mix=router_mix)
    batch = kwargs.get("batch", 64) if backend_name == "hf" else max(kwargs.get("batch", 64), 256)
    kwargs["backend"], model = make_backend(backend_name, tok, weights, gen_batch=batch, bf16=bf16,
                                            device=torch.device("cuda") if torch.cuda.is_available() else None,
                                            max_tokens=kwargs.get("max_tokens") or 4096, max_lora_rank=max_lora_rank)
    record = evaluate_record(model, tok, path, suite, t0, **kwargs)
    if sleep_after:
        kwargs["backend"].sleep()   # vLLM: weights to host memory, KV cache freed (the next checkpoint wakes it)
    return record | (dict(router=router, router_mix=router_mix, experts=routing.experts_of(path)) if weights != path else {})


def evaluate_record(model, tok, path, suite="tiny", t0=None, **kwargs) -> dict:
    """evaluate_model's scores as the record an eval JSON holds (evaluate_ckpt; train_seq.py after each stage):
    {ckpt, ckpt_id, suite, settings, wall_s (since t0, default now), code_revision, scoring_code, numerics
    (common.numerics: versions, device, threads; recorded, not identity), evaluated_at, benchmarks}. ckpt_id: the
    checkpoint's identity (common.identity), scoring_code: scoring_code()'s hash."""
    t0 = t0 or time.time()
    benchmarks = evaluate_model(model, tok, suite=suite, **kwargs)
    settings = {key: v for key, v in kwargs.items() if key not in ("tasks", "backend", "label", "route", "reuse")}
    return {"ckpt": path, "ckpt_id": identity(path), "suite": suite, "settings": settings,
            "wall_s": round(time.time() - t0, 1), "code_revision": code_revision(), "scoring_code": scoring_code(),
            "numerics": numerics(), "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "benchmarks": benchmarks}


# ----------------------------------------------------------------------------- lm-eval, the second scorer

def check_lm_eval(names, ckpts) -> dict:
    """--harness lm-eval, checked before any work: lm-eval installed, plain checkpoints, and at least one of the
    benchmarks `names` with an lm-eval task that the installed version has -> {benchmark: (task, metric)}."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise UsageError('--harness lm-eval needs lm-eval: pip install "lm-eval[ifeval,vllm]" (an optional package)')
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("--harness lm-eval runs lm-eval's vLLM backend: vllm is not installed here")
    if any(routing.is_mle(path) for path, *_ in ckpts):
        raise UsageError("--harness lm-eval scores plain checkpoints: it cannot route an MLE directory's tasks to experts")
    tasks = {b: LM_EVAL_TASKS[b] for b in names if LM_EVAL_TASKS.get(b)}
    if not tasks:
        raise UsageError(f"--harness lm-eval: none of {', '.join(names)} has an lm-eval task (it scores "
                         f"{', '.join(b for b, t in LM_EVAL_TASKS.items() if t)})")
    import lm_eval
    from lm_eval.tasks import TaskManager
    known = set(TaskManager().all_tasks)
    missing = [t for t, _ in tasks.values() if t not in known]
    if missing:
        raise UsageError(f"--harness lm-eval: lm-eval {lm_eval.__version__} has no task {missing[0]!r} "
                         f"(LM_EVAL_TASKS names 0.4.13's)")
    skipped = [b for b in names if b in LM_EVAL_TASKS and b not in tasks]
    print0(f"lm-eval {lm_eval.__version__} scores {', '.join(f'{b} ({t})' for b, (t, _) in tasks.items())}"
           + (f"; it has no task for {', '.join(skipped)}" if skipped else ""))
    return tasks


def lm_eval_settings(tasks, settings) -> dict:
    """What lm-eval is run with (kept in the record as lm_eval_settings; --resume compares it): its version, the
    tasks, our dtype, --n as its limit, and our per-turn token limit as its max_gen_toks (its task configs cut at
    1,280 or fewer tokens, which a reasoning model's answer outgrows)."""
    import lm_eval
    return {"version": lm_eval.__version__, "tasks": {b: list(t) for b, t in tasks.items()}, "dtype": settings["dtype"],
            "limit": settings["n"], "max_model_len": settings["max_tokens"], "max_gen_toks": settings["max_turn_tokens"],
            "apply_chat_template": True, "think_end_token": "</think>", "seed": 0}


def lm_eval_scores(path, lm_settings, label="") -> dict:
    """Score checkpoint `path` with lm-eval (run_lm_eval) in a process of its own, so that its vLLM engine's GPU
    memory is returned when it ends (two engines in one process share vLLM's process-wide state) -> {benchmark:
    {task, metric, mean, stderr, metrics, n}} (lm_eval_record)."""
    import subprocess
    import tempfile
    t0 = time.time()
    if torch.cuda.is_available():   # our engine sleeps; give what the allocator caches back to the driver too
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="acl-lm-eval-") as d:
        out = os.path.join(d, "scores.json")
        code = "import json, sys, evaluate; evaluate.run_lm_eval(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])"
        r = subprocess.run([sys.executable, "-c", code, os.path.abspath(path), json.dumps(lm_settings), out],
                           cwd=os.path.dirname(os.path.abspath(__file__)))
        if r.returncode != 0:
            raise RuntimeError(f"lm-eval on {path} failed (status {r.returncode}; its log is above)")
        scores = load_results(out)
    print0(f"{label}lm-eval ({time.time() - t0:.0f}s): " + " | ".join(f"{b} {v['mean']:.3f}" for b, v in scores.items()))
    return scores


def run_lm_eval(path, lm_settings, out):
    """lm-eval's vLLM backend on checkpoint `path` with lm_settings (lm_eval_settings); writes lm_eval_record's
    scores to `out`. Runs in lm_eval_scores' child process."""
    import lm_eval
    s = lm_settings
    results = lm_eval.simple_evaluate(
        model="vllm", model_args=dict(pretrained=path, dtype="bfloat16" if s["dtype"] == "bf16" else "float32",
                                      max_model_len=s["max_model_len"], gpu_memory_utilization=0.8, seed=s["seed"],
                                      think_end_token=s["think_end_token"]),
        tasks=sorted({t for t, _ in s["tasks"].values()}), apply_chat_template=s["apply_chat_template"],
        gen_kwargs={"max_gen_toks": s["max_gen_toks"]}, limit=s["limit"], log_samples=False, random_seed=s["seed"],
        numpy_random_seed=s["seed"], torch_random_seed=s["seed"], fewshot_random_seed=s["seed"])
    save_json(out, lm_eval_record(results, s["tasks"]))


def lm_eval_record(results, tasks) -> dict:
    """lm-eval's results dict -> {benchmark: {task, metric, mean (the metric's value), stderr, metrics (every number
    it reports for the task or group), n (documents scored; None for a group)}}."""
    out = {}
    for bench, (task, metric) in tasks.items():
        r = results["results"].get(task) or results.get("groups", {}).get(task)
        if r is None or not isinstance(r.get(metric), (int, float)):
            raise RuntimeError(f"lm-eval's results have no {metric!r} for task {task!r}")
        name, _, filt = metric.partition(",")
        stderr = r.get(f"{name}_stderr,{filt}")
        out[bench] = {"task": task, "metric": metric, "mean": float(r[metric]),
                      "stderr": stderr if isinstance(stderr, (int, float)) else None,
                      "metrics": {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
                      "n": (results.get("n-samples", {}).get(task) or {}).get("effective")}
    return out


def scoring_code() -> str:
    """A hash of the code that turns a checkpoint into scores: the environments (tasks, rollouts, rewards), this file,
    the engines that sample and MLE's serving. --resume keeps no record made by other scoring code (a `git pull` that changes a reward), and
    report.py puts no two in one table; a change elsewhere (training, the report) leaves it as it is."""
    return source_hash(source_files("evaluate.py", "acl/engine.py", "acl/vllm.py", "acl/routing.py", "envs/*.py"))


def evaluate_inrun(model, tok, ckpt, runs, *, suite, n, batch, max_tokens, max_turn_tokens, env_opts, seconds,
                   backend=None) -> dict:
    """A training script's evaluation of the checkpoint `ckpt` it just wrote (call it on rank 0): every domain on n
    tasks per split, one seed, saved as runs/<preset>/eval/inrun/<name>.json (inrun_path) with the stage's time."""
    name = os.path.relpath(ckpt, runs).replace(os.sep, "-")
    rec = evaluate_record(model, tok, ckpt, suite, n=n, seeds=1, batch=batch, backend=backend, max_tokens=max_tokens,
                          env_opts=env_opts, max_turn_tokens=max_turn_tokens, label=f"[{name}] eval ")
    save_results(inrun_path(os.path.join(runs, "eval"), name), rec | dict(stage_seconds=round(seconds, 1)))
    cells = " | ".join(f"{k} {v['mean']:.3f}" for k, v in rec["benchmarks"].items())
    print0(f"[{name}] eval ({rec['wall_s']:.0f}s; stage took {seconds:.0f}s): {cells}")
    return rec


def save_results(path, results):
    """Write results (a record or a {benchmark: ...} dict) as JSON atomically: a reader never sees half a file."""
    return save_json(path, results)


MATRIX_SETTINGS = ("n", "seeds", "k", "temperature", "max_tokens", "max_turn_tokens")


def settings_note(saved, settings) -> str:
    """How a saved record was made, for the accuracy matrix's rows: its task count, and every setting that
    differs from this run's (so rows made differently are never mixed silently)."""
    theirs = dict(saved.get("settings") or {})
    theirs["n"] = "/".join(map(str, sorted({b["n"] for b in benchmarks_of(saved).values()})))
    diff = [f"{k} {theirs.get(k)} here {settings.get(k)}" for k in MATRIX_SETTINGS[1:]
            if k in theirs and theirs.get(k) != settings.get(k)]
    return ", ".join([f"n={theirs['n']}"] + (["other settings: " + "; ".join(diff)] if diff else []))


def inrun_path(eval_dir, name):
    """Where a training script's in-run evaluation of checkpoint `name` goes: eval/inrun/<name>.json, apart from
    evaluate.py's own records (eval/<name>.json), which it must never replace: it runs on fewer tasks."""
    return os.path.join(eval_dir, "inrun", f"{name}.json")


def eval_temperatures(text, suite):
    """--temperature: None -> the suite's per-domain defaults (SUITE_TEMPERATURE); 'X' -> X everywhere; 'math=0.6,...'
    -> those domains, the others at the suite's default. -> one number when it is the same everywhere (the tiny
    default; then the mixed tasks too), else {domain: value}. UsageError on a bad value."""
    from envs import per_domain
    temps = dict(SUITE_TEMPERATURE[suite])
    if text is not None:
        named = per_domain("--temperature", text, [], cast=float) if "=" in text else \
            per_domain("--temperature", text, list(temps), cast=float)
        temps.update(named)
    if any(not 0 <= v < 10 for v in temps.values()):
        raise UsageError(f"--temperature must be in [0, 10) (0 = greedy); got {text!r}")
    return temps if len(set(temps.values())) > 1 else next(iter(temps.values()))


# ----------------------------------------------------------------------------- tables and the accuracy matrix


# ----------------------------------------------------------------------------- command line


def _stages(names, label) -> list:
    """[(i, name, domain)] of the sequential stages among eval names, sorted by stage number; errors on a typo."""
    stages = []
    for name in names:
        m = STAGE_RE.match(name)
        if m:
            if m.group(2) not in DOMAINS:
                raise UsageError(f"unknown domain {m.group(2)!r} in stage {name} ({label}); expected one of "
                               f"{', '.join(DOMAINS)}")
            stages.append((int(m.group(1)), name, m.group(2)))
    stages.sort()
    numbers, domains = [s[0] for s in stages], [s[2] for s in stages]
    if len(set(numbers)) != len(numbers) or len(set(domains)) != len(domains):
        raise UsageError(f"sequential stages repeat a number or a domain: {', '.join(s[1] for s in stages)}")
    return stages


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="+", default=None, help="checkpoint directories (Hugging Face format, or an MLE "
                                                              "directory: mle.py's backbone + experts + router)")
    p.add_argument("--router", default="tag", choices=["tag", "learned", "request"], help="MLE checkpoints: the expert "
                   "per task from its environment tag, from mle.py's learned router (saved as <name>-learned), or from "
                   "its router on the user's request alone, no tag, system prompt or tools (<name>-request)")
    p.add_argument("--router-mix", action="store_true", help="MLE with --router learned: each task served by a blend "
                   "of the experts weighted by the router's probabilities (saved as <name>-learned-mix)")
    p.add_argument("--resume", action="store_true", help="keep a checkpoint's saved record instead of evaluating it "
                   "again when it was made from the same checkpoint (by identity: not one since replaced under its "
                   "path), with the same settings, data and scoring code (arena.sh, restarted after a kill)")
    p.add_argument("--save-episodes", default=None, metavar="DIR",
                   help="also write every scored episode: DIR/<checkpoint name>/<benchmark>.jsonl, one episode per "
                        "line (chat messages with tools, reward, metrics): teacher rollouts for train_seq.py "
                        "--expert-data")
    p.add_argument("--no-gold", dest="gold", action="store_false",
                   help="skip the gold log-likelihood on the scripted expert's episodes (tiny worlds only)")
    p.add_argument("--gold-n", type=int, default=GOLD_N, metavar="N",
                   help=f"the gold log-likelihood on the first N tasks of each split (default {GOLD_N}: deterministic, "
                        "its standard error over 300 tasks is already 0.001-0.08 nat per token; the sampled scores need more tasks); 0: all")
    p.add_argument("--suite", default="tiny", help="tiny (the tiny worlds' test/ood splits) or full (real benchmarks)")
    p.add_argument("--seeds", type=int, default=1,
                   help="sampling seeds (full passes); mean/std are over seeds. 1 = std 0; use 3 for claims")
    p.add_argument("--k", type=int, default=None, help="samples per task for every benchmark (default: aime26 16, else 1)")
    p.add_argument("--n", default=None, help="tasks per benchmark (default: 300 tiny, all full); tiny: also per split, "
                   "test=300,ood=100 (an unnamed split keeps 300)")
    p.add_argument("--temperature", default=None, help="sampling temperature (0 = greedy): X for every benchmark, or "
                   "per domain, math=0.6,ecommerce=0.7 (the others keep the default). Default: tiny 1.0; full math 0.6, "
                   "ecommerce 0.7 (the released evaluation), search 1.0, if 1.0")
    p.add_argument("--batch", type=int, default=64, help="generation batch size (hf backend)")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="rollout engine: hf (transformers, CPU "
                   "or GPU) or vllm (one engine; each further checkpoint's weights are streamed into it)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="the engine's compute precision "
                   "(auto: bf16 on a GPU, as training's rollouts; fp32 on the CPU)")
    p.add_argument("--devices", default=None, metavar="0,1,...", help="one evaluation process per device (GPU "
                   "indices, or cpu), checkpoint i on device i mod D; the table once all have ended")
    p.add_argument("--harness", default="ours", choices=["ours", "lm-eval"], help="lm-eval: also score the full "
                   "suite's non-agentic benchmarks with lm-eval's vLLM backend (record key benchmarks_lm_eval)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)   # a --devices process: records only
    p.add_argument("--domains", default=",".join(DOMAINS), help="comma-separated domains to evaluate")
    p.add_argument("--mixed", nargs="?", const="add", default=None, choices=["add", "only"],
                   help="tiny suite: also the mixed-domain tasks (envs/mixed.py: a search whose answer feeds an "
                        "arithmetic step), mixed/test and mixed/ood; `--mixed only`: those alone")
    p.add_argument("--splits", default="test,ood", help="tiny suite: comma-separated splits per domain")
    p.add_argument("--benchmarks", default=None, help="full suite: comma-separated benchmarks (default: all of --domains)")
    p.add_argument("--max-tokens", type=int, default=None, help="token limit per episode (default: "
                   + ", ".join(f"{v['max_tokens']} {k}" for k, v in SUITE_DEFAULTS.items()) + ")")
    p.add_argument("--max-turn-tokens", type=int, default=None,
                   help="token limit per assistant turn (default: "
                   + ", ".join(f"{v['max_turn_tokens']} {k}" for k, v in SUITE_DEFAULTS.items()) + ")")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out-dir", default=None, help="where eval JSONs go (default: runs/<preset>/eval of each checkpoint)")
    p.add_argument("--matrix", action="store_true",
                   help="print and plot the accuracy matrix (automatic when the checkpoints include seq/<i>-<domain>)")
    p.add_argument("--source", action="append", default=[], metavar="NAME=PATH_OR_ID",
                   help="full suite: data of one benchmark, an HF id or a local file/dir (repeatable)")
    add_data_flags(p)
    return p.parse_args(argv)


def parse_n(text):
    """--n: None, N, or per split test=N,ood=M -> None, an int or {split: int}; UsageError unless every count >= 1."""
    if text is None:
        return None
    try:
        n = {k.strip(): int(v) for k, _, v in (x.partition("=") for x in text.split(","))} if "=" in text else int(text)
    except ValueError:
        raise UsageError(f"--n takes N or split=N,...; got {text!r}") from None
    for split, v in (n.items() if isinstance(n, dict) else [("", n)]):
        if split and split not in SPLITS:
            raise UsageError(f"--n: unknown split {split!r}; expected some of {','.join(SPLITS)}")
        if v < 1:
            raise UsageError(f"--n must be >= 1, got {text!r}")
    return n


HF_CPU_MAX_GB = 4.0   # weights above this (a ~1B model in fp32) are refused with --backend hf on the CPU


def resolve(a) -> dict:
    """Check every argument and load the benchmarks; UsageError (one line) on bad input, before anything is written."""
    if not a.ckpt:
        raise UsageError("give --ckpt: the checkpoints to evaluate")
    if a.suite not in SUITES:
        raise UsageError(f"unknown suite {a.suite!r}; expected one of {', '.join(SUITES)}")
    a.n = parse_n(a.n)
    for flag in ("seeds", "k", "batch", "max_tokens", "max_turn_tokens"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.threads < 0 or a.gold_n < 0:
        raise UsageError(f"--{'threads' if a.threads < 0 else 'gold-n'} must be >= 0")
    a.temperature = eval_temperatures(a.temperature, a.suite)
    defaults = SUITE_DEFAULTS.get(a.suite, {})
    if (a.max_turn_tokens or defaults["max_turn_tokens"]) > (a.max_tokens or defaults["max_tokens"]):
        raise UsageError(f"--max-turn-tokens ({a.max_turn_tokens or defaults['max_turn_tokens']}) must not exceed "
                         f"--max-tokens ({a.max_tokens or defaults['max_tokens']})")
    domains = [] if a.mixed == "only" else parse_domains(a.domains)
    splits = [s.strip() for s in a.splits.split(",") if s.strip()]
    for s in splits or [""]:
        if s not in SPLITS:
            raise UsageError(f"unknown split {s!r} in --splits; expected a subset of {','.join(SPLITS)}")
    sources = {}
    for item in a.source:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise UsageError(f"--source expects NAME=PATH_OR_ID, got {item!r}")
        sources[name.strip()] = value.strip()
    if sources and a.suite != "full":
        raise UsageError("--source is for the full suite")
    ckpts, seen = [], {}
    for path in a.ckpt:
        if not os.path.isdir(path):
            raise UsageError(f"checkpoint directory not found: {path}")
        routed = routing.is_mle(path)
        if routed:
            routing.router(path, a.router, None)   # its experts (and router) are all there
        elif not is_checkpoint(path):
            raise UsageError(f"not a checkpoint directory (no config.json): {path}")
        weights = routing.backbone_of(path) if routed else path
        gb = sum(os.path.getsize(os.path.join(weights, f)) for f in os.listdir(weights) if f.endswith(".safetensors")) / 1e9
        if a.backend == "hf" and not torch.cuda.is_available() and gb > HF_CPU_MAX_GB:
            raise UsageError(f"{path}: {gb:.0f} GB of weights with --backend hf on a machine without a GPU would take "
                             f"days; run --backend vllm on a GPU")
        eval_dir, name = run_name(path)
        name += (f"-{a.router}" + ("-mix" if a.router_mix else "")) if routed and a.router != "tag" else ""
        eval_dir = a.out_dir or eval_dir
        if eval_dir is None:
            raise UsageError(f"cannot tell the preset of {path} (not under runs/<preset>/): pass --out-dir")
        check_writable(eval_dir, "--out-dir" if a.out_dir else "the eval directory")
        out = os.path.join(eval_dir, f"{name}.json")
        if out in seen:
            raise UsageError(f"{path} and {seen[out]} would both be saved as {out}")
        if a.save_episodes:   # a new directory per checkpoint, or one this project wrote as episodes
            check_output(os.path.join(a.save_episodes, name), "episodes", inputs=[path], overwrite=True,
                         flag="--save-episodes")
        seen[out] = path
        ckpts.append((path, name, eval_dir, out))
    # The matrix: stages evaluated now, plus the base and stages saved earlier in the same eval directory.
    names = [name for _, name, _, _ in ckpts]
    matrix_dir = next((d for _, name, d, _ in ckpts if STAGE_RE.match(name)), ckpts[0][2])
    saved = {os.path.basename(f)[:-5]: f for f in glob.glob(os.path.join(matrix_dir, "*.json"))}
    inrun = {os.path.basename(f)[:-5] for f in glob.glob(inrun_path(matrix_dir, "*"))}
    stages = _stages(names, "--ckpt") if domains else []   # --mixed only: no domain, no matrix
    if a.matrix or stages:
        stages = _stages(set(names) | {s for s in set(saved) | inrun if STAGE_RE.match(s)}, f"--ckpt and {matrix_dir}")
        if not stages:
            raise UsageError(f"--matrix needs sequential stages (runs/<preset>/seq/<i>-<domain>) in --ckpt or {matrix_dir}")
    env_opts = env_options(a) if a.suite == "full" else {}
    benchmarks = [b.strip() for b in a.benchmarks.split(",") if b.strip()] if a.benchmarks else None
    if benchmarks and a.suite != "full":
        raise UsageError("--benchmarks is for the full suite; use --domains and --splits with the tiny suite")
    if a.mixed and (a.suite != "tiny" or not set(splits) & {"test", "ood"}):
        raise UsageError("--mixed adds the tiny worlds' mixed-domain tasks: the tiny suite, with --splits test or ood")
    if a.mixed and a.router == "tag" and any(routing.is_mle(path) for path, *_ in ckpts):
        raise UsageError("--mixed tasks carry no domain tag: evaluate an MLE checkpoint on them with --router learned "
                         "or request")
    devices = parse_devices(a.devices, len(ckpts)) if a.devices and not a.worker else []
    if a.harness == "lm-eval" and a.suite != "full":
        raise UsageError("--harness lm-eval scores the full suite's non-agentic benchmarks: add --suite full")
    names = benchmarks or [b for b, d in FULL_BENCHMARKS.items() if d in domains]
    lm_eval_tasks = check_lm_eval(names, ckpts) if a.harness == "lm-eval" else {}
    tasks = load_benchmarks(a.suite, domains, splits, a.n, env_opts, sources, benchmarks, mixed=a.mixed)
    if a.router_mix and a.router == "tag":
        raise UsageError("--router-mix blends the experts by the learned router's probabilities: add --router learned")
    lora = max([routing.lora_rank_of(path, a.router_mix) for path, *_ in ckpts if routing.is_mle(path)], default=0)
    return {"domains": domains, "splits": splits, "sources": sources, "env_opts": env_opts, "tasks": tasks,
            "ckpts": ckpts, "stages": stages, "matrix_dir": matrix_dir, "saved": saved, "max_lora_rank": lora,
            "devices": devices, "lm_eval": lm_eval_tasks}


def parse_devices(text, n_ckpts) -> list:
    """--devices: comma-separated GPU indices (as this process sees them) or `cpu` entries -> the devices that get
    a checkpoint (at most n_ckpts); UsageError on a bad entry, a GPU named twice (two engines on one GPU) or one
    that is not here."""
    devices = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in devices if d != "cpu" and not d.isdigit()]
    if not devices or bad:
        raise UsageError(f"--devices takes GPU indices or cpu, comma-separated (0,1,2,3); got {text!r}")
    gpus = [int(d) for d in devices if d != "cpu"]
    if len(set(gpus)) != len(gpus):
        raise UsageError(f"--devices names a GPU twice ({text}): one evaluation process per GPU")
    count = torch.cuda.device_count() if gpus else 0
    if any(g >= count for g in gpus):
        raise UsageError(f"--devices {text}: GPU {max(gpus)} is not here ({count} visible)")
    return devices[:n_ckpts]


def main():
    a = parse_args()
    try:
        r = resolve(a)
    except UsageError as e:
        usage_exit(e)
    if a.threads:
        torch.set_num_threads(a.threads)
    defaults = SUITE_DEFAULTS[a.suite]
    settings = dict(domains=r["domains"], splits=r["splits"] if a.suite == "tiny" else None,
                    benchmarks=list(r["tasks"]), n=a.n or defaults["n"], seeds=a.seeds, k=a.k, temperature=a.temperature,
                    batch=a.batch, max_tokens=a.max_tokens or defaults["max_tokens"],
                    max_turn_tokens=a.max_turn_tokens or defaults["max_turn_tokens"], sources=r["sources"],
                    env_opts=r["env_opts"], threads=torch.get_num_threads(), backend=a.backend,
                    gold=gold_setting(a.gold, a.gold_n, r.get("tasks", {})),
                    dtype="bf16" if a.dtype == "bf16" or (a.dtype == "auto" and torch.cuda.is_available()) else "fp32",
                    data=data_identity(r["sources"], r["env_opts"]))
    print0(f"evaluate: suite {a.suite}, {len(r['ckpts'])} checkpoint(s), settings {json.dumps(settings)}")
    if r["devices"]:
        r.pop("tasks")   # the workers load their own; the launcher only waits (a wiki-18 index is gigabytes)
        named = launch_workers(a, r)
    else:
        named = evaluate_all(a, r, settings)
    if a.worker:   # the launcher prints the tables once every worker has ended
        return
    print_tables(a, r, settings, named)


def gold_setting(gold: bool, gold_n: int, tasks: dict):
    """The record's `gold` setting, one value per computation: False (--no-gold), True (every task of every split:
    --gold-n 0, or an N no split reaches), else N (each split's first N). So a run at --n 200 records the same
    setting under any --gold-n >= 200, and --resume keeps its records."""
    if not gold:
        return False
    return True if not gold_n or all(len(items) <= gold_n for _, items in tasks.values()) else gold_n


def evaluate_all(a, r, settings) -> dict:
    """Evaluate (or, with --resume, keep) each checkpoint of r["ckpts"] in this process and save its record as soon
    as it is done -> {name: record}."""
    named, evaluated, t_start = {}, {}, time.time()
    lm_settings = lm_eval_settings(r["lm_eval"], settings) if r["lm_eval"] else None
    plain = json.loads(json.dumps(settings))   # as a saved record holds them (tuples as lists)
    for i, (path, name, _, out) in enumerate(r["ckpts"], 1):
        done = load_results(out) if a.resume and not a.save_episodes and os.path.isfile(out) else None
        record = done if same_computation(done, path, plain) else None
        if record and (lm_settings is None or record.get("lm_eval_settings") == lm_settings):
            print0(f"[{name}] evaluated before with these settings and scoring code, from this checkpoint: {out} kept")
            named[name] = evaluated[path] = record
            continue
        episodes = {} if a.save_episodes else None
        twin = None if record else next((p for p in evaluated if episodes is None and same_weights(p, path)), None)
        tag = tag_record(path, name, out, plain, a) if not record and not twin else None
        if record:
            print0(f"[{name}] our harness's scores kept from {out}; lm-eval's to add")
        elif twin:   # e.g. oracle/math = seq/1-math: the same start, data and seed give the same weights
            print0(f"[{name}] the same files as {twin} (acl_meta.json aside): its scores reused")
            record = dict(evaluated[twin], ckpt=path, ckpt_id=identity(path), same_weights_as=twin, wall_s=0.0)
        else:
            record = evaluate_ckpt(path, a.suite, backend_name=a.backend, router=a.router, router_mix=a.router_mix,
                                   max_lora_rank=r["max_lora_rank"], bf16=settings["dtype"] == "bf16",
                                   seeds=a.seeds, k=a.k, temperature=a.temperature, batch=a.batch,
                                   max_tokens=settings["max_tokens"], max_turn_tokens=settings["max_turn_tokens"],
                                   tasks=r["tasks"], label=f"[{name}] ", gold=settings["gold"], episodes=episodes,
                                   sleep_after=lm_settings is not None, reuse=tag)
            record["settings"] = settings
        if lm_settings is not None and record.get("lm_eval_settings") != lm_settings:
            record = dict(record, benchmarks_lm_eval=lm_eval_scores(path, lm_settings, label=f"[{name}] "),
                          lm_eval_settings=lm_settings)
        try:
            save_results(out, record)
            if episodes is not None:
                print0(f"saved {save_episode_files(os.path.join(a.save_episodes, name), episodes, path)}")
        except OSError as e:
            sys.exit(f"error: writing {out} failed: {e}")
        print0(f"saved {out} ({record['wall_s']:.0f}s) | checkpoint {i}/{len(r['ckpts'])} | "
               f"{eta(t_start, i, len(r['ckpts']) - i)}")
        named[name] = evaluated[path] = record
    return named


def tag_record(path, name, out, settings, a):
    """For an MLE directory evaluated with a router other than the tag (--router learned|request, not --router-mix):
    (the record's name, its benchmarks) of the same directory routed by tag, saved beside `out` by this scoring code
    with these settings (arena.sh evaluates it first), for evaluate_model's reuse; else None."""
    if not routing.is_mle(path) or a.router == "tag" or a.router_mix or a.save_episodes:
        return None
    tag_name = name[: -len(f"-{a.router}")]
    tag_out = os.path.join(os.path.dirname(out), f"{tag_name}.json")
    done = load_results(tag_out) if os.path.isfile(tag_out) else None
    return (tag_name, done["benchmarks"]) if same_computation(done, path, settings) and done.get("router") == "tag" else None


def same_computation(done, path, settings) -> bool:
    """A saved record (or None) made from this checkpoint, as it is now (by identity), with these settings (as a saved
    record holds them) and this scoring code: what --resume keeps, and what a routed MLE may copy from."""
    return bool(done) and done.get("settings") == settings and \
        (done.get("ckpt"), done.get("ckpt_id"), done.get("scoring_code")) == (path, identity(path), scoring_code())


def launch_workers(a, r) -> dict:
    """--devices: one `evaluate.py ... --worker` process per device, device j evaluating checkpoints j, j + D, ...
    in the order given, each seeing only its own GPU (CUDA_VISIBLE_DEVICES; empty for a `cpu` entry); waits for all
    of them, then reads every checkpoint's record back -> {name: record}. Stops with one line per failed worker
    (the records of the others are saved: --resume keeps them)."""
    import signal
    import subprocess
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    procs = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so that `finally` ends the workers too
    try:
        for j, dev in enumerate(r["devices"]):
            share = [path for path, *_ in r["ckpts"][j::len(r["devices"])]]
            gpu = "" if dev == "cpu" else visible.split(",")[int(dev)] if visible else dev   # the physical GPU
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, ACL_EVAL_WORKER=str(j))
            print0(f"worker {j} on {'cpu' if dev == 'cpu' else 'GPU ' + gpu}: {', '.join(share)}")
            # sys.argv[0]: the script this process was started as; the later --ckpt replaces the first
            procs.append((dev, share, subprocess.Popen([sys.executable, sys.argv[0], *sys.argv[1:], "--ckpt", *share,
                                                        "--worker"], env=env)))
        failed = [(dev, share, p.wait()) for dev, share, p in procs]
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.terminate()
    failed = [f for f in failed if f[2] != 0]
    if failed:
        sys.exit("\n".join(f"error: the worker on device {dev} ({', '.join(share)}) exited with status {rc} (its "
                           f"log is above); the other checkpoints' records are saved: add --resume to keep them"
                           for dev, share, rc in failed))
    return {name: load_results(out) for _, name, _, out in r["ckpts"]}


def print_tables(a, r, settings, named):
    """The table across checkpoints (our harness), lm-eval's apart (--harness lm-eval), and the accuracy matrix."""
    print0("\n" + markdown_table(named))
    lm = {name: {b: {"mean": v["mean"], "std": v["stderr"] or 0.0} for b, v in rec["benchmarks_lm_eval"].items()}
          for name, rec in named.items() if rec.get("benchmarks_lm_eval")}
    if lm:
        print0("\nlm-eval, mean ± its standard error over documents (its prompts, greedy decoding and answer "
               "extraction: not comparable with the table above):\n" + markdown_table(lm))
    if r["stages"]:
        sources = {}

        def row(name):  # this run's results, else evaluate.py's saved record, else a training run's in-run one
            if name in named:
                sources[name] = "this run"
                return named[name]
            for path in (r["saved"].get(name), inrun_path(r["matrix_dir"], name)):
                saved = load_results(path) if path and os.path.isfile(path) else None
                if saved and saved.get("suite") == a.suite:
                    sources[name] = f"{os.path.relpath(path, r['matrix_dir'])} ({settings_note(saved, settings)})"
                    return saved
            return None
        rows = [(name, d, row(name)) for _, name, d in r["stages"]]
        m = accuracy_matrix(rows, row("base"), r["domains"])
        m["sources"] = sources
        print0("\n" + matrix_table(m))
        g = accuracy_matrix(rows, row("base"), r["domains"], metric="gold")
        if any(x is not None for vals in g["matrix"] for x in vals):
            m["gold"] = g
            print0("\n" + matrix_table(g))
            print0(f"saved {plot_matrix(g, os.path.join(r['matrix_dir'], 'seq_matrix_gold.png'), 'gold log-likelihood after each stage')}")
        save_results(os.path.join(r["matrix_dir"], "seq_matrix.json"), m)
        print0(f"saved {plot_matrix(m, os.path.join(r['matrix_dir'], 'seq_matrix.png'))}")


def data_identity(sources: dict, env_opts: dict) -> dict:
    """{data flag value: its identity} of every --source and data option that names a file or directory: a file
    rewritten under the same name is other data (settings compared by --resume and report.py)."""
    values = list(sources.values()) + [v for o in env_opts.values() for k, v in o.items() if k in ("data", "corpus")]
    return {v: identity(v) for v in values if isinstance(v, str) and os.path.exists(v)}


def same_weights(a: str, b: str) -> bool:
    """Two checkpoint directories whose files are byte for byte the same, acl_meta.json aside (it names the method
    that wrote it): their evaluations are the same too. Sizes first, so that different checkpoints cost no read."""
    def files(d):
        return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs if f != "acl_meta.json")
    if not (os.path.isdir(a) and os.path.isdir(b)) or (names := files(a)) != files(b):
        return False
    if any(os.path.getsize(os.path.join(a, f)) != os.path.getsize(os.path.join(b, f)) for f in names):
        return False
    import filecmp
    return all(filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False) for f in names)


def save_episode_files(out_dir, episodes, ckpt) -> str:
    """Write {benchmark: [episode records]} as out_dir/<benchmark, / -> ->.jsonl, atomically, with an acl_meta.json
    that marks the directory as this project's episodes (check_output)."""
    def write(tmp):
        for bench, records in episodes.items():
            with open(os.path.join(tmp, bench.replace("/", "-") + ".jsonl"), "w") as f:
                for rec in records:
                    f.write(json.dumps(rec, default=str) + "\n")
        write_meta(tmp, dict(method="episodes", ckpt=os.path.abspath(ckpt), code_revision=code_revision(),
                             counts={b: len(v) for b, v in episodes.items()}))
    return write_atomically(out_dir, write)


if __name__ == "__main__":
    main()
