"""Mixture of Low-Rank Experts (MLE), the study's proposed recipe: every domain's behaviour is first learned into one
shared backbone by offline replay (SDFT, sdft.py), the backbone is frozen, and each domain is then refined with RL
inside its own LoRA adapter, so that a later domain can never overwrite the weights an earlier one depends on. A
router picks the expert per request: the task's environment tag (--router tag, as in the study) or a classifier on
the backbone's hidden states of the prompt (--router learned).

    python mle.py                                        # tiny: runs/tiny/sdft (frozen) -> runs/tiny/mle/experts/<domain>
    python mle.py --router learned                       # + the learned router -> runs/tiny/mle/router.pt
    python mle.py --export merged                        # + one merged full checkpoint per domain -> runs/tiny/mle-merged/
    python evaluate.py --ckpt runs/tiny/mle              # tag routing (runs/tiny/eval/mle.json)
    python evaluate.py --ckpt runs/tiny/mle --router learned       # learned routing (eval/mle-learned.json)
    torchrun --standalone --nproc_per_node=2 mle.py --runs runs/tiny-dist     # FSDP2, 2 CPU ranks (gloo)
    torchrun --nproc_per_node=8 mle.py --preset qwen3-8b --backend vllm --math-data ... --user-url ...
    python mle.py --continual                            # MLE as a continual learner -> runs/tiny/mle-continual/

Each expert (domains in --domains order; a finished one is skipped, a killed one resumes from its last saved step):
  1. the backbone (--backbone, default runs/<preset>/sdft; any checkpoint, the released code used an early SDFT one),
     frozen, wrapped with a fresh peft LoRA adapter (--lora-rank 16, --lora-alpha 32, --lora-dropout 0 on
     --lora-targets q,k,v,o,gate,up,down: the released code's defaults); only the adapter trains;
  2. train_seq.py's GRPO loop on the domain's train split (composed, not copied: grpo() with three seams: the
     weight push carries the adapter only, the rollouts sample with the live adapter, the resume state records
     MLE's recipe), with --lr for the adapter and a k3 KL to the adapter-disabled backbone (--kl-coef, released
     0.01), which costs no second model: the same weights with the adapter switched off;
  3. the adapter saved as a standard peft directory runs/<preset>/mle/experts/<domain>/ (PeftModel.from_pretrained,
     vLLM's LoRARequest), with acl_meta.json: the recipe, trainable parameters, bytes on disk, seconds.

--continual (issue 42; the study composes MLE once, at the end): the domains arrive one at a time. When domain k
arrives, (a) the backbone is refreshed by SDFT (sdft.py's train_student) on the SDFT pools of domains 1..k, the
replay, starting from the previous backbone (k = 1: --student) -> <out>/backbone/<k>-<domain>; (b) expert k is trained
as above on that backbone -> <out>/<k>-<domain>/, an MLE directory with the earlier experts kept as they were (each fit
to an older backbone); (c) the ablation, k >= 2: each earlier expert re-fitted by --refit-steps of GRPO on the new
backbone from its previous fit -> <out>/<k>-<domain>-refit/. Evaluating <k-1>-..., <k>-... and <k>-...-refit on an
earlier domain (evaluate.py --domains) measures what a refresh does to an old expert (adapter drift) and what a brief
re-fit buys back. After k = 1 it is one-shot MLE on one domain with the backbone SDFT on that domain's pool.

Differences from the paper and the released code:
1. The backbone keeps fp32 master weights like every other script here (FSDP2's bf16 MixedPrecisionPolicy casts for
   compute); frozen, it has no gradients or optimizer state.
2. The tiny preset's steps and prompts are train_seq.py's; its LoRA learning rate is 10x the full fine-tuning one
   (2e-3 vs 2e-4), fixed before any run.
"""
import argparse
import functools
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

from acl import common
from acl.engine import HFBackend, make_backend
from acl.routing import FORMAT, ROUTER_FILES, Router, experts_of, prompt_features
from acl.scale import dry_run
from acl.step import SAVE_DTYPES, add_training_flags, check_shared_flags, cost_now, cost_since
from envs import DOMAINS, env_options, load_envs, parse_domains, per_domain, require_real_data
from envs.base import UsageError
from envs.rollout import ServiceError
from train_seq import add_grpo_flags, check_grpo_flags, grpo, grpo_recipe, stage_args

