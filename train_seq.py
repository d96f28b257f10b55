"""Sequential multi-stage RL: the agent learns the domains one after another (math -> search ->
ecommerce -> if by default), each stage starting from the previous stage's checkpoint, and every
stage is followed by an evaluation on every domain, so forgetting and transfer can be read off.
A one-stage curriculum from the base is a single-task oracle (--oracle).

Each stage:
  1. a cold start (a domain with --rft-prompts > 0: every domain in the tiny preset, whose base has read each
     domain's knowledge but never the agent protocol; search and ecommerce in the 8B preset, as the authors), SFT on
     --rft-prompts train prompts' rollouts with full reward and well-formed tool calls (deduplicated; loss on the
     agent's tokens only): the expert's
     (--cold-start expert, the authors' recipe: the tiny worlds' scripted expert, or teacher rollouts in
     --expert-data at full scale) or the policy's own, --rft-samples per prompt (--cold-start self, RFT)
     -> runs/<preset>/seq/<i>-<domain>-rft/;
  2. GRPO for --steps steps: --prompts prompts x --group samples, group-normalised advantages, a
     clipped surrogate with separate low/high clip (DAPO) on a per-token ratio (or GSPO's per-sequence one,
     --loss gspo), token-mean or sequence-mean aggregation, --lr and a k3 KL to the policy as GRPO starts it
     (after the cold start; --kl-coef) per domain, dynamic sampling (groups with equal rewards are
     dropped and more prompts drawn), a truncated importance weight between the sampler's and the
     trainer's log-probs, environment tokens masked out -> runs/<preset>/seq/<i>-<domain>/;
  3. evaluate every domain on --eval-n tasks (evaluate.py) -> runs/<preset>/eval/inrun/seq-<i>-<domain>.json.

    python train_seq.py                                  # tiny: runs/tiny/seq/1-math ... 4-if (CPU)
    python train_seq.py --oracle                         # tiny oracles: runs/tiny/oracle/<domain>
    python train_seq.py --curriculum if,math --runs runs/tiny-if-first     # any order or subset
    python train_seq.py --curriculum math,search,if,ecommerce --runs runs/tiny-order-msie --reuse runs/tiny
        # another order: the stages it shares with runs/tiny's (math, search) copied, not retrained
    torchrun --standalone --nproc_per_node=2 train_seq.py --runs runs/tiny-dist   # FSDP2, 2 CPU ranks (gloo)
    torchrun --nnodes=N --node-rank=R --rdzv-endpoint=HOST:29500 --nproc_per_node=8 \\
        train_seq.py --preset qwen3-8b                   # full scale (see README)

A killed run restarted with the same command skips finished stages and resumes the current one from
its last saved step (--save-every); changing the recipe under an existing run directory is refused.

Differences from the paper:
1. Rollouts use the `hf` backend (a transformers decode loop) unless --backend vllm (a vLLM engine colocated in
   every rank). Either way the loop is: generate -> sleep -> train -> wake -> push weights, parameter by
   parameter; under torchrun the hf backend keeps one unsharded copy of the policy per rank to push into.
2. The tiny preset's step counts, batch sizes and learning rate are chosen to fit a 2-core CPU; the
   qwen3-8b preset's follow the authors' recipe (group 16 for math and 8 elsewhere, math responses to 16k tokens,
   lr 1e-6, GSPO for search and e-commerce, two optimizer steps per rollout batch) but for the agentic cold start,
   self-RFT by default: theirs for e-commerce is SFT on teacher rollouts (--cold-start search=self,ecommerce=expert
   --expert-data DIR, the README's full-scale command), and the tau data (theirs: tau-bench v1 retail's 500 tasks,
   --tau-data).
3. The optimizer is reset at every stage (each stage is its own RL run, as in the paper's pipeline).
"""
import argparse
import math
import os
import sys
import time

import torch

from acl import common
from acl.engine import make_backend, push_weights, wake_and_push
from acl.scale import dry_run
from acl.step import (
    SAVE_DTYPES,
    Cursor,
    add_training_flags,
    check_shared_flags,
    check_user_errors,
    clipped_surrogate,
    cost_now,
    cost_since,
    episode_logprobs,
    sft_epochs,
    train_on,
)
from envs import env_options, load_envs, per_domain, require_real_data
from envs.base import UsageError, well_formed
from envs.rollout import ServiceError, expert_episodes, saved_episodes
from evaluate import evaluate_inrun, inrun_path

# ----------------------------------------------------------------------------- the loss

