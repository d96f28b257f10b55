"""The training step every method runs, and the flags that size it.

A method brings its own per-token loss (GRPO's clipped surrogate in train_seq.py, the SFT negative
log-likelihood below, a distillation loss); this file turns episodes into tensors, computes the policy's
teacher-forced log-probs, aggregates the loss over the *global* batch and takes one FSDP-safe optimizer step:

    from acl.step import sft_loss, train_on
    loss, stats = train_on(model, opt, episodes, sft_loss, micro_batch=8, agg="token", grad_clip=1.0)

A loss function is   loss_fn(logp, b, x) -> (per-token loss (B, T), {name: per-token statistic (B, T)})
    logp  (B, T) the policy's log-probs of each episode's completion tokens (with grad)
    b     the packed micro-batch (pack): b["mask"] (B, T) is 1 on the policy's sampled tokens, b["slp"] (B, T)
          their sampling log-probs
    x     the method's per-episode `extras`, cut to this micro-batch: a float per episode -> (B, 1), a tensor of
          one value per completion token (episode_logprobs) -> (B, T), zero-padded past the episode's end; with
          train_on(..., gather="ids"), x["ids_logp"] (B, T, k): the policy's log-probs at the token ids x["ids"]
train_on masks the loss to the sampled tokens, and reports each statistic as its mean over the global batch's
sampled tokens (GRPO's clip fraction is one).

Distillation: teacher_scores scores episodes with a frozen teacher (the sampled token's log-prob, the exact
full-vocabulary entropy and the top-q tokens, one chunk of logits at a time); mmopd.py routes each episode to the
teacher of its domain.

A script gets the same flags and per-preset defaults as every other by calling add_scale_flags and add_step_flags.
"""
import argparse
import contextlib
import math
import os
import random
import time

import torch

from acl.common import (
    all_reduce_max,
    all_reduce_sum,
    check_wandb,
    eta,
    print0,
    rank,
    uses_activation_checkpointing,
    world_size,
)
from acl.engine import cache_kwarg
from envs import add_data_flags, per_domain
from envs.base import UsageError
from envs.rollout import MAX_TOKENS, MAX_TURN_TOKENS, Episode, ServiceError

# ----------------------------------------------------------------------------- the shared flags
# The scale half of every script's presets: how big a pass is and what runs it. Tiny fits a 2-core CPU (the
# token limits fit a by-the-book e-commerce episode, see envs/rollout.py); qwen3-8b fits an H200 per rank.
SCALE = {
    "tiny": dict(backend="hf", gen_batch=128, bf16=False, grad_ckpt=False, micro_batch=64, micro_tokens=8192,
                 max_tokens=MAX_TOKENS, max_turn_tokens=MAX_TURN_TOKENS, save_dtype="fp32"),
    "qwen3-8b": dict(backend="vllm", gen_batch=256, bf16=True, grad_ckpt=True, micro_batch=4, micro_tokens=4 * 8192,
                     max_tokens=8192, max_turn_tokens=2048, save_dtype="fp32"),
}
# Checkpoints are fp32 at full scale too: at lr 1e-6 an RL stage moves most weights by about one bf16 step, so task
# vectors (merge.py), a 1/4-weighted merge and the displacement analysis (analyze.py) of bf16 checkpoints would be
# dominated by rounding. The cost: 32.8 GB per 8B checkpoint instead of 16.4 (~15 checkpoints in a study: ~490 GB
# instead of ~250); vLLM loads them in bf16 all the same. --save-dtype bf16 halves it where the analysis is not run.


SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_scale_flags(p, preset: str):
    """The flags of the engine, the sharding and the token limits (make_backend, shard, rollouts, scale.dry_run), with
    SCALE[preset]'s defaults."""
    s = SCALE[preset]
    p.add_argument("--backend", default=s["backend"], choices=["hf", "vllm"],
                   help="rollout engine: hf (transformers) or vllm (colocated, pip install -r requirements-gpu.txt)")
    p.add_argument("--gen-batch", type=int, default=s["gen_batch"], help="sequences per generate call")
    p.add_argument("--max-tokens", default=s["max_tokens"], help="token limit per episode: N (train_seq.py and "
                   "mle.py: or domain=N,... per stage)")
    p.add_argument("--max-turn-tokens", default=s["max_turn_tokens"], help="token limit per turn: N (train_seq.py "
                   "and mle.py: or domain=N,...)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=s["bf16"],
                   help="bf16 compute under FSDP2 (MixedPrecisionPolicy)")
    p.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction, default=s["grad_ckpt"],
                   help="activation checkpointing")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile the "
                   "RMSNorms and the MLP's SiLU * up of the trained and the reference models (acl/compiled.py; "
                   "off until a GPU measures it: bench/gpu.sh)")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload of parameters")
    p.add_argument("--save-dtype", default=s["save_dtype"], choices=sorted(SAVE_DTYPES),
                   help="dtype of the checkpoints a run writes (the master weights train in fp32 either way; the "
                        "resume state keeps them in fp32)")
    p.add_argument("--wandb", default=None, metavar="PROJECT", help="also log every step's metrics to this Weights & "
                   "Biases project (offline unless WANDB_API_KEY or WANDB_MODE is set; pip install wandb)")
    p.add_argument("--dist-timeout", type=float, default=180.0, help="minutes a collective may wait (the process "
                   "group's timeout): ranks wait at a barrier while rank 0 evaluates or writes a checkpoint")
    p.add_argument("--attn", default="auto", help="attention implementation: auto (flash_attention_2 where "
                                                 "flash-attn is installed, else sdpa), sdpa, flash_attention_2, eager")
    p.add_argument("--vllm-gpu-util", type=float, default=0.5, help="vllm backend: share of GPU memory for the "
                                                                    "engine (weights + KV cache) while it generates")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="hf backend: most GB of KV cache kept between an "
                   "episode's turns (beyond it a turn is prefilled whole; default a quarter of the free device memory)")
    p.add_argument("--dry-run", action="store_true", help="build the model on the meta device, apply the FSDP2 "
                   "plan for --world-size ranks, print parameters and memory per rank and the config; no download")
    p.add_argument("--world-size", type=int, default=None, help="ranks assumed by --dry-run (default $WORLD_SIZE or 8)")


def add_step_flags(p, preset: str):
    """The flags of train_on: micro-batch, aggregation, gradient clip, and the sampling temperature that the
    trainer divides its logits by too."""
    p.add_argument("--micro-batch", type=int, default=SCALE[preset]["micro_batch"], help="sequences per forward pass")
    p.add_argument("--micro-tokens", type=int, default=SCALE[preset]["micro_tokens"], help="padded tokens per "
                   "forward pass (sequences x the longest): one long episode among short ones gets a pass of its own")
    p.add_argument("--agg", default="token", choices=["token", "seq"], help="loss aggregation: token-mean "
                                                                            "(DAPO) or sequence-mean (GRPO)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of rollouts")