PRESETS = {   # arch: the backbone's architecture for --dry-run before the SDFT backbone exists
    # student, refit_steps: --continual's first backbone's start and the ablation's re-fit (a quarter of the steps)
    "tiny": dict(arch="runs/tiny/base", steps="math=40,search=10,ecommerce=6,if=16",
                 prompts="math=16,search=16,ecommerce=4,if=16", group=8, lr="2e-3", kl_coef="0.01", loss="grpo",
                 max_gen_rounds=2, student=None, refit_steps="math=10,search=3,ecommerce=2,if=4"),   # <runs>/base
    "qwen3-8b": dict(arch="Qwen/Qwen3-8B-Base", steps="math=200,search=200,ecommerce=200,if=200", prompts=128, group=8,
                     lr="1e-5", kl_coef="0.01", loss="gspo", max_gen_rounds=3, student="Qwen/Qwen3-8B-Base",
                     refit_steps=50),
}
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}


# ----------------------------------------------------------------------------- the expert: backbone + one adapter

def lora_config(a):
    from peft import LoraConfig
    return LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout, bias="none",
                      target_modules=[TARGETS[t] for t in a.lora_targets], task_type="CAUSAL_LM")


def with_adapter(model, a, init: str | None = None):
    """The frozen backbone `model` wrapped with a fresh LoRA adapter (peft's init: A random, B zero, so the expert
    starts exactly at the backbone), or with the adapter saved in `init` (--continual's re-fit: an expert fit to an
    older backbone, trained on from there); only the adapter's weights require gradients."""
    from peft import PeftModel, get_peft_model
    model.requires_grad_(False)
    if init:
        return PeftModel.from_pretrained(model, init, is_trainable=True)
    return get_peft_model(model, lora_config(a))


class AdapterOff(torch.nn.Module):
    """The KL's reference: the expert's own model with its adapter switched off, i.e. the frozen backbone, without a
    second copy of it. It runs through acl.step's scoring code like any model."""

    def __init__(self, model):
        super().__init__()
        self.inner = [model]             # a list, so that the policy's weights are not registered twice
        self.config = model.config

    def get_base_model(self):
        return self.inner[0].get_base_model()

    def get_output_embeddings(self):   # the backbone's head (the adapter never touches it): the fused head serves it
        return self.inner[0].get_output_embeddings()

    @property
    def is_gradient_checkpointing(self):
        return common.uses_activation_checkpointing(self.get_base_model())

    def parameters(self, recurse: bool = True):
        return self.inner[0].parameters(recurse)

    def forward(self, **kw):
        with self.inner[0].disable_adapter():
            return self.inner[0](**kw)


def save_adapter(model, out: str, meta: dict):
    """The adapter as a standard peft directory (adapter_config.json, adapter_model.safetensors) plus acl_meta.json,
    written atomically; the adapter's weights only, never the backbone. Every rank calls it (each weight is
    all-gathered under FSDP2); rank 0 writes, and every rank waits until it has."""
    sd = dict(common.full_params(model, trainable_only=True))
    if common.rank() == 0:
        def write(tmp):
            model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
            common.write_meta(tmp, dict(meta, adapter_bytes=os.path.getsize(os.path.join(tmp, "adapter_model.safetensors"))))
        common.write_atomically(out, write)
    common.barrier()   # the other ranks read it next (the router's features, the export): not before it exists