def grpo_loss(logp, b, x, a):
    """The GRPO/DAPO per-token loss, (B, T), which train_on masks to the sampled tokens and aggregates; with
    --loss gspo the importance ratio is GSPO's sequence-level one (Zheng et al. 2025; exact with --agg seq).
    logp: the current policy's log-probs; b["slp"]: the sampler's; x["adv"] (B, 1): the group-normalised
    advantage; x["old"]: the trainer's log-probs under the weights that sampled (absent on the first update on a
    batch: logp itself, detached); x["ref"]: the reference model's (absent without --kl-coef).
    -> (loss, {"clip": 1 where the PPO ratio is outside the clip range, "entropy": -log p of the sampled token (its
    mean over tokens estimates the policy's entropy), "kl": the k3 KL term where there is a reference})."""
    old = x["old"] if "old" in x else logp.detach()
    log_ratio = logp - old                                               # GRPO: one PPO ratio per token
    if a.loss == "gspo":   # GSPO: one ratio per sequence, exp of its mean token log-ratio (on every token of it,
        m = b["mask"]      # value s_i and gradient s_i * d log p_t: GSPO-token), so the clip acts per sequence
        seq = ((logp - old) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)     # (B, 1)
        log_ratio = seq.detach() + logp - logp.detach()
    loss, clipped = clipped_surrogate(log_ratio, x["adv"], old, b["slp"], a.clip_low, a.clip_high, a.tis_cap)
    stats = {"clip": clipped, "entropy": -logp.detach()}
    if "ref" in x and a.kl_coef > 0:
        d = (x["ref"] - logp) * b["mask"]                                # 0 past the episode's end (zero-padded ref)
        kl = torch.exp(d) - d - 1                                        # k3 estimator of KL(pi || ref)
        loss = loss + a.kl_coef * kl
        stats["kl"] = kl.detach()
    return loss, stats


# The method's defaults per preset; the scale ones (engine, batch sizes, token limits) are acl.step.SCALE's.
# Every one is a flag. The tiny preset's numbers fit the whole sequential run plus the four oracles into 15
# minutes on 2 CPU cores; per-domain steps because an ecommerce episode costs ~5x a math one; two generation
# rounds at most (dynamic sampling) because a flat step costs a round each; lr 2e-4 because at 5e-4 the math and
# search stages wiped the base's ecommerce skill before its stage.
PRESETS = {
    "tiny": dict(init="runs/tiny/base", steps="math=40,search=10,ecommerce=6,if=16",
                 prompts="math=16,search=16,ecommerce=4,if=16", group=8, lr="2e-4", kl_coef="0", loss="grpo",
                 minibatches=1, cold_start="expert", rft_prompts="math=1024,search=2048,ecommerce=1024,if=1024",
                 rft_samples=4, rft_epochs=3, rft_lr=1e-3, eval_n=30, max_gen_rounds=2, math_data=None),
    "qwen3-8b": dict(init="Qwen/Qwen3-8B-Base", steps="math=200,search=200,ecommerce=200,if=200", prompts=128,
                     group="math=16,search=8,ecommerce=8,if=8", lr="1e-6",
                     # the authors' math responses run to 16k tokens; the agentic and IF turns to 2k as before
                     max_tokens="math=17408,search=8192,ecommerce=8192,if=8192",
                     max_turn_tokens="math=16384,search=2048,ecommerce=2048,if=2048", kl_coef="math=0.01,search=0,ecommerce=0.1,if=0",
                     loss="math=grpo,search=gspo,ecommerce=gspo,if=grpo", minibatches=2, cold_start="self",
                     rft_prompts="math=0,search=2048,ecommerce=2048,if=0", rft_samples=8, rft_epochs=2, rft_lr=1e-5, eval_n=None, max_gen_rounds=3,
                     math_data="BytedTsinghua-SIA/DAPO-Math-17k"),
}
def group_advantages(episodes, drop_flat: bool = True, eps: float = 1e-6):
    """GRPO: each episode's reward minus its group's mean, over the group's std. Groups are the samples of
    one task (same task_id). Groups whose rewards are all equal carry no signal: with drop_flat (dynamic
    sampling) they are left out, otherwise they get advantage 0. -> ({episode index: advantage}, flat ids)."""
    groups = {}
    for i, e in enumerate(episodes):
        groups.setdefault(e.task_id, []).append(i)
    adv, flat = {}, set()
    for tid, idx in groups.items():
        r = torch.tensor([episodes[i].reward for i in idx], dtype=torch.float)
        if r.max() - r.min() < eps:
            flat.add(tid)
            if not drop_flat:
                adv.update({i: 0.0 for i in idx})
            continue
        a = (r - r.mean()) / (r.std() + eps)
        for i, v in zip(idx, a.tolist()):
            adv[i] = v
    return adv, flat


# ----------------------------------------------------------------------------- the stage loop

def stage_dir(a, i: int, domain: str) -> str:
    return os.path.join(a.runs, "oracle", domain) if a.oracle else os.path.join(a.runs, "seq", f"{i}-{domain}")


def grpo_recipe(a, domain: str, parent: str) -> dict:
    """The settings a GRPO stage of `domain` from checkpoint `parent` must match to be reused (mle.py's experts too):
    the loop's settings, the stage's own per-domain values, and the parent's and the data's identity (one replaced
    in place is another parent: common.identity)."""
    keys = ("minibatches", "clip_low", "clip_high", "agg", "tis_cap", "grad_clip", "dynamic_sampling",
            "max_gen_rounds", "temperature", "seed")
    return dict({k: getattr(a, k) for k in keys}, group=a.group_by_domain[domain], max_tokens=a.max_tokens_by_domain[
                    domain], max_turn_tokens=a.max_turn_tokens_by_domain[domain], steps=a.steps_by_domain[domain],
                prompts=a.prompts_by_domain[domain],
                lr=a.lr_by_domain[domain], kl_coef=a.kl_by_domain[domain],
                loss=per_domain("--loss", a.loss, [domain], str)[domain], parent_id=common.identity(parent),
                data={k: common.identity(v) for k, v in getattr(a, "env_opts", {}).get(domain, {}).items()
                      if k in ("data", "corpus")})


