"""Multi-teacher mixed on-policy distillation (MMOPD): the student samples on its own prompts from every domain, each
episode is scored by the frozen teacher that owns its domain (never by an average of teachers), and the student
learns from that teacher's per-token distribution. No environment reward is used (it is logged).

    python mmopd.py                                       # tiny: Seq-Final student, stage teachers -> runs/tiny/mmopd
    python mmopd.py --teachers oracle --out runs/tiny/mmopd-ablation/oracle     # the released scripts' teachers
    python mmopd.py --fkl-coef 0 --fkl-start 0 --out runs/tiny/mmopd-ablation/rkl-only
    python mmopd.py --gate-entropy topq --out runs/tiny/mmopd-ablation/topq
    python report.py --mmopd-kl runs/tiny/mmopd runs/tiny/mmopd-ablation/* --out runs/tiny/eval/mmopd-kl.png   # its KLs
    torchrun --standalone --nproc_per_node=2 mmopd.py --out runs/tiny/mmopd-dist    # FSDP2, 2 CPU ranks (gloo)
    torchrun --nproc_per_node=8 mmopd.py --preset qwen3-8b --math-data ... --user-url ...   # full scale (vLLM)
    python mmopd.py --preset qwen3-8b --dry-run           # per-rank memory with the four teachers
    torchrun --nproc_per_node=8 mmopd.py --preset qwen3-8b --domains math,search,ecommerce --teachers oracle \
        --student runs/qwen3-8b/sdft-500 --prompts 32 --group 8 --steps 300 --max-tokens 8192 --rkl-coef 0.5 \
        --rkl-gate --gate-entropy topq-raw --out runs/qwen3-8b/mmopd-released ...   # the authors' released EOPD run
        (three oracle teachers, no IF; student an early SDFT checkpoint: sdft.py --steps 500 --out .../sdft-500,
        whose lr schedule ends at step 500 where the released one was mid-run; AdamW here, Adam (0.9, 0.98) there)

Each step:
  1. --prompts train prompts drawn from the domains' train splits by --mix (balanced: the same count per domain);
     the student samples --group episodes of each through envs/rollout.py (multi-turn: tools answer, the user
     replies; the reward is logged, not used);
  2. routing: each episode goes to its domain's teacher (--teachers seq: the sequential stage that learned the domain,
     the paper's; oracle: the single-task oracles, the released scripts'; or domain=DIR,...), which scores it in one
     teacher-forced pass (route_to_teachers, below): at each agent position the log-prob of the sampled token,
     the exact entropy over the whole vocabulary and the top-q tokens with their log-probs; an episode whose scores
     are not finite is dropped and counted;
  3. one update with the loss written out in mmopd_loss (tool results and user tokens are masked out of it);
  4. the new weights go into the rollout engine.
A killed run restarted with the same command resumes from its last saved step (--save-every).

Differences from the paper and the released code:
1. The tiny preset runs --steps 40 with the forward-KL warm-up over 20 steps (released: 40 steps of warm-up).
2. The student's entropy in the log is the Monte-Carlo estimate -mean log pi(y_t) over its own samples (the
   teacher's is exact).
"""
import glob
import os
import sys
import time

import torch

from acl import common
from acl.engine import make_backend, push_weights, wake_and_push
from acl.scale import dry_run, init_config
from acl.step import (
    SAVE_DTYPES,
    Cursor,
    add_training_flags,
    check_shared_flags,
    check_user_errors,
    clipped_surrogate,
    cost_now,
    cost_since,
    mix_quota,
    parse_mix,
    teacher_scores,
    train_on,
)
from envs import DOMAINS, env_options, load_envs, parse_domains, require_real_data
from envs.base import UsageError
from envs.rollout import ServiceError, rollout

