"""Self-distilled fine-tuning (SDFT): each domain's single-task oracle replays its behaviour, the trajectories are
filtered, and one student is fine-tuned on their balanced union, so that every domain's skill is learned back at
once instead of one after another.

    python sdft.py                                        # tiny: oracles -> runs/tiny/sdft-pool -> runs/tiny/sdft
    python sdft.py --pool runs/tiny/sdft-pool --student runs/tiny/seq/4-if --out runs/tiny/sdft-seqfinal
    python sdft.py --pool runs/tiny/sdft-pool --mix proportional --order graded --out runs/tiny/sdft-ablation/p-g
    torchrun --standalone --nproc_per_node=2 sdft.py --out runs/tiny/sdft-dist    # FSDP2, 2 CPU ranks (gloo)
    torchrun --nproc_per_node=8 sdft.py --preset qwen3-8b --math-data ... --user-url ...   # full scale (vLLM)

1. Collect (skipped with --pool DIR): each domain's oracle (runs/<preset>/oracle/<domain>, or --oracles
   domain=DIR,...) samples --group trajectories for each of --prompts train prompts through envs/rollout.py
   (multi-turn for the agentic domains; hf or vllm backend).
2. Filter, in this order, each step counted per domain (the funnel table):
     correct     full reward;
     tools       every tool call valid JSON, a known tool, arguments that fit its schema (envs.base.valid_tool_calls);
     compliant   the environment's protocol (Env.compliant: an answer in the domain's format and nothing after it,
                 not cut at a limit, e-commerce confirmed every write, IF made no tool call);
     distinct    near-duplicates of the same prompt removed: the same normalised text, or a word 3-gram Jaccard
                 similarity >= --dedup-threshold to a kept trace (1.0: exact-distinct traces only).
3. The kept pool is written to runs/<preset>/sdft-pool/<domain>.jsonl (an episode per line: chat messages with
   the tools, token ids, loss mask, the prompt's oracle pass rate) and pool.json (the funnel, the oracles, the
   tokenizer); --pool reads it back without re-sampling (mle.py's backbone, train_seq.py --expert-data).
4. Train the student (--student; default the base, as the released code) with sdft_loss (near the top),
   batches drawn by --mix (balanced: the same count per domain in every batch) in --order (interleaved, staged,
   graded), lr warmed up then cosine-decayed to 10% -> runs/<preset>/sdft. Resumable: a killed run restarted
   with the same command reuses the pool and continues from its last saved step (--save-every).

The ablation grid (mix x order from the base, and the Seq-Final student), on one pool:
    for m in balanced proportional; do for o in interleaved staged graded; do python sdft.py \\
        --pool runs/tiny/sdft-pool --mix $m --order $o --out runs/tiny/sdft-ablation/$m-$o; done; done; \\
    python sdft.py --pool runs/tiny/sdft-pool --student runs/tiny/seq/4-if --out runs/tiny/sdft-seqfinal

Differences from the paper and the released code:
1. The pool lives beside the checkpoint (runs/<preset>/sdft-pool), not inside it: a checkpoint directory is
   replaced as a whole when it is written (common.write_atomically).
2. Near-dedup defaults to a 0.9 Jaccard threshold; the released code keeps exact-distinct traces (1.0).
3. The tiny preset samples fewer prompts (256-512 a domain, 4 samples each) and trains ~120 steps: about the CPU time
   of the other consolidators (MMOPD, MLE), which the tiny arena compares at a like cost.
"""
import hashlib
import json
import math
import os
import random
import re
import sys
import time

import torch
import torch.distributed as dist

from acl import common
from acl.engine import make_backend
from acl.scale import dry_run
from acl.step import (
    SAVE_DTYPES,
    Cursor,
    add_training_flags,
    check_shared_flags,
    check_user_errors,
    cost_now,
    cost_since,
    mix_quota,
    parse_mix,
    train_on,
)
from envs import DOMAINS, env_options, load_envs, parse_domains, per_domain, require_real_data
from envs.base import EpisodeState, UsageError, read_jsonl, valid_tool_calls
from envs.rollout import Episode, ServiceError, episode_record, rollout