def expert_backend(a, tok, policy, device, live: str):
    """(backend, push, adapter): what the expert's rollouts sample with, how an update reaches it, and the adapter
    argument the rollouts pass. hf, one process: the policy itself, with its live adapter. hf under FSDP2: an
    unsharded copy of the backbone with the same adapter on each rank; a push copies the adapter's tensors into it.
    vllm: the engine (LoRA on) samples with the adapter directory `live`/rank<r>, rewritten by every push and
    served under a new LoRA id, so the engine never reuses the old weights."""
    from acl.engine import push_weights
    if a.backend == "vllm":
        backend, _ = make_backend("vllm", tok, a.backbone, gen_batch=a.gen_batch, bf16=a.bf16, gpu_util=a.vllm_gpu_util,
                                  max_tokens=max(a.max_tokens_by_domain.values()), seed=a.seed,
                                  max_lora_rank=a.lora_rank)
        mine = os.path.join(live, f"rank{common.rank()}")                 # each rank its own engine's copy
        push = functools.partial(push_lora_dir, path=mine)
        push(backend, policy)
        return backend, push, mine
    if not common.sharded():
        return HFBackend(policy, tok, a.gen_batch), push_weights, None
    engine, _ = common.load_policy(a.backbone, device, a.attn, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    engine = with_adapter(engine, a).eval()

    def push(backend, policy):
        backend.load_weights(common.full_params(policy, trainable_only=True))   # the adapter only
    backend = HFBackend(engine, tok, a.gen_batch)
    push(backend, policy)
    return backend, push, None


def push_lora_dir(backend, policy, path: str):
    """The vLLM weight push of an expert: its adapter written to the directory `path` (the adapter only: a few MiB
    at 8B), then served under a new LoRA id (VLLMBackend.refresh_lora), so the next rollouts sample the update."""
    policy.save_pretrained(path, state_dict=dict(common.full_params(policy, trainable_only=True)), safe_serialization=True)
    backend.refresh_lora(path)


def recipe(a, domain: str, init: str | None = None) -> dict:
    """What a finished expert (and its resume state) must match: train_seq's GRPO recipe for the domain from the
    backbone, and the adapter's shape (and, re-fitted, the adapter it started from, by identity)."""
    return dict(grpo_recipe(a, domain, a.backbone), init=os.path.abspath(a.backbone), method="mle",
                lora=dict(rank=a.lora_rank, alpha=a.lora_alpha, dropout=a.lora_dropout, targets=a.lora_targets)) | \
        (dict(init_adapter_id=common.identity(init)) if init else {})


def train_expert(a, i: int, domain: str, env, device, init: str | None = None) -> dict:
    """Steps 1-3 of the module docstring for one domain (init: the adapter to start from, --continual's re-fit);
    -> the expert's acl_meta."""
    a = stage_args(a, domain)
    out = os.path.join(a.out, "experts", domain)
    name = f"mle/{domain}" if not a.continual else os.path.relpath(out, os.path.dirname(os.path.dirname(a.out)))
    t0, cost0 = time.time(), cost_now()
    common.seed_all(a.seed + i)                                        # the adapter's initialisation too
    backbone, tok = common.load_policy(a.backbone, common.shard_device(device), a.attn, a.grad_ckpt)
    policy = with_adapter(backbone, a, init)
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in policy.parameters())
    common.print0(f"[{name}] LoRA rank {a.lora_rank} alpha {a.lora_alpha} on {','.join(a.lora_targets)}: {n_train:,} trainable "
                  f"of {n_all:,} parameters ({100 * n_train / n_all:.2f}%)")
    policy = common.shard(policy, bf16=a.bf16, cpu_offload=a.cpu_offload, compiled=a.compile)
    backend, push, adapter = expert_backend(a, tok, policy, device, out + ".live")
    ref = AdapterOff(policy) if a.kl_coef > 0 else None
    resume_path = common.run_files(out)[0]
    rec = recipe(a, domain, init)
    grpo(policy, tok, backend, env, domain, a, name, a.steps_by_domain[domain], resume_path, ref, push=push,
         adapter=adapter, out=out, rec=rec)
    meta = dict(method="mle-expert", stage=domain, parent=os.path.abspath(a.backbone), step=a.steps_by_domain[domain],
                seed=a.seed, recipe=rec, trainable_params=n_train, total_params=n_all,
                config={k: v for k, v in vars(a).items() if k != "env_opts"} | dict(env_opts=a.env_opts),
                seconds=round(time.time() - t0, 1), cost=cost_since(cost0))
    save_adapter(policy, out, meta)
    if common.rank() == 0:
        common.drop_train_state(out)
        shutil.rmtree(out + ".live", ignore_errors=True)        # the vLLM push's adapter copies, made by this run
        common.print0(f"[{name}] saved {out} ({common.read_meta(out)['adapter_bytes'] / 2**20:.2f} MiB) in {time.time() - t0:.0f}s")
    return common.read_meta(out) if common.rank() == 0 else meta