PRESETS = {
    "tiny": dict(base="runs/tiny/base", prompts=16, group=4, steps=40, lr=2e-4, top_q=16, alpha=0.5, fkl_start=0.05,
                 fkl_coef=0.2, fkl_warmup=20, save_every=10),
    "qwen3-8b": dict(base="Qwen/Qwen3-8B-Base", prompts=64, group=4, steps=200, lr=1e-6, top_q=16, alpha=0.5,
                     fkl_start=0.05, fkl_coef=0.2, fkl_warmup=40, save_every=20),
}
STATS = ("rkl", "fkl", "gate", "t_ent", "s_ent", "disagree")


class TeacherFailure(RuntimeError):
    """Every episode of a step lost its teacher's scores: nothing real to learn from."""


# ----------------------------------------------------------------------------- the loss

def mmopd_loss(logp, b, x, a, beta_f: float):
    """The MMOPD per-token loss (B, T); train_on masks it to the student's own tokens (tool results and the user's
    replies are 0 in b["mask"]: no loss, no gradient) and averages it over them (--agg token).
    logp: the student's log-probs of its sampled tokens (with grad); x["t_lp"]: the routed teacher's log-prob of
    the same tokens; x["t_ent"]: the teacher's exact entropy; x["t_top_lp"], x["t_top_ids"]: the teacher's top-q
    log-probs and ids; x["t_top_ids_logp"]: the student's log-probs at those ids (with grad); x["dom"]: the
    episode's domain index (for the per-domain log only)."""
    old = logp.detach()
    t_top = x["t_top_lp"]                                           # (B, T, q), normalised over the whole vocabulary
    log_pt = torch.log_softmax(t_top, -1)                           # the teacher renormalised over its top-q
    pt = log_pt.exp()
    h_topq = -(pt * log_pt).sum(-1)                                 # its entropy: a lower bound of the full one
    h_raw = -(t_top.exp() * t_top).sum(-1)                          # the released code's: the top-q's own terms of
    h = {"full": x["t_ent"], "topq": h_topq, "topq-raw": h_raw}[a.gate_entropy]   # the full sum, unrenormalised
    # The gate: where the teacher is unsure (H_T > alpha nats) it keeps several continuations alive; reverse KL
    # there would push the student onto one of them, so the forward term takes over at those positions.
    unsure = (h > a.alpha).float()
    # 1. Reverse KL(student || teacher) on the student's own samples, as a per-token advantage (on-policy
    #    distillation): A_t = -(log pi_old(y_t) - log p_T(y_t)), no gradient through it. Tokens the teacher finds
    #    likelier than the student are pushed up, the others down; E[-A] is the reverse KL. It is mode-seeking, which
    #    is what we want where the teacher is sure. --rkl-gate keeps it to those positions (the released variant).
    adv = -a.rkl_coef * (old - x["t_lp"])                            # (--rkl-coef: the released opd_kl_coef 0.5)
    pg, clipped = clipped_surrogate(logp - old, adv, old, b["slp"], a.clip_low, a.clip_high, a.tis_cap)
    rkl_term = pg * (1.0 - unsure) if a.rkl_gate else pg
    # 2. Forward KL(teacher || student) where the teacher is unsure, in closed form over the teacher's top-q tokens,
    #    both distributions renormalised over that set: sum_i p_T(i) (log p_T(i) - log p_S(i)). It is mass-covering:
    #    the student keeps every branch the teacher keeps (the study: agentic search collapses without it).
    log_ps = torch.log_softmax(x["t_top_ids_logp"], -1)
    fkl = (pt * (log_pt - log_ps)).sum(-1)
    loss = rkl_term + beta_f * unsure * fkl
    per = dict(rkl=old - x["t_lp"], fkl=(unsure * fkl).detach(), gate=unsure, t_ent=x["t_ent"], s_ent=-old,
               disagree=((x["t_ent"] > a.alpha) != (h_topq > a.alpha)).float())
    stats = {"clip": clipped}
    for k, d in enumerate(a.domains):   # per-domain sums; main() divides by each domain's token count
        on = (x["dom"] == k).float()
        stats.update({f"{name}@{d}": v * on for name, v in per.items()})
    return loss, stats