PRESETS = {
    # tiny: sized, before any SDFT score on this base was seen, to about MMOPD's and MLE's CPU time (~6 min: ~2 of
    # sampling, ~120 steps), so that the consolidators compare at a like cost; a pool of ~500 traces a domain
    # (e-commerce fewer: half its prompts fail, and its episodes cost ~20x a math one)
    "tiny": dict(init="runs/tiny/base", prompts="math=512,search=512,ecommerce=256,if=256", group=4,
                 dedup_threshold=0.9, lr=1e-3, warmup=5, epochs=2, batch=32, save_every=20),
    "qwen3-8b": dict(init="Qwen/Qwen3-8B-Base", prompts=2048, group=8, dedup_threshold=0.9, lr=1e-5, warmup=20,
                     epochs=2, batch=128, save_every=50),
}
FILTERS = ("correct", "tools", "compliant", "distinct")
POOL_FORMAT = "aclarena-sdft-pool/1"
NGRAM = 3


# ----------------------------------------------------------------------------- the loss

def sdft_loss(logp, b, x):
    """The SDFT loss, per token (B, T): the negative log-likelihood of the oracles' own tokens. train_on masks it to
    the agent's turns (each episode's loss mask: prompt, tool and user tokens are 0) and averages it:
        L = - sum_{episodes e} sum_{t: mask_e,t = 1} log pi(y_e,t | y_e,<t) / (number of such tokens)
    with --agg token; with --agg seq each episode's mean, averaged over the batch's episodes."""
    return -logp, {}


# ----------------------------------------------------------------------------- 1-2. collect and filter

def agent_text(messages) -> str:
    """The agent's turns of an episode, normalised: lower case, runs of white space as one space."""
    text = "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "assistant")
    return re.sub(r"\s+", " ", text.lower()).strip()


def ngrams(text: str) -> set:
    words = text.split()
    return {tuple(words[i: i + NGRAM]) for i in range(max(1, len(words) - NGRAM + 1))}


def jaccard(x: set, y: set) -> float:
    return len(x & y) / max(1, len(x | y))


def filter_group(env, task, episodes, threshold: float) -> tuple:
    """The four filters on one prompt's samples, in order. -> (kept episodes, {filter: episodes left after it})."""
    left = [e for e in episodes if e.reward >= 1.0]
    counts = {"correct": len(left)}
    left = [e for e in left if valid_tool_calls(e.messages, task.tools)]
    counts["tools"] = len(left)
    left = [e for e in left if env.compliant(EpisodeState(task=task, messages=e.messages, done=True,
                                                          truncated=e.truncated, turns=e.turns))]
    counts["compliant"] = len(left)
    kept, hashes, grams = [], set(), []
    for e in left:
        text = agent_text(e.messages)
        h, g = hashlib.sha256(text.encode()).hexdigest(), ngrams(text)
        if h in hashes or (threshold < 1.0 and any(jaccard(g, k) >= threshold for k in grams)):
            continue
        hashes.add(h)
        grams.append(g)
        kept.append(e)
    counts["distinct"] = len(kept)
    return kept, counts


def pool_record(ep, task, pass_rate: float) -> dict:
    """One line of a pool file: episode_record's chat messages, tools and score, plus what training reads."""
    return episode_record(ep, task) | dict(token_ids=ep.token_ids, loss_mask=ep.loss_mask, prompt_len=ep.prompt_len,
                                           turns=ep.turns, pass_rate=pass_rate)


def pool_episode(r: dict) -> Episode:
    """A pool record as the Episode it was (sampling log-probs are not kept: SFT does not read them), with the
    oracle's pass rate on its prompt as .pass_rate (--order graded)."""
    ep = Episode(r["task_id"], r["env"], r.get("split", "train"), r.get("sample", 0), list(r["token_ids"]),
                   list(r["loss_mask"]), [0.0] * len(r["token_ids"]), r["prompt_len"], reward=float(r["reward"]),
                   metrics=dict(r.get("metrics") or {}), messages=r.get("messages") or [],
                   truncated=bool(r.get("truncated")), turns=int(r.get("turns", 0)))
    ep.pass_rate = float(r.get("pass_rate", 1.0))
    return ep