def recipe(a, domain: str) -> dict:
    """What a finished stage (and a resume state) must match on a rerun: its GRPO recipe, its cold start, and the
    stage's lineage: the starting checkpoint and the stages trained before it (an oracle has none)."""
    init = os.path.abspath(a.init) if os.path.isdir(a.init) else a.init
    before = [] if a.oracle else a.curriculum[: a.curriculum.index(domain)]
    parent = stage_dir(a, len(before), before[-1]) if before else a.init
    cold = a.rft_prompts_by_domain.get(domain, 0) > 0
    expert = cold and a.cold_start_by_domain[domain] == "expert"   # a self-RFT stage does not read --expert-data
    return dict(grpo_recipe(a, domain, parent), rft_samples=a.rft_samples, rft_epochs=a.rft_epochs, rft_lr=a.rft_lr,
                rft_prompts=a.rft_prompts_by_domain[domain] if cold else 0,
                cold_start=a.cold_start_by_domain[domain] if cold else None,
                expert_data=os.path.abspath(a.expert_data) if expert and a.expert_data else None, init=init,
                trained_after=before, expert_data_id=common.identity(a.expert_data) if expert and a.expert_data else None)


def stage_args(a, domain: str):
    """A copy of the run's arguments with this stage's own learning rate, KL coefficient, loss, group size and token
    limits as plain values."""
    return argparse.Namespace(**dict(vars(a), lr=per_domain("--lr", a.lr, [domain], float)[domain],
                                     kl_coef=per_domain("--kl-coef", a.kl_coef, [domain], float)[domain],
                                     loss=per_domain("--loss", a.loss, [domain], str)[domain],
                                     group=a.group_by_domain[domain], max_tokens=a.max_tokens_by_domain[domain],
                                     max_turn_tokens=a.max_turn_tokens_by_domain[domain],
                                     cold_start=getattr(a, "cold_start_by_domain", {}).get(domain)))   # (mle.py: none)


def check_stage(a, i: int, domain: str):
    """UsageError, before any work, unless what lies in stage i's place belongs to this run (common.check_run_files):
    the stage, its RFT checkpoint and its resume state made with this recipe and lineage, and no divergence."""
    out = stage_dir(a, i, domain)
    common.check_run_files(out, recipe(a, domain), also=[out + "-rft"])


def rollouts(backend, tok, env, tasks, n, a, seed, adapter=None):
    from envs.rollout import rollout
    eps = rollout(backend, tok, [(env, t) for t in tasks], n, a.temperature, max_tokens=a.max_tokens,
                  max_turn_tokens=a.max_turn_tokens, seed=seed, adapters=[adapter] * len(tasks) if adapter else None)
    check_user_errors(eps, a.max_user_errors, f"{env.domain} rollouts")   # a failing user: stop, never train on 0s
    return eps


def keep_successes(episodes) -> list:
    """The success filter: full reward, every tool call well-formed, and distinct (same task, same sampled
    tokens: one copy)."""
    seen, kept = set(), []
    for e in episodes:
        key = (e.task_id, tuple(t for t, m in zip(e.token_ids, e.loss_mask) if m))
        if e.reward >= 1.0 and well_formed(e.messages) and key not in seen:
            seen.add(key)
            kept.append(e)
    return kept