def route_to_teachers(teachers: dict, episodes, **kw) -> list:
    """Each episode scored by the teacher of its own domain (teachers: {domain: model}; episode.env), never by
    another and never averaged: teacher_scores' dicts in `episodes` order (None: dropped). Every rank visits the
    teachers in the same order. KeyError for an episode whose domain has no teacher (callers check before)."""
    out = [None] * len(episodes)
    missing = {e.env for e in episodes} - set(teachers)
    if missing:
        raise KeyError(f"no teacher for {', '.join(sorted(missing))}")
    for d in sorted(teachers):
        idx = [i for i, e in enumerate(episodes) if e.env == d]
        for i, s in zip(idx, teacher_scores(teachers[d], [episodes[i] for i in idx], **kw)):
            out[i] = s
    return out


def fkl_coef_at(a, step: int) -> float:
    """beta_f: --fkl-start at step 1, rising linearly to --fkl-coef over --fkl-warmup steps, then flat."""
    if a.fkl_warmup <= 0:
        return a.fkl_coef
    return a.fkl_start + (a.fkl_coef - a.fkl_start) * min(1.0, (step - 1) / a.fkl_warmup)


# ----------------------------------------------------------------------------- command line

def get_args(argv=None):
    p, name, preset = common.preset_parser(PRESETS, __doc__, argv)
    p.add_argument("--domains", default=",".join(DOMAINS), help="domains, in the sequential run's curriculum order")
    p.add_argument("--student", default=None, help="starting checkpoint (default Seq-Final: the last stage of the curriculum the sequential run in "
                   "--runs recorded)")
    p.add_argument("--teachers", default="seq", help="seq (the stage that learned each domain, <runs>/seq/<i>-<d>), "
                                                     "oracle (<runs>/oracle/<d>) or domain=DIR,...")
    p.add_argument("--mix", default="balanced", help="prompts per step across domains: balanced or weights w1,w2,...")
    p.add_argument("--prompts", type=int, default=preset["prompts"], help="prompts per step (global)")
    p.add_argument("--group", type=int, default=preset["group"], help="student samples per prompt")
    p.add_argument("--steps", type=int, default=preset["steps"], help="optimizer steps")
    p.add_argument("--lr", type=float, default=preset["lr"], help="learning rate (AdamW, constant)")
    p.add_argument("--top-q", type=int, default=preset["top_q"], help="teacher tokens the forward KL runs over")
    p.add_argument("--alpha", type=float, default=preset["alpha"], help="entropy gate (nats): the forward KL acts "
                                                                        "where the teacher's entropy is above it")
    p.add_argument("--fkl-start", type=float, default=preset["fkl_start"], help="forward-KL coefficient at step 1")
    p.add_argument("--fkl-coef", type=float, default=preset["fkl_coef"], help="forward-KL coefficient after warm-up")
    p.add_argument("--fkl-warmup", type=int, default=preset["fkl_warmup"], help="steps of its linear warm-up")
    p.add_argument("--rkl-gate", action="store_true", help="reverse KL only where the teacher is sure (H_T <= alpha)")
    p.add_argument("--gate-entropy", default="full", choices=["full", "topq", "topq-raw"], help="the gate's entropy: "
                   "exact over the vocabulary, of the renormalised top-q, or the top-q's terms of the full sum, not "
                   "renormalised (the released code's; both lower bounds)")
    p.add_argument("--rkl-coef", type=float, default=1.0, help="the reverse KL's weight in the advantage (released: "
                   "opd_kl_coef 0.5)")
    p.add_argument("--clip-low", type=float, default=0.2, help="PPO clip below 1")
    p.add_argument("--clip-high", type=float, default=0.28, help="PPO clip above 1")
    p.add_argument("--tis-cap", type=float, default=2.0, help="cap of the sampler/trainer importance weight")
    p.add_argument("--offload-teachers", action="store_true", help="keep the teachers' FSDP2 shards on the CPU")
    p.add_argument("--save-every", type=int, default=preset["save_every"], help="steps between resume states (0: never)")
    p.add_argument("--out", default=None, help="student checkpoint (default <runs>/mmopd)")
    p.add_argument("--overwrite", action="store_true", help="replace an mmopd checkpoint made with another recipe")
    add_training_flags(p, name)
    return p.parse_args(argv)