def gather(records: list) -> list:
    """Every rank's records, on every rank."""
    if not common.sharded():
        return records
    parts = [None] * common.world_size()
    dist.all_gather_object(parts, records)
    return [r for p in parts for r in p]


def collect(a, envs, device) -> tuple:
    """Sample and filter every domain's pool. -> ({domain: [records]}, {domain: funnel}); the records are in the
    same order on any number of ranks (prompt order, then sample)."""
    pools, funnels = {}, {}
    for d in a.domains:
        t0, cost0 = time.time(), cost_now()
        env, oracle = envs[d], a.oracles[d]
        train = env.tasks("train", seed=a.seed)
        tasks = [train[j] for j in Cursor(len(train), a.seed + 2).take(a.prompts_by_domain[d])]
        order = {t.id: i for i, t in enumerate(tasks)}
        mine = tasks[common.rank()::common.world_size()]
        backend, engine = make_backend(a.backend, a.tok, oracle, device=device, gen_batch=a.gen_batch,
                                       kv_cache_gb=a.kv_cache_gb, bf16=a.bf16, gpu_util=a.vllm_gpu_util,
                                       max_tokens=a.max_tokens, seed=a.seed, attn=a.attn)
        t_gen = time.time()   # the sampling alone (loading the oracle and the train prompts is not the backend's speed)
        eps = rollout(backend, a.tok, [(env, t) for t in mine], a.group, a.temperature, max_tokens=a.max_tokens,
                      max_turn_tokens=a.max_turn_tokens, seed=a.seed * 7919 + common.rank())
        check_user_errors(eps, a.max_user_errors, f"[sdft] collecting {d}")   # a dead user's episodes all fail
        dt, gen = time.time() - t0, common.all_reduce_max(time.time() - t_gen)
        n_tok = common.all_reduce_sum(float(sum(e.n_sampled for e in eps)))
        backend.sleep()   # vLLM: the one shared engine gives its memory back for the filter and the student's SFT
        del backend, engine
        counts, records = dict.fromkeys(FILTERS, 0), []
        for i, t in enumerate(mine):
            group = eps[i * a.group: (i + 1) * a.group]
            kept, c = filter_group(env, t, group, a.dedup_threshold)
            pass_rate = sum(e.reward >= 1.0 for e in group) / len(group)
            records += [pool_record(e, t, pass_rate) for e in kept]
            counts = {k: counts[k] + c[k] for k in FILTERS}
        records = sorted(gather(records), key=lambda r: (order[r["task_id"]], r["sample"]))
        funnel = dict(generated=len(tasks) * a.group, **{k: int(common.all_reduce_sum(v)) for k, v in counts.items()},
                      prompts=len(tasks), prompts_kept=len({r["task_id"] for r in records}),
                      sampled_tokens=int(n_tok), seconds=round(dt, 1), gen_seconds=round(gen, 1),
                      tok_per_s=round(n_tok / max(gen, 1e-9), 1), cost=cost_since(cost0))
        common.print0(f"[sdft] {d}: {len(tasks)} prompts x {a.group} from {oracle}: {funnel['correct']} correct, "
                      f"{funnel['distinct']} kept | {n_tok / max(gen, 1e-9):.0f} sampled tok/s ({gen:.0f}s sampling, "
                      f"{dt:.0f}s in all)")
        pools[d], funnels[d] = records, funnel
    return pools, funnels


def print_funnel(funnels: dict):
    common.print0("| domain | generated | " + " | ".join(FILTERS) + " | kept | prompts with a kept trace |")
    common.print0("|---" * (len(FILTERS) + 4) + "|")
    for d, f in funnels.items():
        common.print0(f"| {d} | {f['generated']} | " + " | ".join(str(f[k]) for k in FILTERS) +
                      f" | {f['distinct']} | {f['prompts_kept']}/{f['prompts']} ({f['prompts_kept'] / max(1, f['prompts']):.2f}) |")


# ----------------------------------------------------------------------------- 3. the pool on disk