# ----------------------------------------------------------------------------- routing


def train_router(a, envs, device, kind: str = "learned") -> dict:
    """--router learned: fit the router on --router-prompts train prompts per domain (full-batch AdamW, cross-entropy,
    --router-steps steps), report its accuracy on every domain's test and ood prompts, save <out>/router.pt; kind
    "request": the same on the user's request alone (routing.request_messages) -> <out>/router-request.pt."""
    t0, request = time.time(), kind == "request"
    model, tok = common.load_policy(a.backbone, device, a.attn)
    model.eval()
    xs, ys = [], []
    for j, d in enumerate(a.domains):
        tasks = envs[d].tasks("train", seed=a.seed)[: a.router_prompts]
        xs.append(prompt_features(model, tok, [(envs[d], t) for t in tasks], request=request))
        ys += [j] * len(tasks)
    x, y = torch.cat(xs), torch.tensor(ys)
    torch.manual_seed(a.seed)
    router = Router(x.size(1), a.domains)
    router.mean.copy_(x.mean(0))
    router.std.copy_(x.std(0).clamp(min=1e-6))
    opt = torch.optim.AdamW(router.parameters(), lr=1e-2, weight_decay=1e-2)
    for _ in range(a.router_steps):
        loss = torch.nn.functional.cross_entropy(router(x), y)      # the router's loss: -log p(domain | prompt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = {"train": (router(x).argmax(-1) == y).float().mean().item()}
    for split in ("test", "ood"):
        hits, n = 0, 0
        for j, d in enumerate(a.domains):
            tasks = envs[d].tasks(split, seed=a.seed)[: a.router_prompts]
            if tasks:
                pred = router(prompt_features(model, tok, [(envs[d], t) for t in tasks], request=request)).argmax(-1)
                hits, n = hits + int((pred == j).sum()), n + len(tasks)
                acc[f"{split}/{d}"] = (pred == j).float().mean().item()
        acc[split] = hits / max(n, 1)
    save = dict(state=router.state_dict(), domains=a.domains, dim=x.size(1), accuracy=acc, prompts=a.router_prompts,
                steps=a.router_steps, seed=a.seed, backbone_id=common.identity(a.backbone), final_loss=loss.item(),
                seconds=round(time.time() - t0, 1))
    common.write_file_atomically(os.path.join(a.out, ROUTER_FILES[kind]), lambda tmp: torch.save(save, tmp))
    common.print0(f"[mle] {kind} router: train accuracy {acc['train']:.3f}, test {acc['test']:.3f}, ood {acc['ood']:.3f} "
                  f"({a.router_prompts} prompts per domain and split, {time.time() - t0:.0f}s) -> {a.out}/{ROUTER_FILES[kind]}")
    return acc


def update_meta(path, extra: dict):
    """<path>/acl_meta.json with `extra` merged in, written only when that changes it."""
    meta = common.read_meta(path)
    if meta | extra != meta:
        common.save_json(os.path.join(path, "acl_meta.json"), meta | extra)


def export_merged(a):
    """--export merged: backbone + each expert merged into one full checkpoint (peft's merge_and_unload), for
    stacks without LoRA -> <export-out>/<domain>/. An export made from the same backbone and expert (by identity)
    in the same --save-dtype is kept as it is."""
    from peft import PeftModel
    for d, e in experts_of(a.out).items():
        dest = os.path.join(a.export_out, d)
        made_from = dict(stage=d, parent_id=common.identity(a.backbone), expert_id=common.identity(e), save_dtype=a.save_dtype)
        if {k: common.read_meta(dest).get(k) for k in made_from} == made_from:
            common.print0(f"[mle] {dest} kept (made from this backbone and expert, {a.save_dtype})")
            continue
        model, tok = common.load_policy(a.backbone, torch.device("cpu"), a.attn)
        merged = PeftModel.from_pretrained(model, e).merge_and_unload()
        common.save_checkpoint(dest, merged, tok, dict(made_from, method="mle-merged", parent=os.path.abspath(a.backbone),
                                                       expert=os.path.abspath(e), recipe=common.read_meta(e).get("recipe")),
                               dtype=SAVE_DTYPES[a.save_dtype])
        common.print0(f"[mle] merged {e} into {a.backbone} -> {dest}")