def add_training_flags(p, preset: str):
    """The flags every training script shares: the scale's (add_scale_flags), train_on's (add_step_flags), the
    environments' data and services (envs.add_data_flags), --seed and --threads."""
    add_scale_flags(p, preset)
    add_step_flags(p, preset)
    add_data_flags(p, train=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def check_shared_flags(a, domains=None):
    """UsageError (one line) for a bad value of the shared flags; fills --world-size's default. domains: the stages
    of a script whose token limits may differ per domain (a.max_tokens_by_domain, ...; a.max_tokens is then the
    largest, what the engine is sized for); without, one number each."""
    if a.world_size is None:
        a.world_size = int(os.environ.get("WORLD_SIZE", "8" if a.dry_run else "1"))
    if domains is None and not all(str(v).isdigit() for v in (a.max_tokens, a.max_turn_tokens)):
        raise UsageError("--max-tokens and --max-turn-tokens take one whole number each in this script")
    names = domains or ["all"]
    a.max_tokens_by_domain = per_domain("--max-tokens", a.max_tokens, domains) if domains else \
        {"all": int(a.max_tokens)}
    a.max_turn_tokens_by_domain = per_domain("--max-turn-tokens", a.max_turn_tokens, domains) if domains else \
        {"all": int(a.max_turn_tokens)}
    a.max_tokens, a.max_turn_tokens = max(a.max_tokens_by_domain.values()), max(a.max_turn_tokens_by_domain.values())
    for ok, msg in [(a.world_size >= 1, "--world-size must be >= 1"), (a.gen_batch >= 1, "--gen-batch must be >= 1"),
                    (a.kv_cache_gb is None or a.kv_cache_gb >= 0, "--kv-cache-gb must be >= 0"),
                    (all(a.max_tokens_by_domain[d] > a.max_turn_tokens_by_domain[d] > 0 for d in names),
                     "need --max-tokens > --max-turn-tokens > 0"),
                    (0 < a.vllm_gpu_util <= 1, "--vllm-gpu-util must be in (0, 1]"),
                    (a.micro_batch >= 1, "--micro-batch must be >= 1"), (a.grad_clip > 0, "--grad-clip must be > 0"),
                    (a.micro_tokens >= 1, "--micro-tokens must be >= 1"),
                    (a.dist_timeout > 0, "--dist-timeout must be > 0 (minutes)"),
                    (a.temperature > 0, "--temperature must be > 0 for training"),
                    (getattr(a, "threads", None) is None or a.threads >= 1, "--threads must be >= 1")]:
        if not ok:
            raise UsageError(msg)
    check_wandb(a.wandb)
    return a


# ----------------------------------------------------------------------------- episodes -> tensors -> log-probs

def to_device(b: dict, dev) -> dict:
    return {k: v.to(dev) for k, v in b.items()}


def pad_id(model) -> int:
    return model.config.pad_token_id if model.config.pad_token_id is not None else 0


def stand_in(pad: int) -> Episode:
    """A two-token episode with nothing to learn: the pass a rank without episodes runs so that every rank runs
    as many forward passes (FSDP2's all-gathers are collectives)."""
    return Episode("-", "-", "-", 0, [pad, pad], [0, 0], [0.0, 0.0], 1)


def pack(episodes, pad_id: int) -> dict:
    """Training tensors with every distinct prompt once (a GRPO group shares one). The prompt (the tokens
    before the policy's first turn) is left-padded, the rest of the episode (the completion: policy turns,
    tool results, user replies) right-padded after it.
    -> p_ids, p_attn (U, Tp); rows (B,): each episode's prompt row; c_ids, c_attn (B, Tc);
       mask (B, Tc): 1 on the policy's sampled tokens; slp (B, Tc): their sampling log-probs."""
    prompts, rows = {}, []
    for e in episodes:
        rows.append(prompts.setdefault(tuple(e.token_ids[: e.prompt_len]), len(prompts)))
    Tp = max(len(p) for p in prompts)
    Tc = max(1, max(len(e.token_ids) - e.prompt_len for e in episodes))
    p_ids = torch.full((len(prompts), Tp), pad_id, dtype=torch.long)
    p_attn = torch.zeros((len(prompts), Tp), dtype=torch.long)
    for p, u in prompts.items():
        p_ids[u, Tp - len(p):] = torch.tensor(p, dtype=torch.long)
        p_attn[u, Tp - len(p):] = 1
    c_ids = torch.full((len(episodes), Tc), pad_id, dtype=torch.long)
    c_attn = torch.zeros((len(episodes), Tc), dtype=torch.long)
    mask = torch.zeros((len(episodes), Tc))
    slp = torch.zeros((len(episodes), Tc))
    for i, e in enumerate(episodes):
        n = len(e.token_ids) - e.prompt_len
        if n > 0:
            c_ids[i, :n] = torch.tensor(e.token_ids[e.prompt_len:])
            c_attn[i, :n] = 1
            mask[i, :n] = torch.tensor(e.loss_mask[e.prompt_len:], dtype=torch.float)
            slp[i, :n] = torch.tensor(e.logprobs[e.prompt_len:], dtype=torch.float)
    return dict(p_ids=p_ids, p_attn=p_attn, rows=torch.tensor(rows), c_ids=c_ids, c_attn=c_attn, mask=mask, slp=slp)


def selected_logprobs(logits, targets, temperature: float = 1.0, chunk_tokens: int = 4096, extra_ids=None,
                      head=None):
    """log softmax(logits / temperature) at the targets: (B, T, V), (B, T) -> (B, T); with extra_ids (B, T, k), also
    the log-probs at those ids -> ((B, T), (B, T, k)) (a distillation loss reads the policy at a teacher's top
    tokens). Computed a time chunk of about chunk_tokens tokens at a time, each chunk checkpointed: its float32
    copy, log-softmax and gradient are rebuilt in the backward pass instead of kept, so the logits are held once,
    at their own dtype (about 2 bytes per vocabulary entry under bf16, and their gradient, instead of ~10 bytes;
    for 4 x 8192 tokens of Qwen3-8B, 46 -> 24 GiB per rank).
    With head (a function hidden -> logits, the model's output head), `logits` are the final hidden states (B, T, h)
    and each chunk's logits are built inside its checkpoint too: the (B, T, V) logits never exist whole, forward or
    backward (the head's matmul runs twice per chunk: ~2 B T h V more FLOPs, e.g. +6% for Qwen3-1.7B's update).
    Values and gradients equal the one-piece computation up to float rounding (tested)."""
    def piece(x, y, z=None):
        x = (x if head is None else head(x)).float()
        if temperature > 0 and temperature != 1.0:
            x = x / temperature
        if z is None:
            return -torch.nn.functional.cross_entropy(x.transpose(1, 2), y, reduction="none")
        lse = torch.logsumexp(x, -1, keepdim=True)                                # (B, t, 1)
        return x.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse.squeeze(-1), x.gather(-1, z) - lse
    step = max(1, chunk_tokens // max(1, logits.size(0)))
    args = (logits, targets) if extra_ids is None else (logits, targets, extra_ids)
    if logits.size(1) <= step and head is None:
        return piece(*args)
    from torch.utils.checkpoint import checkpoint
    grad = torch.is_grad_enabled() and (logits.requires_grad or head is not None)
    out = []
    for s in range(0, max(1, logits.size(1)), step):
        chunk = [t[:, s: s + step] for t in args]
        out.append(checkpoint(piece, *chunk, use_reentrant=False) if grad else piece(*chunk))
    if extra_ids is None:
        return torch.cat(out, 1)
    return torch.cat([o[0] for o in out], 1), torch.cat([o[1] for o in out], 1)


@contextlib.contextmanager
def head_replaced(model, fn):
    """While inside, the model's output head returns fn(hidden states, head) instead of its logits: it still runs
    inside the model's forward, where FSDP2 has gathered the head's weights (and registered its gradient's
    reduce-scatter), so a caller can read what it needs from the hidden states without building the full logits.
    -> False (nothing replaced) when fn is None or the head is not a plain Linear (e.g. a LoRA-adapted head): the
    caller then takes the logits as they are (so does a model wrapper without get_output_embeddings)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if fn is None or type(head) is not torch.nn.Linear:
        yield False
        return
    head.forward = lambda h: fn(h, head)
    try:
        yield True
    finally:
        del head.forward


def head_logprobs(targets, temperature: float, extra_ids=None, chunk_tokens: int = 4096):
    """fn for head_replaced: the first T = targets.size(1) positions' log-probs of the targets, computed from the
    hidden states by selected_logprobs(head=...), as one (B, T) tensor, or (B, T, 1 + k) with extra_ids (the
    target's log-prob first): a model's output is one tensor. forward_logprobs splits it."""
    def fn(h, head):
        lp = selected_logprobs(h[:, : targets.size(1)], targets, temperature, chunk_tokens, extra_ids,
                               head=lambda z: torch.nn.functional.linear(z, head.weight, head.bias))
        return lp if extra_ids is None else torch.cat([lp[0].unsqueeze(-1), lp[1]], -1)
    return fn


def forward_logprobs(model, kw: dict, targets, temperature: float, extra_ids, fused: bool, chunk_tokens: int):
    """model(**kw)'s log-probs of `targets` at its first targets.size(1) positions (and at extra_ids): through the
    fused head (head_logprobs) where it applies and `fused`, else from the model's logits."""
    fn = head_logprobs(targets, temperature, extra_ids, chunk_tokens) if fused else None
    with head_replaced(model, fn) as in_head:
        out = model(**kw).logits
    if not in_head:
        return selected_logprobs(out[:, : targets.size(1)], targets, temperature, chunk_tokens, extra_ids)
    return out if extra_ids is None else (out[..., 0], out[..., 1:])


def whole_sequences(b: dict) -> tuple:
    """A packed micro-batch as whole sequences, each episode's prompt then its completion: (ids, attention mask,
    position ids), each (B, Tp + Tc)."""
    ids = torch.cat([b["p_ids"][b["rows"]], b["c_ids"]], 1)
    attn = torch.cat([b["p_attn"][b["rows"]], b["c_attn"]], 1)
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model, b: dict, temperature: float = 1.0, extra_ids=None, fused: bool = True,
                   chunk_tokens: int = 4096):
    """(B, Tc) log-prob of every completion token, logits divided by the sampling temperature so trainer
    and sampler score the same distribution; with extra_ids (B, Tc, k) also the log-probs at those ids, (B, Tc, k).
    Each distinct prompt runs once and its KV cache is shared by its samples (the gradients of all of them flow
    back into it); under activation checkpointing, which has no cache, prompt and completion run as one sequence.
    fused (the default): the output head computes the log-probs chunk by chunk from the hidden states
    (head_replaced), so the (B, Tc, V) logits are never held; fused=False takes the model's logits (the reference
    the tests and bench/logprob_memory.py compare against). chunk_tokens: the tokens of one chunk of logits."""
    p_ids, p_attn, rows, c_ids, c_attn = b["p_ids"], b["p_attn"], b["rows"], b["c_ids"], b["c_attn"]
    if uses_activation_checkpointing(model):
        ids, attn, pos = whole_sequences(b)
        # only where they are needed: positions Tp - 1 ... Tp + Tc - 2 predict the completion
        keep = dict(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=c_ids.size(1) + 1)
        return forward_logprobs(model, keep, c_ids, temperature, extra_ids, fused, chunk_tokens)
    from transformers import DynamicCache
    cache = DynamicCache()
    kv = {cache_kwarg(model): cache}
    p_pos = (p_attn.cumsum(-1) - 1).clamp(min=0)                                              # (U, Tp)
    last = model(input_ids=p_ids, attention_mask=p_attn, position_ids=p_pos, use_cache=True, logits_to_keep=1,
                 **kv).logits[:, -1]                                                          # (U, V): small
    cache.batch_select_indices(rows)                                                          # U -> B rows
    attn = torch.cat([p_attn[rows], c_attn], 1)                                               # (B, Tp + Tc)
    pos = p_attn.sum(-1)[rows, None] + torch.arange(c_ids.size(1), device=c_ids.device)       # (B, Tc)
    # position t predicts c_ids[:, t]: the prompt's last logits for t = 0, the completion's own after that
    first = selected_logprobs(last[rows, None], c_ids[:, :1], temperature, chunk_tokens,
                              None if extra_ids is None else extra_ids[:, :1])
    rest = forward_logprobs(model, dict(input_ids=c_ids, attention_mask=attn, position_ids=pos, use_cache=True, **kv),
                            c_ids[:, 1:], temperature, None if extra_ids is None else extra_ids[:, 1:], fused,
                            chunk_tokens)
    if extra_ids is None:
        return torch.cat([first, rest], 1)                                                    # (B, Tc)
    return torch.cat([first[0], rest[0]], 1), torch.cat([first[1], rest[1]], 1)               # (B, Tc), (B, Tc, k)


def micro_batches(episodes, size: int, tokens: int = 0) -> list:
    """Index lists of at most `size` episodes and, with tokens > 0, at most `tokens` padded tokens (pack pads every
    episode to the longest prompt plus the longest completion); an episode longer than that gets a list of its own.
    Episodes are sorted by length, so a micro-batch holds similar lengths: one 750-token search episode among 63
    of 200 tokens would pad them all, and the backward pass costs ~4x. Samples of one prompt that land together
    share one prompt pass (pack)."""
    order = sorted(range(len(episodes)), key=lambda i: (len(episodes[i].token_ids),
                                                        episodes[i].token_ids[: episodes[i].prompt_len]))
    out, tp, tc = [], 0, 0
    for i in order:
        p, c = episodes[i].prompt_len, len(episodes[i].token_ids) - episodes[i].prompt_len
        if not out or len(out[-1]) >= size or (tokens and (len(out[-1]) + 1) * (max(tp, p) + max(tc, c)) > tokens):
            out.append([])
            tp, tc = 0, 0
        out[-1].append(i)
        tp, tc = max(tp, p), max(tc, c)
    return out


@torch.no_grad()
def per_episode(model, episodes, micro_batch: int, score, micro_tokens: int = 0) -> list:
    """score(model, packed micro-batch) -> a (B, Tc, ...) tensor or a dict of them, run over `episodes` in
    micro-batches; -> per episode the same cut to its completion tokens, on the CPU. Every rank runs as many passes as
    the busiest one (FSDP2's all-gathers are collectives), so ranks may hold different numbers of episodes."""
    pad, dev = pad_id(model), next(model.parameters()).device
    micro = micro_batches(episodes, micro_batch, micro_tokens)
    out = [None] * len(episodes)
    for m in range(int(all_reduce_max(len(micro)))):
        if m >= len(micro):
            score(model, to_device(pack([stand_in(pad)], pad), dev))
            continue
        idx = micro[m]
        res = score(model, to_device(pack([episodes[i] for i in idx], pad), dev))
        for j, i in enumerate(idx):
            n = max(1, len(episodes[i].token_ids) - episodes[i].prompt_len)
            out[i] = {k: v[j, :n].cpu() for k, v in res.items()} if isinstance(res, dict) else res[j, :n].cpu()
    return out


def episode_logprobs(model, episodes, *, micro_batch: int, temperature: float = 1.0, micro_tokens: int = 0) -> list:
    """Each episode's completion-token log-probs under `model` (the policy before an update: the PPO ratio's
    denominator; a frozen reference or a teacher), one CPU tensor per episode, as train_on's extras take them."""
    return per_episode(model, episodes, micro_batch, lambda m, b: token_logprobs(m, b, temperature), micro_tokens)


# ----------------------------------------------------------------------------- teachers (distillation)

@torch.no_grad()
def head_scores(hidden, head, targets, q: int, temperature: float = 1.0, chunk_tokens: int = 4096) -> dict:
    """What a distillation loss needs from a teacher at each position, from its final hidden states (B, T, h) and
    its output head: the log-prob of the target token (B, T), the exact entropy over the whole vocabulary (B, T), the
    q most likely token ids and their log-probs (B, T, q). The (B, t, V) float32 logits exist for one chunk of about
    chunk_tokens tokens at a time (Qwen3's vocabulary is 151,936: 4 x 8192 positions at once would be 20 GiB)."""
    B, T = targets.shape
    f32 = dict(device=hidden.device, dtype=torch.float32)
    out = dict(lp=torch.zeros((B, T), **f32), ent=torch.zeros((B, T), **f32), top_lp=torch.zeros((B, T, q), **f32),
               top_ids=torch.zeros((B, T, q), dtype=torch.long, device=hidden.device))
    step = max(1, chunk_tokens // max(1, B))
    for s in range(0, T, step):
        x = head(hidden[:, s: s + step]).float()                                     # (B, t, V): one chunk
        if temperature != 1.0:
            x = x / temperature
        logz = torch.log_softmax(x, -1)
        out["lp"][:, s: s + step] = logz.gather(-1, targets[:, s: s + step, None]).squeeze(-1)
        out["ent"][:, s: s + step] = -(logz.exp() * logz).sum(-1)
        out["top_lp"][:, s: s + step], out["top_ids"][:, s: s + step] = logz.topk(q, -1)
    return out


@torch.no_grad()
def teacher_pass(model, b: dict, q: int, temperature: float = 1.0, chunk_tokens: int = 4096) -> dict:
    """head_scores of a packed micro-batch's completion tokens under `model`, in one teacher-forced pass of prompt
    and completion. The model's output head is swapped, for this pass, for head_scores (it still runs inside the
    model's forward, where FSDP2 has gathered the head's weights), so the full logits are never built."""
    c_ids = b["c_ids"]
    ids, attn, pos = whole_sequences(b)
    res = {}

    def scorer(h, head):   # positions Tp - 1 ... Tp + Tc - 2 predict the completion; the last one predicts nothing
        res.update(head_scores(h[:, :-1], lambda z: torch.nn.functional.linear(z, head.weight, head.bias), c_ids, q,
                               temperature, chunk_tokens))
        return h.new_zeros((h.size(0), h.size(1), 1))
    with head_replaced(model, scorer) as swapped:
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=c_ids.size(1) + 1)
    if not swapped:   # an adapted head: score its logits
        res = head_scores(out.logits[:, :-1], lambda z: z, c_ids, q, temperature, chunk_tokens)
    return res


@torch.no_grad()
def teacher_scores(model, episodes, *, micro_batch: int, q: int, temperature: float = 1.0,
                   chunk_tokens: int = 4096, micro_tokens: int = 0) -> list:
    """teacher_pass over `episodes` in micro-batches (per_episode): per episode a dict of CPU tensors over its
    completion tokens, lp (T,), ent (T,), top_lp (T, q), top_ids (T, q); None for an episode whose scores are not
    finite (a failing teacher: the caller drops the episode and counts it)."""
    out = per_episode(model, episodes, micro_batch, lambda m, b: teacher_pass(m, b, q, temperature, chunk_tokens),
                      micro_tokens)
    return [s if all(torch.isfinite(v).all() for k, v in s.items() if k != "top_ids") else None for s in out]


def cut_extras(extras: dict, idx: list, T: int, dev) -> dict:
    """The extras of episodes `idx`: floats -> (b, 1); per-token tensors -> (b, T, ...), zero-padded."""
    out = {}
    for k, values in extras.items():
        vals = [values[i] for i in idx]
        if torch.is_tensor(vals[0]):
            x = torch.nn.utils.rnn.pad_sequence(vals, batch_first=True)
            if x.size(1) < T:
                x = torch.cat([x, x.new_zeros((x.size(0), T - x.size(1), *x.shape[2:]))], 1)
            out[k] = x.to(dev)
        else:
            out[k] = torch.tensor([[float(v)] for v in vals], dtype=torch.float, device=dev)
    return out


# ----------------------------------------------------------------------------- the policy-gradient surrogate

def clipped_surrogate(log_ratio, adv, old, slp, clip_low: float, clip_high: float, tis_cap: float):
    """The PPO/DAPO clipped surrogate as a per-token loss (B, T), for any per-token or per-sequence advantage A:
    -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) w, with r = exp(log_ratio) the ratio of the current policy to
    the trainer's log-probs `old` under the weights that sampled (per token, or GSPO's per sequence), and w =
    min(exp(old - slp), tis_cap) the truncated importance weight between those and the sampler's own log-probs slp
    (1 when they agree; bf16 vLLM against FSDP they do not quite). GRPO's loss (train_seq.py) and MMOPD's
    reverse-KL term (mmopd.py) are this with their own A. -> (loss (B, T), 1 where r is outside the clip range)."""
    ratio = torch.exp(log_ratio)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    tis = torch.exp(old - slp).clamp(max=tis_cap).detach()
    clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float().detach()
    return -surr * tis, clipped


# ----------------------------------------------------------------------------- one optimizer step

# This process's training so far (sequences and their tokens through a forward and backward pass), for the cost table
TRAIN_COUNTS = {"trained_sequences": 0, "trained_tokens": 0}


def cost_now() -> dict:
    """A snapshot of this process's work so far (rollouts: envs.rollout.ROLLOUT_COUNTS; training: TRAIN_COUNTS) and
    the time: cost_since(snapshot) later gives what a piece of a run cost."""
    from envs.rollout import ROLLOUT_COUNTS
    return dict(ROLLOUT_COUNTS, **TRAIN_COUNTS, t=time.time())


def cost_since(start: dict) -> dict:
    """What was done since cost_now() gave `start`, summed over the ranks (every rank calls it): episodes,
    env_calls, sampled_tokens, trained_sequences, trained_tokens, and the wall seconds. A resumed run counts what
    this process did (the work before the kill is not in it)."""
    now = cost_now()
    out = {k: int(all_reduce_sum(float(now[k] - start[k]))) for k in now if k != "t"}
    return dict(out, seconds=round(now["t"] - start["t"], 1))


def train_on(model, opt, episodes, loss_fn, *, micro_batch: int, agg: str = "token", grad_clip: float = 1.0,
             temperature: float = 1.0, extras: dict | None = None, gather: str | None = None, micro_tokens: int = 0):
    """One optimizer step on `episodes` (this rank's share of the global batch), in micro-batches of at most
    micro_batch sequences and micro_tokens padded tokens (micro_batches), with loss_fn's per-token loss (see the module docstring). The loss is normalised by
    the *global* number of loss tokens (agg "token") or sequences ("seq"), and multiplied by the world size
    because FSDP averages gradients over ranks: N ranks give the same update as one process on the whole batch.
    extras: {name: one value per episode}, cut per micro-batch for loss_fn. gather: the name of an extras entry of
    token ids per completion token (T, k) at which loss_fn also needs the policy's log-probs: x[gather + "_logp"].
    -> (loss over the global batch, {statistic: token-mean over the global batch, grad_norm: before the clip,
    weight_change: |change of the trained weights' norm| / that norm}); FloatingPointError on a non-finite loss,
    gradient or weight (before the weights change, for the loss and the gradient), or a weight_change above
    MAX_WEIGHT_CHANGE."""
    extras = extras or {}
    TRAIN_COUNTS["trained_sequences"] += len(episodes)
    TRAIN_COUNTS["trained_tokens"] += sum(len(e.token_ids) for e in episodes)
    pad, dev = pad_id(model), next(model.parameters()).device
    micro = micro_batches(episodes, micro_batch, micro_tokens)
    # every rank must run the same number of forward/backward passes (FSDP collectives): pad with
    # zero-weight passes (on one of this rank's episodes, or on a stand-in when it has none)
    n_micro = int(all_reduce_max(len(micro)))
    n_tok = all_reduce_sum(float(sum(e.n_sampled for e in episodes)))
    n_seq = all_reduce_sum(float(len(episodes)))
    denom = max(n_tok if agg == "token" else n_seq, 1.0)
    total, sums = torch.zeros(()), {}
    opt.zero_grad(set_to_none=True)
    for m in range(n_micro):
        dummy = m >= len(micro)
        idx = micro[m] if not dummy else micro[0][:1] if micro else []
        if not idx:
            logp = token_logprobs(model, to_device(pack([stand_in(pad)], pad), dev), temperature)
            (logp.sum() * 0.0).backward()
            continue
        b = to_device(pack([episodes[i] for i in idx], pad), dev)
        if dummy:
            b["mask"] = b["mask"] * 0.0
        x = cut_extras(extras, idx, b["c_ids"].size(1), dev)
        if gather:
            logp, x[gather + "_logp"] = token_logprobs(model, b, temperature, extra_ids=x[gather].long())
        else:
            logp = token_logprobs(model, b, temperature)                                # (b, Tc)
        per_tok, stats = loss_fn(logp, b, x)                                            # (b, Tc)
        mask = b["mask"]                                                                # (b, Tc)
        if agg == "token":
            loss = (per_tok * mask).sum() / denom
        else:
            loss = ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / denom
        (loss * world_size()).backward()
        total += loss.detach().cpu()
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + (v.detach() * mask).sum().item()
    total = all_reduce_sum(total.item())
    if not math.isfinite(total):
        raise FloatingPointError(f"non-finite loss {total}")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not math.isfinite(norm):
        raise FloatingPointError(f"non-finite gradient norm {norm}")
    before = weight_norm(model)
    opt.step()
    check_finite(model, "after the optimizer step")
    change = abs(weight_norm(model) - before) / max(before, 1e-12)
    if change > MAX_WEIGHT_CHANGE:
        raise FloatingPointError(f"the update changed the trained weights' norm by {change:.3g} of itself (the bound is "
                                 f"{MAX_WEIGHT_CHANGE:g}): a finite blow-up")
    return total, {k: all_reduce_sum(v) / max(n_tok, 1.0) for k, v in sums.items()} | {"grad_norm": norm,
                                                                                       "weight_change": change}


# The most one update may change the trained weights' norm, relative to it, before a run stops as diverged. AdamW
# moves each weight by about lr per step whatever the gradient's scale, so a sane step at lr <= 1e-2 changes the norm
# by a small fraction of itself (the tiny arena's steps: well under 1%); a step that doubles it or wipes it out is a
# blow-up that stayed finite (lr 1e6: weights of 1e6 where the base's largest is 1.7), which check_finite cannot see.
MAX_WEIGHT_CHANGE = 1.0


def weight_norm(model) -> float:
    """The L2 norm of the weights that train (every rank's shards, summed over ranks)."""
    sq = sum(float((p.to_local() if hasattr(p, "to_local") else p).detach().float().pow(2).sum())
             for p in model.parameters() if p.requires_grad)
    return math.sqrt(all_reduce_sum(sq))


@torch.no_grad()
def check_finite(model, when: str):
    """FloatingPointError unless every weight is finite (on every rank's shard): a diverging run stops at the step
    it diverged, and nothing non-finite is ever saved or sampled from."""
    bad = sum(int(not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in model.parameters())
    if all_reduce_sum(bad):
        raise FloatingPointError(f"non-finite weights {when}")


# ----------------------------------------------------------------------------- supervised fine-tuning

def sft_loss(logp, b, x):
    """Negative log-likelihood of the policy's tokens (RFT's cold start, SDFT)."""
    return -logp, {}


def sft_epochs(model, opt, episodes, *, epochs: int, batch: int, micro_batch: int, grad_clip: float, seed: int,
               agg: str = "token", label: str = "sft", metrics=None, micro_tokens: int = 0) -> list:
    """`epochs` passes of SFT over this rank's `episodes`, `batch` of them per optimizer step, in a seeded
    shuffle; every rank takes as many steps as the busiest one. metrics: a common.Metrics that gets a row per step.
    -> the loss of every step."""
    n_steps = int(all_reduce_max(math.ceil(len(episodes) / batch))) * epochs
    rng = random.Random(seed + rank())
    order, losses, t0 = [], [], time.time()
    for s in range(n_steps):
        if not order:
            order = list(range(len(episodes)))
            rng.shuffle(order)
        chunk = [episodes[order.pop()] for _ in range(min(batch, len(order)))]
        ts = time.time()
        loss, stats = train_on(model, opt, chunk, sft_loss, micro_batch=micro_batch, agg=agg, grad_clip=grad_clip,
                               micro_tokens=micro_tokens)
        losses.append(loss)
        if metrics:
            metrics.log(dict(step=s + 1, nll=loss, grad_norm=stats["grad_norm"], seconds=round(time.time() - ts, 2)))
        if s % 10 == 0 or s == n_steps - 1:
            print0(f"{label} sft step {s + 1}/{n_steps} | nll {loss:.4f} | {eta(t0, s + 1, n_steps - s - 1)}")
    return losses


def parse_mix(text: str, domains: list, named=("balanced",)):
    """--mix: one of the `named` mixes, or a weight per domain "w1,w2,..." (finite, >= 0, not all 0) -> the name or the
    list of weights, for mix_quota; UsageError (one line) otherwise."""
    if text in named:
        return text
    try:
        w = [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--mix takes {', '.join(named)} or {len(domains)} weights w1,w2,...; got {text!r}") from None
    if len(w) != len(domains) or min(w) < 0 or not sum(w) > 0 or not all(map(math.isfinite, w)):
        raise UsageError(f"--mix weights: one finite weight >= 0 per domain of --domains ({len(domains)}), not all 0")
    return w


def mix_quota(mix, sizes: dict, batch: int) -> dict:
    """Items per domain in a batch of `batch` (SDFT's episodes, MMOPD's prompts): balanced (equal), proportional (to
    `sizes`) or the weights of --mix w1,w2,... in --domains order, rounded by largest remainder to sum to `batch`."""
    ds = list(sizes)
    w = {d: 1.0 for d in ds} if mix == "balanced" else {d: float(sizes[d]) for d in ds} if mix == "proportional" \
        else dict(zip(ds, mix))
    raw = {d: batch * w[d] / sum(w.values()) for d in ds}
    q = {d: int(math.floor(raw[d])) for d in ds}
    for d in sorted(ds, key=lambda d: raw[d] - q[d], reverse=True)[: batch - sum(q.values())]:
        q[d] += 1
    return q


class Cursor:
    """Walks a seeded shuffle of the train prompts, epoch after epoch; its position is saved on resume.
    Every rank walks the same order and takes its own slice of each global batch."""

    def __init__(self, n: int, seed: int, pos: int = 0):
        self.n, self.seed, self.pos = n, seed, pos
        self._epoch, self._order = None, None

    def take(self, k: int) -> list:
        out = []
        for _ in range(k):
            epoch, i = divmod(self.pos, self.n)
            if epoch != self._epoch:  # one shuffle per epoch, not one per prompt taken
                self._epoch, self._order = epoch, list(range(self.n))
                random.Random(self.seed * 1000 + epoch).shuffle(self._order)
            out.append(self._order[i])
            self.pos += 1
        return out


def check_user_errors(episodes, max_fraction: float, where: str):
    """ServiceError when more than max_fraction of the batch's e-commerce episodes (every rank's: call it on all
    ranks at once) ended in a user-model error (metrics["user_error"]); episodes of other domains do not count."""
    eco = [e for e in episodes if "user_error" in e.metrics]
    n = all_reduce_sum(float(len(eco)))
    bad = all_reduce_sum(float(sum(e.metrics["user_error"] >= 1 for e in eco)))
    if n and bad / n > max_fraction:
        raise ServiceError(f"{where}: {int(bad)} of {int(n)} e-commerce episodes ended in a user-model error (more than "
                           f"--max-user-errors {max_fraction:g}): the user model at --user-url is failing")