def cold_start(policy, tok, backend, env, domain, tasks, a, stage_name, out=None):
    """A stage's cold start, SFT on rollouts that keep_successes keeps (full reward, well-formed tool
    calls, distinct): --cold-start self samples them from the policy (rejection-sampled fine-tuning, RFT);
    --cold-start expert takes a stronger model's, as the study's authors did (Qwen3-30B-A3B rollouts): in the tiny
    worlds the scripted expert's episodes of the same prompts (envs.rollout.expert_episodes), at full scale the
    teacher rollouts in --expert-data (evaluate.py --save-episodes writes them). out: the checkpoint the cold start
    makes (<stage>-rft), whose metrics.jsonl gets a row per SFT step."""
    from envs.rollout import expert_records
    t0 = time.time()
    mine = tasks[common.rank()::common.world_size()]
    policy.eval()
    if a.cold_start == "self":
        eps, what = rollouts(backend, tok, env, mine, a.rft_samples, a, seed=a.seed * 7919 + common.rank()), \
            f"{len(tasks)} prompts x {a.rft_samples} samples"
    elif a.expert_data:
        eps = saved_episodes(tok, expert_records(a.expert_data, domain)[common.rank()::common.world_size()], a.max_tokens,
                             a.max_turn_tokens)
        what = f"{int(common.all_reduce_sum(len(eps)))} teacher rollouts from {a.expert_data}"
    else:
        eps = expert_episodes(tok, env, mine, a.max_tokens, a.max_turn_tokens)
        what = f"{len(tasks)} prompts x 1 expert episode"
    kept = keep_successes(eps)
    n_kept = int(common.all_reduce_sum(len(kept)))
    common.print0(f"[{stage_name}] cold start ({a.cold_start}): {what}, mean reward {common.gather_mean([e.reward for e in eps]):.3f}"
                  f", kept {n_kept} distinct full-reward well-formed rollouts ({time.time() - t0:.0f}s)")
    if n_kept == 0:
        common.print0(f"[{stage_name}] cold start: nothing to learn from; GRPO starts from the current policy")
        return 0
    backend.sleep()
    opt = torch.optim.AdamW(policy.parameters(), lr=a.rft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    policy.train()
    metrics = common.Metrics(out, 0, wandb=a.wandb, config=vars(a)) if out else None
    try:
        sft_epochs(policy, opt, kept, epochs=a.rft_epochs, batch=max(1, a.micro_batch // 2), micro_batch=a.micro_batch,
                   micro_tokens=a.micro_tokens, grad_clip=a.grad_clip, agg=a.agg, seed=a.seed, label=f"[{stage_name}] rft",
                   metrics=metrics)
    except FloatingPointError as e:
        raise FloatingPointError(f"[{stage_name}] cold start: {e}") from None
    if metrics:
        metrics.finish()
    wake_and_push(backend, lambda: push_weights(backend, policy))
    return n_kept


def grpo(policy, tok, backend, env, domain, a, stage_name, steps, resume_path, ref_model=None, push=push_weights,
         adapter=None, out=None, rec=None):
    """The GRPO loop of one stage (grpo_steps), with the step at which a non-finite loss, gradient or weight
    appeared named in the error."""
    try:
        grpo_steps(policy, tok, backend, env, domain, a, stage_name, steps, resume_path, ref_model, push, adapter, out,
                   rec)
    except FloatingPointError as e:
        raise FloatingPointError(f"[{stage_name}] GRPO step {grpo_steps.step}: {e}") from None


def grpo_steps(policy, tok, backend, env, domain, a, stage_name, steps, resume_path, ref_model, push, adapter, out=None,
               rec=None):
    """The GRPO loop of one stage, resumable from `resume_path`. The seams mle.py composes it through:
    push(backend, policy) puts the updated weights into the engine, `adapter` (a LoRA adapter directory, or None:
    the engine's model as it is) is what the rollouts sample with, and `rec` the recipe a resume state records
    (default: this script's recipe(a, domain)). out: the checkpoint the stage makes (its metrics go beside it)."""
    opt = torch.optim.AdamW([q for q in policy.parameters() if q.requires_grad], lr=a.lr, betas=(0.9, 0.999),
                            weight_decay=0.0)
    train = env.tasks("train", seed=a.seed)
    cursor, start = Cursor(len(train), a.seed), 0
    extra = common.resume_state(resume_path, policy, opt, f"[{stage_name}]")
    if extra:
        cursor.pos, start = extra["cursor"], extra["step"]
        push(backend, policy)
    prompts = a.prompts_by_domain[domain]
    per_rank = max(1, prompts // common.world_size())
    step_kw = dict(micro_batch=a.micro_batch, micro_tokens=a.micro_tokens, agg=a.agg, grad_clip=a.grad_clip,
                   temperature=a.temperature)
    metrics = common.Metrics(out, start, wandb=a.wandb, config=vars(a)) if out else None
    t0 = time.time()
    for step in range(start + 1, steps + 1):
        grpo_steps.step = step
        t_step = time.time()
        # ---- generate: draw prompts until enough groups carry signal (dynamic sampling), or give up
        policy.eval()
        kept, n_drawn, rewards, n_tok, lengths, truncs = [], 0, [], 0, [], []
        for r in range(a.max_gen_rounds):
            batch = cursor.take(prompts)
            mine = [train[j] for j in batch[common.rank()::common.world_size()]]
            eps = rollouts(backend, tok, env, mine, a.group, a, seed=(a.seed * 1_000_003 + step) * 97 + r * 7 + common.rank(),
                           adapter=adapter)
            n_drawn += len(mine)
            rewards += [e.reward for e in eps]
            lengths += [e.n_sampled for e in eps]
            truncs += [float(e.truncated) for e in eps]
            n_tok += sum(e.n_sampled for e in eps)
            adv, _ = group_advantages(eps, drop_flat=a.dynamic_sampling)
            kept += [(e, adv[i]) for i, e in enumerate(eps) if i in adv]
            if common.all_reduce_sum(len(kept) // a.group) >= prompts or not a.dynamic_sampling:
                break
        t_gen = time.time() - t_step
        reward = common.gather_mean(rewards)
        n_resp, n_trunc = common.gather_mean(lengths), common.gather_mean(truncs)   # per sampled episode, over every rank
        kept = kept[: per_rank * a.group]
        n_kept = int(common.all_reduce_sum(len(kept)))
        # ---- sleep: the generation engine frees its memory for training (vLLM on GPU; a no-op for hf)
        backend.sleep()
        # ---- train: one update on the kept groups
        policy.train()
        loss, clip_frac, st = 0.0, 0.0, {}
        if n_kept:
            eps, advs = [e for e, _ in kept], [v for _, v in kept]
            # one update per batch by default; with --minibatches k, k updates on k slices of it, the later
            # ones off-policy: the PPO ratio against the pre-update log-probs is what the clip bounds
            old = episode_logprobs(policy, eps, micro_batch=a.micro_batch, micro_tokens=a.micro_tokens,
                                   temperature=a.temperature) if a.minibatches > 1 else None
            per = math.ceil(len(eps) / a.group / a.minibatches) * a.group
            for k in range(a.minibatches):
                sl = slice(k * per, (k + 1) * per)
                x = dict(adv=advs[sl])
                if old:
                    x["old"] = old[sl]
                if ref_model is not None:
                    x["ref"] = episode_logprobs(ref_model, eps[sl], micro_batch=a.micro_batch,
                                                micro_tokens=a.micro_tokens, temperature=a.temperature)
                lo, st = train_on(policy, opt, eps[sl], lambda lp, b, x: grpo_loss(lp, b, x, a), extras=x, **step_kw)
                loss, clip_frac = loss + lo / a.minibatches, clip_frac + st.get("clip", 0.0) / a.minibatches
        # ---- wake, then push the new weights into the engine, a few tensors at a time
        wake_and_push(backend, (lambda: push(backend, policy)) if n_kept else None)
        dt = time.time() - t_step
        tok_s = common.all_reduce_sum(n_tok) / max(t_gen, 1e-9)
        common.print0(f"[{stage_name}] step {step}/{steps} | reward {reward:.3f} | kept {n_kept // a.group} groups | "
                      f"loss {loss:+.4f} | clip {clip_frac:.3f} | gen {t_gen:.1f}s {tok_s:.0f} tok/s | step {dt:.1f}s | "
                      f"{common.eta(t0, step - start, steps - step)}")
        if metrics:   # what a first-day run is watched by: reward, response length and truncation, the update's
            # gradient norm (before the clip), the policy's entropy and its KL to the reference (the last minibatch's)
            metrics.log(dict(stage=stage_name, step=step, reward=reward, kept_groups=n_kept // a.group, loss=loss,
                             clip=clip_frac, grad_norm=st.get("grad_norm"), weight_change=st.get("weight_change"),
                             entropy=st.get("entropy"), kl=st.get("kl"),
                             response_tokens=n_resp, truncated=n_trunc, gen_seconds=round(t_gen, 2),
                             gen_tok_s=round(tok_s, 1), step_seconds=round(dt, 2)))
        if a.save_every and step % a.save_every == 0 and step < steps:
            common.save_train_state(resume_path, policy, opt, dict(step=step, cursor=cursor.pos),
                                    recipe=rec or recipe(a, domain))
    if metrics:
        metrics.finish()


def stage_backend(a, tok, path, policy, device):
    """acl.engine.make_backend with this run's scale flags: (backend, engine model) for `policy` loaded from path."""
    return make_backend(a.backend, tok, path, policy=policy, device=device, gen_batch=a.gen_batch,
                        kv_cache_gb=a.kv_cache_gb, bf16=a.bf16, gpu_util=a.vllm_gpu_util, seed=a.seed, attn=a.attn,
                        max_tokens=max(a.max_tokens_by_domain.values()))   # one engine for every stage: the largest


def run_stage(i, domain, parent, a, device, env):
    """Cold start (where --rft-prompts > 0) + GRPO + save + evaluate; returns the stage's checkpoint directory."""
    a = stage_args(a, domain)
    out = stage_dir(a, i, domain)
    name = os.path.relpath(out, a.runs)
    t0 = time.time()
    rft_dir = out + "-rft"
    cost0 = cost_now()   # the stage's cost (cold start + GRPO) for the report's cost table
    use_rft = a.rft_prompts_by_domain.get(domain, 0) > 0
    rft_done = use_rft and common.read_meta(rft_dir).get("recipe") == recipe(a, domain)
    start = rft_dir if rft_done else parent    # decided before loading: one policy, one backend
    policy, tok = common.load_policy(start, common.shard_device(device), a.attn, a.grad_ckpt)
    common.seed_all(a.seed + i)
    policy = common.shard(policy, bf16=a.bf16, cpu_offload=a.cpu_offload, compiled=a.compile)
    backend, engine = stage_backend(a, tok, start, policy, device)
    n_rft, t_rft = None, 0.0
    if rft_done:
        common.print0(f"[{name}] rft: done before, loaded {rft_dir}")
        n_rft = common.read_meta(rft_dir).get("rft_kept")
    elif use_rft:
        t1 = time.time()
        tasks = env.tasks("train", seed=a.seed)
        tasks = [tasks[j] for j in Cursor(len(tasks), a.seed + 1).take(a.rft_prompts_by_domain[domain])]
        n_rft = cold_start(policy, tok, backend, env, domain, tasks, a, name, out=rft_dir)
        t_rft = time.time() - t1
        save(policy, tok, rft_dir, a, domain, i, parent, dict(rft_kept=n_rft, phase="rft", seconds=round(t_rft, 1)))
    ref_model = None
    if a.kl_coef > 0:   # the KL's reference: the policy as GRPO starts it, after the cold start (the authors' τ run:
        # --ref-load is the SFT checkpoint), so the penalty keeps RL near what the cold start taught; frozen
        ref_model, _ = common.load_policy(rft_dir if use_rft else parent, common.shard_device(device), a.attn)
        ref_model = common.shard(ref_model.eval().requires_grad_(False), bf16=a.bf16, cpu_offload=a.cpu_offload,
                                 compiled=a.compile)
    steps = a.steps_by_domain[domain]
    resume_path = common.run_files(out)[0]
    grpo(policy, tok, backend, env, domain, a, name, steps, resume_path, ref_model, out=out)
    seconds = time.time() - t0
    save(policy, tok, out, a, domain, i, parent, dict(rft_kept=n_rft, rft_seconds=round(t_rft, 1),
                                                      seconds=round(seconds, 1), cost=cost_since(cost0)))
    common.drop_train_state(out)
    if a.eval_n:
        evaluate_stage(engine if engine is not None else policy, tok, out, a, seconds,
                       backend=backend if a.backend == "vllm" else None)
    del policy, engine, backend, ref_model
    return out


def save(policy, tok, out, a, domain, i, parent, extra):
    """Every rank: the stage's checkpoint (common.save_policy: written by rank 0, a barrier after it)."""
    meta = dict(method="oracle" if a.oracle else "seq", stage=domain, parent=os.path.abspath(parent),
                curriculum=a.curriculum, curriculum_position=i, step=a.steps_by_domain[domain], seed=a.seed,
                recipe=recipe(a, domain), config=vars(a) | dict(env_opts=a.env_opts), **extra)
    common.save_policy(out, policy, tok, meta, dtype=SAVE_DTYPES[a.save_dtype])
    common.print0(f"saved {out}")


def evaluate_stage(model, tok, out, a, seconds, backend=None):
    """evaluate.evaluate_inrun on --eval-n tasks per split: runs/<preset>/eval/inrun/<name>.json (rank 0)."""
    if common.rank() == 0:
        evaluate_inrun(model, tok, out, a.runs, suite="tiny" if a.preset == "tiny" else "full", n=a.eval_n,
                       batch=a.gen_batch, backend=backend, max_tokens=a.max_tokens, max_turn_tokens=a.max_turn_tokens,
                       env_opts=a.env_opts, seconds=seconds)


# ----------------------------------------------------------------------------- command line

def add_grpo_flags(p, preset: dict):
    """The GRPO loop's flags (grpo_steps), with `preset`'s defaults; mle.py trains its experts with them too."""
    p.add_argument("--steps", default=preset["steps"], help="GRPO steps per stage: N, or domain=N,...")
    p.add_argument("--prompts", default=preset["prompts"], help="prompts per GRPO step (global): N, or domain=N,...")
    p.add_argument("--group", default=preset["group"], help="GRPO group size G (samples per prompt): N, or "
                   "domain=N,... (the authors: 16 for math, 8 otherwise)")
    p.add_argument("--lr", default=preset["lr"], help="GRPO learning rate (AdamW, constant): X, or domain=X,...")
    p.add_argument("--loss", default=preset["loss"], help="importance ratio per token (grpo: GRPO/DAPO) or per "
                   "sequence (gspo: GSPO, the authors' choice for search, ecommerce and LoRA runs): NAME or domain=NAME,...")
    p.add_argument("--clip-low", type=float, default=0.2, help="PPO clip below 1 (ratio >= 1 - clip_low)")
    p.add_argument("--clip-high", type=float, default=0.28, help="PPO clip above 1 (DAPO clip-higher)")
    p.add_argument("--minibatches", type=int, default=preset.get("minibatches", 1), help="optimizer steps per "
                   "rollout batch (PPO-style minibatches; >1 makes the clip active; the authors: 2)")
    p.add_argument("--kl-coef", default=preset["kl_coef"], help="k3 KL penalty to the stage's start (0 = off): X, or "
                   "domain=X,... (the authors: math 0.01, ecommerce 0.1)")
    p.add_argument("--tis-cap", type=float, default=2.0, help="cap of the sampler/trainer importance weight")
    p.add_argument("--no-dynamic-sampling", dest="dynamic_sampling", action="store_false",
                   help="keep groups whose rewards are all equal (they get zero advantage)")
    p.add_argument("--max-gen-rounds", type=int, default=preset["max_gen_rounds"],
                   help="dynamic sampling: most prompt batches per step")
    p.add_argument("--save-every", type=int, default=10, help="GRPO steps between resume states (0 = never)")


def check_grpo_flags(a, domains: list):
    """UsageError (one line) for a bad GRPO flag; resolves the per-domain ones for `domains`."""
    a.steps_by_domain = per_domain("--steps", a.steps, domains)
    a.prompts_by_domain = per_domain("--prompts", a.prompts, domains)
    a.lr_by_domain = per_domain("--lr", a.lr, domains, float)
    a.kl_by_domain = per_domain("--kl-coef", a.kl_coef, domains, float)
    a.loss_by_domain = per_domain("--loss", a.loss, domains, str)
    a.group_by_domain = per_domain("--group", a.group, domains)
    bad = sorted(set(a.loss_by_domain.values()) - {"grpo", "gspo"})
    if bad:
        raise UsageError(f"--loss: {bad[0]!r} is neither grpo nor gspo")
    ws = a.world_size if a.dry_run else common.world_size()
    for ok, msg in [(min(a.group_by_domain.values()) >= 2, "--group must be >= 2 (GRPO compares samples of one prompt)"),
                    (min(a.prompts_by_domain.values()) >= 1, "--prompts must be >= 1"),
                    (min(a.lr_by_domain.values()) > 0, "--lr must be > 0"),
                    (min(a.steps_by_domain.values()) >= 0, "--steps must be >= 0"),
                    (0 <= a.clip_low < 1, "--clip-low must be in [0, 1)"), (a.clip_high >= 0, "--clip-high must be >= 0"),
                    (min(a.kl_by_domain.values()) >= 0, "--kl-coef must be >= 0"), (a.tis_cap >= 1, "--tis-cap must be >= 1"),
                    (a.max_gen_rounds >= 1, "--max-gen-rounds >= 1"), (a.minibatches >= 1, "--minibatches must be >= 1"),
                    (a.save_every >= 0, "--save-every >= 0"),
                    (all(v % ws == 0 for v in a.prompts_by_domain.values()), f"--prompts must be divisible by the world size {ws}")]:
        if not ok:
            raise UsageError(msg)


def get_args(argv=None):
    p, name, preset = common.preset_parser(PRESETS, __doc__, argv)
    p.add_argument("--init", default=preset["init"], help="starting checkpoint (HF directory or hub id)")
    p.add_argument("--curriculum", default="math,search,ecommerce,if", help="domains in training order")
    p.add_argument("--check-install", action="store_true", help="print the versions, the GPU, whether vllm and "
                   "flash-attn import and whether this vllm is supported; exit 1 on a problem (nothing else runs)")
    p.add_argument("--oracle", action="store_true", help="train each curriculum domain alone from --init "
                                                          "-> runs/<preset>/oracle/<domain>")
    p.add_argument("--reuse", default=None, metavar="RUNS", help="another sequential run's directory: a stage it "
                   "finished with this stage's recipe and lineage (the same init, budgets, seed and the same stages "
                   "before it: a shared prefix of two orders) is copied from there instead of retrained")
    add_grpo_flags(p, preset)
    p.add_argument("--cold-start", default=preset["cold_start"], metavar="expert|self",
                   help="the stages' cold start: SFT on an expert's rollouts (tiny: the worlds' scripted expert; "
                        "full scale: --expert-data) or on the policy's own filtered samples (RFT); one for every "
                        "stage, or per domain with a cold start: search=self,ecommerce=expert")
    p.add_argument("--expert-data", default=None, metavar="DIR", help="--cold-start expert at full scale: teacher "
                   "rollouts, *.jsonl of episode records (evaluate.py --save-episodes on the train split)")
    p.add_argument("--rft-prompts", default=preset["rft_prompts"],
                   help="each stage's cold start: train prompts (0 = none): N or domain=N,...")
    p.add_argument("--rft-samples", type=int, default=preset["rft_samples"], help="--cold-start self: samples per prompt")
    p.add_argument("--rft-epochs", type=int, default=preset["rft_epochs"], help="cold-start SFT epochs")
    p.add_argument("--rft-lr", type=float, default=preset["rft_lr"], help="cold-start SFT learning rate")
    p.add_argument("--eval-n", type=int, default=preset["eval_n"], help="tasks per split in the after-stage "
                                                                        "evaluation (0 = skip)")
    add_training_flags(p, name)
    p.set_defaults(**{k: preset[k] for k in ("max_tokens", "max_turn_tokens") if k in preset})   # per stage (8B)
    p.set_defaults(math_data=preset["math_data"])
    return p.parse_args(argv)


def check_args(a):
    """Every bad input stops here with a UsageError, before anything is loaded or written. Returns a with
    resolved fields."""
    from envs import parse_domains
    a.curriculum = list(parse_domains(a.curriculum))
    a.rft_prompts_by_domain = per_domain("--rft-prompts", a.rft_prompts, a.curriculum)
    check_shared_flags(a, a.curriculum)
    check_grpo_flags(a, a.curriculum)
    if not (min(a.rft_prompts_by_domain.values(), default=0) >= 0 and a.rft_samples >= 1 and a.rft_epochs >= 1
            and a.rft_lr > 0 and (a.eval_n is None or a.eval_n >= 0)):
        raise UsageError("need --rft-prompts >= 0, --rft-samples >= 1, --rft-epochs >= 1, --rft-lr > 0, --eval-n >= 0")
    local = os.path.isdir(a.init) or a.init.startswith((".", os.path.sep, "runs")) or a.init.count("/") != 1
    if local and not common.is_checkpoint(a.init):
        raise UsageError(f"--init checkpoint not found: {a.init} (the tiny arena: cp -r assets/tiny-base runs/tiny/base, "
                         f"or rebuild it with python pretrain.py)")
    a.runs = a.runs or os.path.join("runs", a.preset)
    if a.reuse is not None:
        if a.oracle:
            raise UsageError("--reuse is for a curriculum (the shared prefix of two orders), not --oracle")
        if not os.path.isdir(os.path.join(a.reuse, "seq")):
            raise UsageError(f"--reuse {a.reuse}: not a sequential run's directory (no seq/ in it)")
        if os.path.abspath(a.reuse) == os.path.abspath(a.runs):
            raise UsageError("--reuse names --runs itself: a finished stage there is skipped anyway")
    if a.preset != "tiny" and not a.dry_run:
        require_real_data(a, a.curriculum)
    a.env_opts = env_options(a)
    from envs.rollout import expert_records
    by = per_domain("--cold-start", a.cold_start, [d for d in a.curriculum if a.rft_prompts_by_domain[d] > 0], str)
    a.cold_start_by_domain = {d: by.get(d) if a.rft_prompts_by_domain[d] > 0 else None for d in a.curriculum}
    if not {v.partition("=")[2] or v for v in str(a.cold_start).split(",")} <= {"expert", "self"}:
        raise UsageError(f"--cold-start takes expert or self, or domain=expert|self,...; got {a.cold_start!r}")
    cold = [d for d in a.curriculum if a.cold_start_by_domain[d] == "expert"]
    if a.expert_data and not cold:
        raise UsageError("--expert-data is for --cold-start expert (on a domain with --rft-prompts > 0)")
    for d in cold if a.expert_data or a.preset != "tiny" else []:
        if not a.expert_data:
            raise UsageError(f"--cold-start expert at full scale needs --expert-data DIR (teacher rollouts of {d})")
        if not any(r.get("reward", 0) >= 1 for r in expert_records(a.expert_data, d)):
            raise UsageError(f"--expert-data {a.expert_data} holds no full-reward {d} episode")
    return a


def reused_stage(a, i: int, domain: str) -> str | None:
    """--reuse: the other run's stage i if it was finished with this stage's recipe, else None. The recipe holds the
    parent's identity (a hash of its acl_meta.json), so a stage matches only after the same stages before it, each
    itself reused (a copy keeps its acl_meta.json) or trained alike."""
    if not a.reuse:
        return None
    twin = os.path.join(a.reuse, "seq", f"{i}-{domain}")
    return twin if common.read_meta(twin).get("recipe") == recipe(a, domain) else None


def evaluate_finished(out, a, device):
    """The in-run evaluation of a finished stage whose record is missing (a run killed while it evaluated)."""
    policy, tok = common.load_policy(out, device, a.attn)
    backend, engine = stage_backend(a, tok, out, policy, device)
    evaluate_stage(engine if engine is not None else policy, tok, out, a, common.read_meta(out).get("seconds", 0.0),
                   backend=backend if a.backend == "vllm" else None)


def main(argv=None):
    if "--check-install" in (sys.argv[1:] if argv is None else argv):   # before any flag is checked
        from acl.scale import check_install
        sys.exit(1 if check_install() else 0)
    a = get_args(argv)
    try:
        a = check_args(a)
        if a.dry_run:
            dry_run(a, a.init, a.world_size, a.micro_batch, a.max_tokens, ref_model=max(a.kl_by_domain.values()) > 0)
            return
        common.check_writable(a.runs, "--runs")
        for i, d in enumerate(a.curriculum, 1):   # what lies in a stage's place must be this run's
            check_stage(a, i, d)
        envs = load_envs(a.curriculum, a.env_opts, a.seed)   # every stage's data, before stage 1 trains
    except UsageError as e:
        common.usage_exit(e)
    outs = [stage_dir(a, i, d) for i, d in enumerate(a.curriculum, 1)]
    inruns = [inrun_path(os.path.join(a.runs, "eval"), os.path.relpath(o, a.runs).replace(os.sep, "-")) for o in outs]
    device = common.start_run(a, f"train_seq: {'oracles' if a.oracle else 'curriculum'} {' -> '.join(a.curriculum)} "
                                 f"from {a.init}", outs + [o + "-rft" for o in outs], files=inruns)
    parent, t0, out = a.init, time.time(), None
    try:
        for i, domain in enumerate(a.curriculum, 1):
            out = stage_dir(a, i, domain)
            name = os.path.relpath(out, a.runs)
            done = common.read_meta(out).get("recipe") == recipe(a, domain)
            twin = None if done else reused_stage(a, i, domain)
            if twin:
                common.copy_checkpoint(twin, out)   # its identity kept: the next stage can match too
                common.print0(f"[{name}] the same stage is finished in {twin} (this recipe, after the same stages): "
                              f"copied, not retrained")
            elif done:
                common.print0(f"[{name}] finished before, skipping")
            if done or twin:
                if a.eval_n and not os.path.isfile(inrun_path(os.path.join(a.runs, "eval"), name.replace(os.sep, "-"))):
                    common.print0(f"[{name}] its in-run evaluation is missing: evaluating it now")
                    evaluate_finished(out, a, device)
            else:
                run_stage(i, domain, a.init if a.oracle else parent, a, device, envs[domain])
            parent = out
    except FloatingPointError as e:   # a restart refuses to continue from here (check_stage)
        common.stop_diverged(out, f"{e}; nothing non-finite was saved; the last good checkpoint is {parent}", e)
    except ServiceError as e:   # the stage's resume state (if any) is kept: a restart continues from there
        sys.exit(f"error: {e}; stopped before training on it; the last finished checkpoint is {parent}")
    except OSError as e:
        sys.exit(f"error: a write failed: {e}")
    common.print0(f"done in {time.time() - t0:.0f}s")
    common.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