# ----------------------------------------------------------------------------- MLE as a continual learner


def mle_dir_meta(out: str, backbone: str, domains: list):
    """The top acl_meta.json of an MLE directory (what evaluate.py and acl/routing.py serve): its backbone, by path
    and identity, and its experts; rank 0 writes it (only when it changes), every rank waits."""
    if common.rank() == 0:
        os.makedirs(out, exist_ok=True)
        update_meta(out, dict(method="mle", format=FORMAT, backbone=os.path.abspath(backbone),
                              backbone_id=common.identity(backbone), domains=domains, router="tag",
                              experts={d: os.path.join("experts", d) for d in domains}))
    common.barrier()


def continual(a, envs, device):
    """--continual (the module docstring's (a)-(c)), each piece skipped when finished with its recipe, so a killed
    run restarted with the same command goes on where it stopped. -> the MLE directories made, kept and re-fitted."""
    import sdft

    def expert(ak, i, dom, init=None):   # one expert into ak.out, unless finished there with this recipe
        out, rec = os.path.join(ak.out, "experts", dom), recipe(stage_args(ak, dom), dom, init)
        if common.read_meta(out).get("recipe") == rec:
            common.print0(f"[mle-continual] {out} finished before, skipping")
            return
        try:
            common.check_run_files(out, rec)   # a resume state of another recipe, a divergence: refused
        except UsageError as e:
            common.usage_exit(e)
        try:
            train_expert(ak, i, dom, envs[dom], device, init=init)
        except FloatingPointError as e:
            common.stop_diverged(out, f"{e}; nothing non-finite was saved; the pieces before it are kept", e)

    prev, made = a.student, []
    for k, d in enumerate(a.domains, 1):
        seen = a.domains[:k]
        # (a) the backbone refresh: SDFT on the pools seen so far (a balanced batch: a multiple of their number)
        bb = os.path.join(a.out, "backbone", f"{k}-{d}")
        flags = ["--preset", a.preset, "--runs", a.runs, "--pool", a.pool, "--domains", ",".join(seen), "--student",
                 prev, "--out", bb, "--epochs", str(a.refresh_epochs), "--seed", str(a.seed),
                 "--batch", str(a.refresh_batch - a.refresh_batch % k), "--micro-batch", str(a.micro_batch),
                 "--save-dtype", a.save_dtype, "--attn", a.attn, "--bf16" if a.bf16 else "--no-bf16",
                 "--grad-ckpt" if a.grad_ckpt else "--no-grad-ckpt", "--compile" if a.compile else "--no-compile"] + \
            (["--threads", str(a.threads)] if a.threads else [])
        try:
            s = sdft.check_args(sdft.get_args(flags))
        except UsageError as e:
            common.usage_exit(e)
        common.print0(f"[mle-continual] {k}/{len(a.domains)}: {d} arrives; the backbone refreshed by SDFT on "
                      f"{', '.join(seen)} from {prev} -> {bb}")
        sdft.train_student(s, sdft.read_pool(s.pool_dir, seen), device, time.time())
        # (b) expert k on the new backbone, the earlier ones kept as they were
        kept = os.path.join(a.out, f"{k}-{d}")
        ak = argparse.Namespace(**dict(vars(a), backbone=bb, out=kept))
        mle_dir_meta(kept, bb, seen)
        expert(ak, k, d)
        new = os.path.join(kept, "experts", d)
        before = os.path.join(a.out, f"{k - 1}-{a.domains[k - 2]}") if k > 1 else None
        for j in seen[:-1]:
            carry(os.path.join(before, "experts", j), os.path.join(kept, "experts", j))
        made.append(kept)
        if k == 1:
            prev = bb
            continue
        # (c) the ablation: the earlier experts re-fitted briefly on the new backbone, each from its previous fit
        refit = kept + "-refit"
        last = before + "-refit" if k > 2 else before
        mle_dir_meta(refit, bb, seen)
        for j in seen[:-1]:
            ar = argparse.Namespace(**dict(vars(a), backbone=bb, out=refit,
                                           steps_by_domain=dict(a.steps_by_domain, **{j: a.refit_steps_by_domain[j]})))
            expert(ar, 100 * k + seen.index(j) + 1, j, init=os.path.join(last, "experts", j))
        carry(new, os.path.join(refit, "experts", d))
        made.append(refit)
        prev = bb
    return made