def teacher_paths(a) -> dict:
    """{domain: teacher checkpoint} from --teachers; UsageError for a domain of --domains without one."""
    if a.teachers in ("seq", "oracle"):
        return {d: os.path.join(a.runs, "seq", f"{i}-{d}") if a.teachers == "seq" else os.path.join(a.runs, "oracle", d)
                for i, d in enumerate(a.domains, 1)}
    given = dict(x.partition("=")[::2] for x in a.teachers.split(","))
    parse_domains(",".join(given))
    missing = [d for d in a.domains if not given.get(d)]
    if missing:
        raise UsageError(f"no teacher for {', '.join(missing)} in --teachers {a.teachers} (every domain of --domains "
                         f"needs one: domain=DIR)")
    return {d: given[d] for d in a.domains}


def seq_final(runs: str, domains: list) -> str:
    """Seq-Final, the default student: the last stage of the curriculum that the sequential run in `runs` recorded
    (each stage's acl_meta.json), whatever --domains distils (the authors' three-teacher run distils math, search and
    e-commerce into the four-stage Seq-Final; the last of --domains would silently be Seq-Ecom); before any stage
    exists, <runs>/seq/<n>-<last> of --domains (the error then names it)."""
    for p in sorted(glob.glob(os.path.join(runs, "seq", "[0-9]*-*"))):
        meta = common.read_meta(p)
        if meta.get("method") == "seq" and meta.get("curriculum"):
            c = meta["curriculum"]
            return os.path.join(runs, "seq", f"{len(c)}-{c[-1]}")
    return os.path.join(runs, "seq", f"{len(domains)}-{domains[-1]}")