def write_pool(path: str, pools: dict, meta: dict):
    """<domain>.jsonl per domain, then pool.json (what makes a directory a pool), atomically as a whole."""
    def write(tmp):
        for d, records in pools.items():
            with open(os.path.join(tmp, f"{d}.jsonl"), "w", encoding="utf-8") as f:
                for r in records:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        with open(os.path.join(tmp, "pool.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
    common.write_atomically(path, write)


def pool_meta(path: str) -> dict:
    """pool.json of a pool directory, or a UsageError naming what is wrong."""
    meta_path = os.path.join(path, "pool.json")
    if not os.path.isfile(meta_path):
        raise UsageError(f"--pool {path}: not an SDFT pool (no pool.json; sdft.py writes one)")
    try:
        meta = json.load(open(meta_path))
    except ValueError as e:
        raise UsageError(f"--pool {path}: pool.json is not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != POOL_FORMAT:
        raise UsageError(f"--pool {path}: pool.json is not in the {POOL_FORMAT} format")
    return meta


def read_pool(path: str, domains) -> dict:
    """{domain: [Episode]} from a pool directory, every record checked; UsageError (one line) on a missing domain
    file or a malformed record."""
    pool_meta(path)
    out = {}
    for d in domains:
        f = os.path.join(path, f"{d}.jsonl")
        if not os.path.isfile(f):
            raise UsageError(f"--pool {path}: no {d}.jsonl (the pool holds {', '.join(pool_meta(path)['domains'])})")
        eps = []
        for i, r in enumerate(read_jsonl(f), 1):
            ids, mask, n = (r.get("token_ids"), r.get("loss_mask"), r.get("prompt_len")) if isinstance(r, dict) else (None,) * 3
            ok = (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask) and isinstance(n, int)
                  and 0 < n < len(ids) and all(isinstance(t, int) for t in ids) and set(mask) <= {0, 1} and any(mask)
                  and r.get("env") == d and isinstance(r.get("task_id"), str) and isinstance(r.get("reward"), (int, float)))
            if not ok:
                raise UsageError(f"--pool {f} line {i}: not a {d} pool record (token_ids, loss_mask of the same length "
                                 f"with agent tokens, prompt_len, task_id, reward, env)")
            eps.append(pool_episode(r))
        if not eps:
            raise UsageError(f"--pool {f}: no episode")
        out[d] = eps
    return out


# ----------------------------------------------------------------------------- 4. the batches

def stream(eps: list, order: str, rng: random.Random):
    """An endless walk over one domain's episodes, epoch after epoch: a fresh shuffle each epoch, or (graded) from
    the prompts the oracle solved most often to the ones it solved least, ties shuffled."""
    while True:
        idx = list(range(len(eps)))
        rng.shuffle(idx)
        if order == "graded":
            idx.sort(key=lambda i: -eps[i].pass_rate)   # stable: the shuffle breaks ties
        yield from idx


def schedule(pools: dict, mix, order: str, batch: int, steps: int, seed: int) -> list:
    """Every step's batch as [(domain, index in its pool)], fixed by the seed (a resumed run redraws the same).
    interleaved/graded: each batch holds mix_quota's count of each domain; staged: the domains one after another in
    --domains order, each for its mix share of the steps, whole batches of it."""
    rng = random.Random(seed)
    walks = {d: stream(eps, order, rng) for d, eps in pools.items()}
    sizes = {d: len(eps) for d, eps in pools.items()}
    if order != "staged":
        quota = mix_quota(mix, sizes, batch)
        return [[(d, next(walks[d])) for d in pools for _ in range(quota[d])] for _ in range(steps)]
    share = mix_quota(mix, sizes, steps)   # steps per domain, the same rounding
    return [[(d, next(walks[d])) for _ in range(batch)] for d in pools for _ in range(share[d])]


def lr_at(a, step: int, steps: int) -> float:
    """Linear warmup over --warmup steps, then a cosine decay to 10% of --lr at the last step."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, steps - a.warmup - 1)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ----------------------------------------------------------------------------- command line

def get_args(argv=None):
    p, name, preset = common.preset_parser(PRESETS, __doc__, argv)
    p.add_argument("--domains", default=",".join(DOMAINS), help="domains, in curriculum order (staged follows it)")
    p.add_argument("--oracles", default=None, help="domain=DIR,... (default <runs>/oracle/<domain>)")
    p.add_argument("--pool", default=None, metavar="DIR", help="train on this pool instead of collecting one")
    p.add_argument("--prompts", default=preset["prompts"], help="train prompts sampled per domain: N or domain=N,...")
    p.add_argument("--group", type=int, default=preset["group"], help="trajectories per prompt")
    p.add_argument("--dedup-threshold", type=float, default=preset["dedup_threshold"],
                   help="word 3-gram Jaccard similarity at which a trace of the same prompt is a duplicate (1.0: only "
                        "exact duplicates of the normalised text)")
    p.add_argument("--student", default=preset["init"], help="starting checkpoint (default the base; the paper's "
                                                             "wording suggests the consolidated student, e.g. seq/4-if)")
    p.add_argument("--mix", default="balanced", help="balanced (same count per domain per batch), proportional (to "
                                                     "pool sizes) or weights w1,w2,... in --domains order")
    p.add_argument("--order", default="interleaved", choices=["interleaved", "staged", "graded"],
                   help="interleaved: shuffled; staged: domain by domain; graded: easy to hard by oracle pass rate")
    p.add_argument("--lr", type=float, default=preset["lr"], help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=preset["warmup"], help="linear warmup steps")
    p.add_argument("--epochs", type=float, default=preset["epochs"], help="passes over the pool (sets --steps)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0: --epochs x pool size / --batch)")
    p.add_argument("--batch", type=int, default=preset["batch"], help="episodes per optimizer step (global)")
    p.add_argument("--save-every", type=int, default=preset["save_every"], help="steps between resume states (0: never)")
    p.add_argument("--out", default=None, help="student checkpoint (default <runs>/sdft)")
    p.add_argument("--overwrite", action="store_true", help="replace an sdft checkpoint made with another recipe")
    add_training_flags(p, name)
    return p.parse_args(argv)


def check_args(a):
    """Every bad input stops here with a UsageError, before anything is loaded or written."""
    check_shared_flags(a)
    a.domains = list(parse_domains(a.domains))
    a.runs = a.runs or os.path.join("runs", a.preset)
    a.out = a.out or os.path.join(a.runs, "sdft")
    a.prompts_by_domain = per_domain("--prompts", a.prompts, a.domains)
    a.mix = parse_mix(a.mix, a.domains, named=("balanced", "proportional"))
    for ok, msg in [(a.group >= 1, "--group must be >= 1"), (min(a.prompts_by_domain.values()) >= 1, "--prompts must be >= 1"),
                    (0 < a.dedup_threshold <= 1, "--dedup-threshold must be in (0, 1]"), (a.lr > 0, "--lr must be > 0"),
                    (a.warmup >= 0, "--warmup must be >= 0"), (a.steps >= 0 and a.epochs > 0, "need --steps >= 0, --epochs > 0"),
                    (a.batch >= 1, "--batch must be >= 1"), (a.save_every >= 0, "--save-every must be >= 0"),
                    (a.mix != "balanced" or a.batch % len(a.domains) == 0 or a.order == "staged",
                     f"--mix balanced needs --batch divisible by the {len(a.domains)} domains")]:
        if not ok:
            raise UsageError(msg)
    if not common.is_checkpoint(a.student) and not a.dry_run:
        raise UsageError(f"--student checkpoint not found: {a.student}")
    if a.dry_run:
        return a
    a.pool_dir = a.pool or os.path.join(a.runs, "sdft-pool")
    if not a.pool and a.preset != "tiny" and not os.path.isfile(os.path.join(a.pool_dir, "pool.json")):
        require_real_data(a, a.domains)   # collecting: the oracles run in the real environments
    given = dict(x.partition("=")[::2] for x in a.oracles.split(",")) if a.oracles else {}
    if given:
        parse_domains(",".join(given))
    a.oracles = {d: given.get(d, os.path.join(a.runs, "oracle", d)) for d in a.domains}
    if a.pool:
        meta = pool_meta(a.pool)
        read_pool(a.pool, a.domains)
        tokenizers = {f"the pool {a.pool}": meta.get("tokenizer")}
    else:
        for d, path in a.oracles.items():
            if not common.is_checkpoint(path):
                raise UsageError(f"no oracle for {d}: {path} is not a checkpoint (train it with python train_seq.py "
                                 f"--oracle, or pass --oracles {d}=DIR, or --pool DIR)")
        tokenizers = {f"the {d} oracle {p}": common.tokenizer_hash(p) for d, p in a.oracles.items()}
    a.tokenizer = common.tokenizer_hash(a.student)   # the oracles' too, once checked: the pool records it
    for what, h in tokenizers.items():
        if h != a.tokenizer:
            raise UsageError(f"--student {a.student} has another tokenizer than {what}: its token ids would mean "
                             f"other tokens")
    common.check_output(a.out, "sdft", inputs=[a.student, *a.oracles.values(), a.pool_dir], overwrite=True)
    if common.read_meta(a.out) and common.read_meta(a.out).get("recipe") != recipe(a) and not a.overwrite:
        raise UsageError(f"--out {a.out} holds an sdft checkpoint made with another recipe; pass --overwrite to "
                         f"replace it")
    if not a.pool:
        common.check_writable(a.pool_dir, "--pool")
        if os.path.exists(os.path.join(a.pool_dir, "pool.json")) and pool_meta(a.pool_dir).get("recipe") != pool_recipe(a):
            raise UsageError(f"{a.pool_dir} holds a pool collected with another recipe: train on it with --pool "
                             f"{a.pool_dir}, or collect under another --runs")
    return a


def pool_recipe(a) -> dict:
    """What a collected pool depends on (a rerun reuses a pool with the same)."""
    return dict(domains=a.domains, oracles={d: os.path.abspath(p) for d, p in a.oracles.items()},
                oracle_ids={d: common.identity(p) for d, p in a.oracles.items()}, prompts=a.prompts_by_domain, group=a.group, dedup_threshold=a.dedup_threshold,
                temperature=a.temperature, max_tokens=a.max_tokens, max_turn_tokens=a.max_turn_tokens, seed=a.seed)


def recipe(a) -> dict:
    """What the student checkpoint (and a resume state) depends on."""
    pool_json = os.path.join(a.pool_dir, "pool.json")
    pool = hashlib.sha256(open(pool_json, "rb").read()).hexdigest() if os.path.isfile(pool_json) else pool_recipe(a)
    return dict(student=os.path.abspath(a.student), student_id=common.identity(a.student), pool=pool, domains=a.domains, mix=a.mix, order=a.order, lr=a.lr,
                warmup=a.warmup, epochs=a.epochs, steps=a.steps, batch=a.batch, agg=a.agg, grad_clip=a.grad_clip,
                seed=a.seed)


# ----------------------------------------------------------------------------- main

def main(argv=None):
    a = get_args(argv)
    try:
        a = check_args(a)
        if a.dry_run:
            dry_run(a, a.student, a.world_size, a.micro_batch, a.max_tokens)
            return
        collecting = not a.pool and not os.path.isfile(os.path.join(a.pool_dir, "pool.json"))
        envs = load_envs(a.domains, env_options(a), a.seed) if collecting else None
    except UsageError as e:
        common.usage_exit(e)
    device = common.start_run(a, f"sdft: {', '.join(a.domains)} -> {a.out}", [a.out, a.pool_dir])
    t0 = time.time()
    # ---- 1-3. the pool: collected and filtered once, then always read back from disk
    if collecting:
        from transformers import AutoTokenizer
        a.tok = AutoTokenizer.from_pretrained(a.oracles[a.domains[0]])
        try:
            records, funnels = collect(a, envs, device)
        except ServiceError as e:
            sys.exit(f"error: {e}; nothing written")
        print_funnel(funnels)
        for d, f in funnels.items():
            empty = next((k for k in FILTERS if f[k] == 0), None)
            if empty:
                sys.exit(f"error: the {empty!r} filter left no {d} episode ({f['generated']} generated; funnel "
                         f"{' -> '.join(str(f[k]) for k in FILTERS)}); nothing written")
        if common.rank() == 0:
            write_pool(a.pool_dir, records, dict(format=POOL_FORMAT, domains=a.domains, recipe=pool_recipe(a),
                                               funnel=funnels, tokenizer=a.tokenizer,
                                               seconds=round(time.time() - t0, 1)))
            common.print0(f"[sdft] pool written: {a.pool_dir}")
        if common.sharded():
            dist.barrier()
    else:
        common.print0(f"[sdft] pool: {a.pool_dir} ({'given' if a.pool else 'collected before with this recipe'})")
        print_funnel(pool_meta(a.pool_dir).get("funnel", {}))
    train_student(a, read_pool(a.pool_dir, a.domains), device, t0)
    common.teardown()


def train_student(a, pools: dict, device, t0: float):
    """Step 4: the student fine-tuned on the pools -> a.out (a checkpoint finished with this recipe is kept; a killed
    one resumes). mle.py --continual composes it: each backbone refresh is this on the pools seen so far."""
    cost0 = cost_now()
    sizes = {d: len(e) for d, e in pools.items()}
    steps = a.steps or max(1, math.ceil(a.epochs * sum(sizes.values()) / a.batch))
    plan = schedule(pools, a.mix, a.order, a.batch, steps, a.seed)
    quota = mix_quota(a.mix, sizes, a.batch)
    common.print0(f"[sdft] pool sizes {sizes}; {steps} steps of {a.batch} episodes, mix {a.mix} "
                  f"({'per batch ' + str(quota) if a.order != 'staged' else 'steps per domain ' + str(mix_quota(a.mix, sizes, steps))})"
                  f", order {a.order}")
    # ---- 4. the student
    rec = recipe(a)
    if common.read_meta(a.out).get("recipe") == rec:
        common.print0(f"[sdft] {a.out} finished before with this recipe, nothing to do")
        return
    try:
        common.check_run_files(a.out, rec, replace=a.overwrite)
    except UsageError as e:
        common.usage_exit(e)
    common.seed_all(a.seed)
    policy, tok = common.load_policy(a.student, common.shard_device(device), a.attn, a.grad_ckpt)
    policy = common.shard(policy, bf16=a.bf16, cpu_offload=a.cpu_offload, compiled=a.compile)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    resume_path = common.run_files(a.out)[0]
    extra = common.resume_state(resume_path, policy, opt, "[sdft]")
    start = extra["step"] if extra else 0
    metrics = common.Metrics(a.out, start, wandb=a.wandb, config=vars(a))
    t1 = time.time()
    try:
        for step in range(start, steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(a, step, steps)
            batch = [pools[d][i] for d, i in plan[step]][common.rank()::common.world_size()]
            ts = time.time()
            loss, stats = train_on(policy, opt, batch, sdft_loss, micro_batch=a.micro_batch, micro_tokens=a.micro_tokens,
                                   agg=a.agg, grad_clip=a.grad_clip)
            dt = time.time() - ts
            n_tok = common.all_reduce_sum(float(sum(len(e.token_ids) for e in batch)))
            n_loss = common.all_reduce_sum(float(sum(e.n_sampled for e in batch)))
            metrics.log(dict(step=step + 1, nll=loss, lr=lr_at(a, step, steps), grad_norm=stats["grad_norm"],
                             tok_s=round(n_tok / dt, 1), trained_tok_s=round(n_loss / dt, 1), seconds=round(dt, 2)))
            if step % 5 == 0 or step == steps - 1:
                common.print0(f"[sdft] step {step + 1}/{steps} | nll {loss:.4f} | lr {lr_at(a, step, steps):.2e} | grad "
                              f"{stats['grad_norm']:.2f} | {n_tok / dt:.0f} tok/s ({n_loss / dt:.0f} trained) | "
                              f"{common.eta(t1, step + 1 - start, steps - step - 1)}")
            if a.save_every and (step + 1) % a.save_every == 0 and step + 1 < steps:
                common.save_train_state(resume_path, policy, opt, dict(step=step + 1), recipe=rec)
        metrics.finish()
    except FloatingPointError as e:
        common.stop_diverged(a.out, f"[sdft] step {step + 1}: {e}; nothing non-finite was saved", e)
    meta = dict(method="sdft", stage="sdft", parent=os.path.abspath(a.student), curriculum_position=None,
                step=steps, seed=a.seed, recipe=rec, pool=os.path.abspath(a.pool_dir), pool_sizes=sizes,
                quota=quota, config={k: v for k, v in vars(a).items() if k != "tok"},
                seconds=round(time.time() - t0, 1), cost=cost_since(cost0))
    common.save_final(a.out, policy, tok, meta, SAVE_DTYPES[a.save_dtype], t0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