def carry(src: str, dest: str):
    """An expert carried unchanged into a later MLE directory (a copy of the adapter, a few KiB to MiB): kept when
    the same one (by identity) is there already."""
    if common.identity(dest) != common.identity(src):
        common.copy_checkpoint(src, dest)


# ----------------------------------------------------------------------------- command line

def get_args(argv=None):
    p, name, preset = common.preset_parser(PRESETS, __doc__, argv)
    p.add_argument("--backbone", default=None, help="frozen backbone checkpoint (default <runs>/sdft)")
    p.add_argument("--domains", default=",".join(DOMAINS), help="the experts, trained in this order")
    p.add_argument("--out", default=None, help="MLE directory (default <runs>/mle)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r")
    p.add_argument("--lora-alpha", type=float, default=32, help="LoRA alpha (the update is scaled by alpha / r)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument("--lora-targets", default=",".join(TARGETS), help=f"projections with an adapter, of {','.join(TARGETS)}")
    add_grpo_flags(p, preset)
    p.add_argument("--router", default="tag", choices=["tag", "learned"], help="tag: the task's environment tag picks "
                   "the expert (no training); learned: also fit two classifiers on the backbone's prompt features, one "
                   "reading the prompt as the policy sees it (router.pt), one the user's request alone "
                   "(router-request.pt: no system prompt, tools or tag)")
    p.add_argument("--router-prompts", type=int, default=256, help="learned router: prompts per domain and split")
    p.add_argument("--router-steps", type=int, default=300, help="learned router: full-batch AdamW steps")
    p.add_argument("--export", default=None, choices=["merged"], help="also write one merged full checkpoint per "
                                                                      "domain (backbone + expert)")
    p.add_argument("--export-out", default=None, help="--export's directory (default <out>-merged)")
    p.add_argument("--continual", action="store_true", help="MLE as a continual learner (the docstring): a backbone "
                   "refresh by SDFT on the pools seen so far and one new expert per arriving domain -> "
                   "<runs>/mle-continual (default --out)")
    p.add_argument("--pool", default=None, metavar="DIR", help="--continual: the SDFT pools replayed (default "
                   "<runs>/sdft-pool, sdft.py's)")
    p.add_argument("--student", default=preset["student"], help="--continual: the first backbone's starting checkpoint "
                   "(tiny: <runs>/base)")
    p.add_argument("--refit-steps", default=preset["refit_steps"], help="--continual's ablation: GRPO steps that "
                   "re-fit an earlier expert on a refreshed backbone: N or domain=N,...")
    p.add_argument("--refresh-epochs", type=float, default=2.0, help="--continual: SDFT epochs of each backbone refresh "
                   "over the pools seen so far (sdft.py's preset: 2)")
    p.add_argument("--refresh-batch", type=int, default=32, help="--continual: SDFT episodes per step (rounded down "
                   "to a multiple of the domains seen, for the balanced mix)")
    add_training_flags(p, name)
    return p.parse_args(argv)


def check_args(a):
    """Every bad input stops here with a UsageError, before anything is loaded or written."""
    a.domains = list(parse_domains(a.domains))
    check_shared_flags(a, a.domains)
    check_grpo_flags(a, a.domains)
    a.lora_targets = [t.strip() for t in a.lora_targets.split(",") if t.strip()]
    bad = [t for t in a.lora_targets if t not in TARGETS]
    for ok, msg in [(a.lora_rank >= 1, "--lora-rank must be >= 1"), (a.lora_alpha > 0, "--lora-alpha must be > 0"),
                    (0 <= a.lora_dropout < 1, "--lora-dropout must be in [0, 1)"),
                    (a.router_prompts >= 1 and a.router_steps >= 1, "need --router-prompts >= 1, --router-steps >= 1"),
                    (a.lora_targets and not bad, f"--lora-targets: unknown {', '.join(bad)} (of {', '.join(TARGETS)})")]:
        if not ok:
            raise UsageError(msg)
    a.runs = a.runs or os.path.join("runs", a.preset)
    if a.continual:
        return check_continual(a)
    a.backbone = a.backbone or os.path.join(a.runs, "sdft")
    a.out = a.out or os.path.join(a.runs, "mle")
    a.export_out = a.export_out or a.out.rstrip(os.sep) + "-merged"
    if a.dry_run:
        return a
    if not common.is_checkpoint(a.backbone):
        raise UsageError(f"--backbone checkpoint not found: {a.backbone} (the SDFT student: python sdft.py)")
    if a.preset != "tiny":
        require_real_data(a, a.domains)
    a.env_opts = env_options(a)
    common.check_output(a.out, "mle", inputs=[a.backbone], overwrite=True)
    meta = common.read_meta(a.out)
    if meta and (meta.get("backbone"), meta.get("backbone_id", common.identity(a.backbone))) != \
            (os.path.abspath(a.backbone), common.identity(a.backbone)):
        raise UsageError(f"--out {a.out} holds experts on another backbone ({meta.get('backbone')}, or the same path "
                         f"since replaced); use another --out")
    for d in a.domains:
        common.check_run_files(os.path.join(a.out, "experts", d), recipe(stage_args(a, d), d))
    for d in a.domains if a.export else []:
        common.check_output(os.path.join(a.export_out, d), "mle-merged", inputs=[a.backbone, a.out], overwrite=True,
                            flag="--export-out")
    return a


def check_continual(a):
    """--continual's own checks, before any work: the pools of every domain, the student, the re-fit steps; what the
    continual form does not do (a given backbone, the learned router, exports) is refused."""
    for flag, bad in (("--backbone", a.backbone), ("--router learned", a.router == "learned"), ("--export", a.export),
                      ("--dry-run", a.dry_run)):
        if bad:
            raise UsageError(f"--continual makes its own backbones with tag routing: {flag} is for one-shot MLE")
    a.refit_steps_by_domain = per_domain("--refit-steps", a.refit_steps, a.domains)
    if min(a.refit_steps_by_domain.values()) < 1 or a.refresh_epochs <= 0 or a.refresh_batch < len(a.domains):
        raise UsageError(f"--continual needs --refit-steps >= 1, --refresh-epochs > 0, --refresh-batch >= "
                         f"{len(a.domains)} (one episode per domain)")
    a.pool = a.pool or os.path.join(a.runs, "sdft-pool")
    a.student = a.student or os.path.join(a.runs, "base")
    import sdft
    sdft.read_pool(a.pool, a.domains)   # every domain's pool there, readable (UsageError otherwise)
    if not common.is_checkpoint(a.student):
        raise UsageError(f"--student checkpoint not found: {a.student} (the first backbone's start)")
    if a.preset != "tiny":
        require_real_data(a, a.domains)
    a.env_opts = env_options(a)
    a.out = a.out or os.path.join(a.runs, "mle-continual")
    common.check_output(a.out, "mle-continual", inputs=[a.student, a.pool], overwrite=True)
    return a


def main(argv=None):
    a = get_args(argv)
    try:
        a = check_args(a)
        if a.dry_run:
            arch = a.backbone if common.is_checkpoint(a.backbone) else PRESETS[a.preset]["arch"]   # an SDFT backbone's shape
            dry_run(a, arch, a.world_size, a.micro_batch, a.max_tokens,
                    lora=dict(rank=a.lora_rank, targets=[TARGETS[t] for t in a.lora_targets]))
            return
        envs = load_envs(a.domains, a.env_opts, a.seed)
    except UsageError as e:
        common.usage_exit(e)
    if a.continual:
        device = common.start_run(a, f"mle --continual: {' -> '.join(a.domains)} from {a.student} -> {a.out}", [a.out])
        t0 = time.time()
        if common.rank() == 0:
            os.makedirs(a.out, exist_ok=True)
            update_meta(a.out, dict(method="mle-continual", domains=a.domains, student=os.path.abspath(a.student),
                                    pool=os.path.abspath(a.pool)))
        common.barrier()
        try:
            made = continual(a, envs, device)
        except ServiceError as e:
            sys.exit(f"error: {e}; stopped before training on it; its resume state (if any) is kept")
        if common.rank() == 0:
            update_meta(a.out, dict(steps=[os.path.relpath(m, a.out) for m in made], finished=True))
        common.print0(f"done in {time.time() - t0:.0f}s: {', '.join(made)}")
        common.teardown()
        return
    device = common.start_run(a, f"mle: experts {', '.join(a.domains)} on the frozen backbone {a.backbone} -> {a.out}",
                              [os.path.join(a.out, "experts", d) for d in a.domains])
    t0 = time.time()
    if common.rank() == 0:
        top = dict(method="mle", format=FORMAT, backbone=os.path.abspath(a.backbone), backbone_id=common.identity(a.backbone),
                   domains=a.domains, router="tag",
                   experts={d: os.path.join("experts", d) for d in a.domains})
        os.makedirs(a.out, exist_ok=True)
        update_meta(a.out, top)
    if common.sharded():
        dist.barrier()
    done = {}
    for i, d in enumerate(a.domains, 1):
        out = os.path.join(a.out, "experts", d)
        if common.read_meta(out).get("recipe") == recipe(stage_args(a, d), d):
            common.print0(f"[mle/{d}] finished before, skipping")
            done[d] = common.read_meta(out)
            continue
        try:
            done[d] = train_expert(a, i, d, envs[d], device)
        except FloatingPointError as e:
            common.stop_diverged(out, f"{e}; nothing non-finite was saved; the experts before it are kept", e)
        except ServiceError as e:
            sys.exit(f"error: {e}; stopped before training on it; its resume state (if any) is kept")
    if common.rank() == 0:
        summary = {d: dict(trainable_params=m.get("trainable_params"), adapter_bytes=m.get("adapter_bytes"),
                           seconds=m.get("seconds")) for d, m in done.items()}
        update_meta(a.out, dict(expert_summary=summary, finished=True))
        for d, s in summary.items():
            common.print0(f"[mle] {d}: {s['trainable_params']:,} trainable parameters, {s['adapter_bytes'] or 0:,} bytes")
        # a restart keeps the router and the merged exports it made before from the same backbone and experts (by
        # identity) with the same settings, so that the evaluations made after them stay valid
        # --router learned fits both learned routers: on the prompt as the policy sees it, and on the request alone
        for kind in ("learned", "request") if a.router == "learned" else ():
            saved = os.path.join(a.out, ROUTER_FILES[kind])
            old = torch.load(saved, weights_only=True) if os.path.isfile(saved) else {}
            if [old.get(k) for k in ("domains", "prompts", "steps", "seed", "backbone_id")] == \
                    [a.domains, a.router_prompts, a.router_steps, a.seed, common.identity(a.backbone)]:
                common.print0(f"[mle] {kind} router: {saved} kept (fit on this backbone with these settings)")
            else:   # the fit's settings in the meta too: a refit is another MLE directory (common.identity)
                acc = train_router(a, envs, device, kind)
                fit = dict(prompts=a.router_prompts, steps=a.router_steps, seed=a.seed, backbone_id=common.identity(a.backbone))
                suffix = "" if kind == "learned" else "_request"
                update_meta(a.out, {f"router_accuracy{suffix}": acc, f"router_fit{suffix}": fit})
        if a.export:
            export_merged(a)
    common.print0(f"done in {time.time() - t0:.0f}s")
    common.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