def check_args(a):
    """Every bad input stops here with a UsageError, before anything is loaded or written."""
    check_shared_flags(a)
    a.domains = list(parse_domains(a.domains))
    a.runs = a.runs or os.path.join("runs", a.preset)
    a.out = a.out or os.path.join(a.runs, "mmopd")
    a.student = a.student or seq_final(a.runs, a.domains)
    a.mix = parse_mix(a.mix, a.domains)
    for ok, msg in [(a.prompts >= 1, "--prompts must be >= 1"), (a.group >= 1, "--group must be >= 1"),
                    (a.steps >= 1, "--steps must be >= 1"), (a.lr > 0, "--lr must be > 0"),
                    (a.top_q >= 1, "--top-q must be >= 1"), (a.alpha >= 0, "--alpha must be >= 0 (an entropy, nats)"),
                    (a.fkl_start >= 0 and a.fkl_coef >= 0, "--fkl-start and --fkl-coef must be >= 0"),
                    (a.fkl_warmup >= 0, "--fkl-warmup must be >= 0"), (a.rkl_coef >= 0, "--rkl-coef must be >= 0"), (0 <= a.clip_low < 1, "--clip-low must be in [0, 1)"),
                    (a.clip_high >= 0, "--clip-high must be >= 0"), (a.tis_cap >= 1, "--tis-cap must be >= 1"),
                    (a.save_every >= 0, "--save-every must be >= 0")]:
        if not ok:
            raise UsageError(msg)
    if a.dry_run:   # Seq-Final has the base's architecture: --dry-run needs no trained run
        a.teacher_paths = {}
        a.arch = a.student if common.is_checkpoint(a.student) else PRESETS[a.preset]["base"]
        vocab = init_config(a.arch).vocab_size
        if a.top_q > vocab:
            raise UsageError(f"--top-q {a.top_q} is larger than the vocabulary ({vocab})")
        return a
    if a.preset != "tiny":
        require_real_data(a, a.domains)
    if not common.is_checkpoint(a.student):
        raise UsageError(f"--student checkpoint not found: {a.student} (the default is Seq-Final: python train_seq.py)")
    a.teacher_paths = teacher_paths(a)
    for d, path in a.teacher_paths.items():
        if not common.is_checkpoint(path):
            how = "python train_seq.py --oracle" if a.teachers == "oracle" else "python train_seq.py"
            raise UsageError(f"no teacher for {d}: {path} is not a checkpoint ({how}, or --teachers {d}=DIR)")
    vocab, tok = init_config(a.student).vocab_size, common.tokenizer_hash(a.student)
    if a.top_q > vocab:
        raise UsageError(f"--top-q {a.top_q} is larger than the vocabulary ({vocab})")
    checked = {a.student}   # each checkpoint once (the stage teachers include Seq-Final, the student itself)
    for d, path in a.teacher_paths.items():
        if path in checked:
            continue
        checked.add(path)
        if common.tokenizer_hash(path) != tok:
            raise UsageError(f"the {d} teacher {path} has another tokenizer than --student {a.student}: its "
                             f"distributions are over other tokens")
        t_vocab = init_config(path).vocab_size
        if t_vocab != vocab:
            raise UsageError(f"the {d} teacher {path} has a vocabulary of {t_vocab}, the student {vocab}")
    a.tokenizer = tok
    common.check_output(a.out, "mmopd", inputs=[a.student, *a.teacher_paths.values()], overwrite=True)
    if common.read_meta(a.out) and common.read_meta(a.out).get("recipe") != recipe(a) and not a.overwrite:
        raise UsageError(f"--out {a.out} holds an mmopd checkpoint made with another recipe; pass --overwrite to "
                         f"replace it")
    return a


def recipe(a) -> dict:
    """What the student checkpoint (and a resume state) depends on."""
    keys = ("domains", "mix", "prompts", "group", "steps", "lr", "top_q", "alpha", "fkl_start", "fkl_coef",
            "fkl_warmup", "rkl_gate", "rkl_coef", "gate_entropy", "clip_low", "clip_high", "tis_cap", "agg", "grad_clip",
            "temperature", "max_tokens", "max_turn_tokens", "seed")
    return dict({k: getattr(a, k) for k in keys}, student=os.path.abspath(a.student), student_id=common.identity(a.student),
                teachers={d: os.path.abspath(p) for d, p in a.teacher_paths.items()},
                teacher_ids={d: common.identity(p) for d, p in a.teacher_paths.items()})


# ----------------------------------------------------------------------------- main

def main(argv=None):
    a = get_args(argv)
    try:
        a = check_args(a)
        if a.dry_run:
            dry_run(a, a.arch, a.world_size, a.micro_batch, a.max_tokens, teachers=len(a.domains),
                    teacher_offload=a.offload_teachers)
            return
        envs = load_envs(a.domains, env_options(a), a.seed)
        rec = recipe(a)
        if common.read_meta(a.out).get("recipe") != rec:
            common.check_run_files(a.out, rec, replace=a.overwrite)
    except UsageError as e:
        common.usage_exit(e)
    if common.read_meta(a.out).get("recipe") == rec:
        common.print0(f"[mmopd] {a.out} finished before with this recipe, nothing to do")
        return
    device = common.start_run(a, f"mmopd: student {a.student}, teachers {a.teacher_paths} -> {a.out}", [a.out])
    t0, cost0 = time.time(), cost_now()
    common.seed_all(a.seed)
    policy, tok = common.load_policy(a.student, common.shard_device(device), a.attn, a.grad_ckpt)
    policy = common.shard(policy, bf16=a.bf16, cpu_offload=a.cpu_offload, compiled=a.compile)
    # the teachers: frozen, in eval mode, sharded like the student (bf16 weights with --bf16: 2 bytes per parameter
    # and rank share); one copy of a checkpoint that teaches several domains
    loaded, teachers = {}, {}
    for d, path in a.teacher_paths.items():
        if path not in loaded:
            m, _ = common.load_policy(path, common.shard_device(device), a.attn, dtype=torch.bfloat16 if a.bf16 else torch.float32)
            loaded[path] = common.shard(m.eval().requires_grad_(False), bf16=a.bf16, cpu_offload=a.offload_teachers,
                                        compiled=a.compile)
        teachers[d] = loaded[path]
    backend, _engine = make_backend(a.backend, tok, a.student, policy=policy, device=device, gen_batch=a.gen_batch,
                                    kv_cache_gb=a.kv_cache_gb, bf16=a.bf16, gpu_util=a.vllm_gpu_util,
                                    max_tokens=a.max_tokens, seed=a.seed, attn=a.attn)
    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr, betas=(0.9, 0.999), weight_decay=0.0)
    train = {d: envs[d].tasks("train", seed=a.seed) for d in a.domains}
    cursors = {d: Cursor(len(train[d]), a.seed + 3 + k) for k, d in enumerate(a.domains)}
    quota = mix_quota(a.mix, {d: 1 for d in a.domains}, a.prompts)
    resume_path = common.run_files(a.out)[0]
    extra = common.resume_state(resume_path, policy, opt, "[mmopd]")
    start, history = (extra["step"], extra["history"]) if extra else (0, [])
    if extra:
        for d, pos in extra["cursors"].items():
            cursors[d].pos = pos
        push_weights(backend, policy)
    metrics = common.Metrics(a.out, start, wandb=a.wandb, config=vars(a))
    common.print0(f"[mmopd] {a.steps} steps of {a.prompts} prompts x {a.group} samples, per step {quota}")
    step_kw = dict(micro_batch=a.micro_batch, micro_tokens=a.micro_tokens, agg=a.agg, grad_clip=a.grad_clip,
                   temperature=a.temperature)
    t1 = time.time()
    step = start
    try:
        for step in range(start + 1, a.steps + 1):
            ts = time.time()
            beta_f = fkl_coef_at(a, step)
            # ---- 1. the student samples (the environments run; their reward is only logged)
            tasks = [(d, train[d][j]) for d in a.domains for j in cursors[d].take(quota[d])]
            mine = tasks[common.rank()::common.world_size()]
            policy.eval()
            eps = rollout(backend, tok, [(envs[d], t) for d, t in mine], a.group, a.temperature,
                          max_tokens=a.max_tokens, max_turn_tokens=a.max_turn_tokens,
                          seed=(a.seed * 1_000_003 + step) * 97 + common.rank())
            check_user_errors(eps, a.max_user_errors, f"[mmopd] step {step}")   # never distil from a dead user's 0s
            t_gen = time.time() - ts
            n_gen = common.all_reduce_sum(float(sum(e.n_sampled for e in eps)))
            backend.sleep()
            # ---- 2. each episode to its own domain's teacher; a failed score drops the episode
            scores = route_to_teachers(teachers, eps, micro_batch=a.micro_batch, micro_tokens=a.micro_tokens, q=a.top_q,
                                       temperature=a.temperature)
            kept = [(e, s) for e, s in zip(eps, scores) if s is not None]
            dropped = {d: int(common.all_reduce_sum(sum(1 for e, s in zip(eps, scores) if s is None and e.env == d)))
                       for d in a.domains}
            if common.all_reduce_sum(len(kept)) == 0:
                raise TeacherFailure(f"every episode of step {step} was dropped (teachers' scores not finite: "
                                     f"{dropped}); stopping rather than training on nothing")
            # ---- 3. one update on the kept episodes
            policy.train()
            x = dict(t_lp=[s["lp"] for _, s in kept], t_ent=[s["ent"] for _, s in kept],
                     t_top_lp=[s["top_lp"] for _, s in kept], t_top_ids=[s["top_ids"] for _, s in kept],
                     dom=[a.domains.index(e.env) for e, _ in kept])
            loss, st = train_on(policy, opt, [e for e, _ in kept], lambda lp, b, x, w=beta_f: mmopd_loss(lp, b, x, a, w),
                                extras=x, gather="t_top_ids", **step_kw)
            wake_and_push(backend, lambda: push_weights(backend, policy))
            # ---- the log: per domain, token means over its agent tokens
            n_all = common.all_reduce_sum(float(sum(e.n_sampled for e, _ in kept)))
            row = dict(step=step, loss=loss, beta_f=beta_f, grad_norm=st["grad_norm"], dropped=dropped, domains={})
            for d in a.domains:
                n_d = common.all_reduce_sum(float(sum(e.n_sampled for e, _ in kept if e.env == d)))
                if n_d == 0:
                    continue
                r = {k: st[f"{k}@{d}"] * n_all / n_d for k in STATS}
                r["fkl_gated"] = r["fkl"] / r["gate"] if r["gate"] > 0 else 0.0
                r["reward"] = common.gather_mean([e.reward for e in eps if e.env == d])
                r["dropped"] = dropped[d]
                row["domains"][d] = r
            history.append(row)
            dt = time.time() - ts
            metrics.log(dict(row, gen_seconds=round(t_gen, 2), step_seconds=round(dt, 2),
                             gen_tok_s=round(n_gen / max(t_gen, 1e-9), 1)))
            common.print0(f"[mmopd] step {step}/{a.steps} | loss {loss:+.4f} | beta_f {beta_f:.3f} | gen {t_gen:.1f}s "
                          f"{n_gen / max(t_gen, 1e-9):.0f} tok/s | step {dt:.1f}s {common.all_reduce_sum(float(sum(len(e.token_ids) for e, _ in kept))) / dt:.0f} tok/s | "
                          f"{common.eta(t1, step - start, a.steps - step)}")
            for d in (d for d in a.domains if d not in row["domains"]):
                common.print0(f"    {d:<9} no episode scored | dropped {dropped[d]}")
            for d, r in row["domains"].items():
                common.print0(f"    {d:<9} rkl {r['rkl']:+.4f} | fkl@gate {r['fkl_gated']:.4f} | gate {r['gate']:.3f} "
                              f"(gates disagree {r['disagree']:.3f}) | H teacher {r['t_ent']:.3f} student {r['s_ent']:.3f} | "
                              f"reward {r['reward']:.3f} | dropped {r['dropped']}")
            if a.save_every and step % a.save_every == 0 and step < a.steps:
                common.save_train_state(resume_path, policy, opt, dict(step=step, history=history,
                                                                       cursors={d: c.pos for d, c in cursors.items()}),
                                        recipe=rec)
        metrics.finish()
    except FloatingPointError as e:
        common.stop_diverged(a.out, f"[mmopd] step {step}: {e}; nothing non-finite was saved", e)
    except (TeacherFailure, ServiceError) as e:
        sys.exit(f"error: [mmopd] {e}")
    meta = dict(method="mmopd", stage="mmopd", parent=os.path.abspath(a.student), curriculum_position=None,
                step=a.steps, seed=a.seed, recipe=rec, teachers=rec["teachers"], tokenizer=a.tokenizer,
                history=history, config={k: v for k, v in vars(a).items()}, seconds=round(time.time() - t0, 1),
                cost=cost_since(cost0))
    common.save_final(a.out, policy, tok, meta, SAVE_DTYPES[a.save_dtype], t0)
    common.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
