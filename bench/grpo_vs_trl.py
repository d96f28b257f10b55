"""Benchmark: wall time of ONE GRPO update (generation + training) of train_seq.py beside TRL's GRPOTrainer,
on the same tiny model, prompts, group size, generation length and learning rate. Target: ours <= 0.7x TRL.

    pip install trl                       # benchmark-only dependency, not in requirements.txt (used: trl 1.16.0)
    python bench/grpo_vs_trl.py           # runs/tiny/base if present, else a random tiny model; 1 thread
    python bench/grpo_vs_trl.py --prompts 16 --group 8 --max-new-tokens 64 --repeats 3 --threads 1
    python bench/grpo_vs_trl.py --sides ours --prompts 2 --group 2 --max-new-tokens 8 --repeats 1   # ours alone, no TRL

What is compared. Each side starts from the same checkpoint (a fresh copy each) and runs 1 + --repeats
updates on the same --prompts tiny-math train prompts per update (the same batches in the same order), each
sampled --group times with at most --max-new-tokens tokens, temperature 1, top_k 0, top_p 1 (the full
distribution), fp32 on the CPU, no KL, no vLLM, one optimizer step per update, in micro-batches of the tiny
preset's --micro-batch sequences. The first update is a warm-up; the table reports the mean of the others.
--sides ours (or trl) runs that side alone and prints its row without a ratio (the tests' smoke run needs no TRL).
- ours: what one step of train_seq.grpo() does: envs.rollout.rollout with HFBackend (the policy itself,
  batches of the preset's --gen-batch), train_seq.group_advantages, then acl.step.train_on with
  train_seq.grpo_loss and the tiny preset's flags (clip 0.2/0.28, token-mean, tis cap, grad clip 1,
  AdamW betas 0.9/0.999, the preset's lr: 2e-4, 5e-4 when the figures below were measured).
- TRL: GRPOTrainer with a dataset of the same system+user messages (the tokenizer's chat template renders
  them), a reward function that is envs.math.grade on the completion against the gold answer (0 when cut by
  the token limit, as MathEnv.score does), num_generations=G, loss_type "dapo" (token-mean over the whole
  batch, like agg=token), epsilon 0.2 / epsilon_high 0.28, beta 0, scale_rewards "group", constant lr,
  per_device_train_batch_size = micro-batch and gradient_accumulation_steps = steps_per_generation =
  P*G / micro-batch (so one generation feeds exactly one optimizer step and no extra "old log-prob" forward
  pass is made), gradient checkpointing off. Its time per update is the wall time between consecutive
  optimizer steps (a callback), its generation time is _generate_and_score_completions (generate, decode,
  rewards, advantages); "train" is the rest.

Where the two sides are not identical (plainly):
1. Both sample from the same distribution (checked: same samples for the same seed at the base) but not the
   same tokens (different RNG streams, and the policies drift apart after the first update), so completion
   lengths differ, above all each update's longest one, which drives its cost (see below); the table
   prints the tokens generated and the longest completion per update.
2. Dynamic sampling is off on our side: groups whose rewards are all equal are kept with advantage 0 (TRL
   trains on every completion too), so both sides train on all P*G sequences; train_seq's default would
   drop them (less training) or draw more prompts (more generation).
3. Ours stops a turn at <|im_end|> or </tool_call> (the env's stop tokens), TRL at <|im_end|> only; ours
   also records the sampling log-probs (for its truncated importance weight). Both compute logits over the
   completion only; ours runs each distinct prompt once per forward (generation and training) and shares
   its KV cache among the group's samples, TRL runs prompt + completion for every sample.
4. The two sides run one after the other on a shared machine, so background load can move the ratio; the
   load average before each side is printed.

Measured on 2026-11-30, 2-core CPU (idle, load average ~1), runs/tiny/base (math demos with column working,
so completions often reach the 64-token limit on both sides), --threads 1, `python bench/grpo_vs_trl.py
--repeats 10` (16 prompts x 8 samples, <= 64 new tokens, 1 warm-up + 10 timed updates):
    | side | gen s | train s | total s/update | tokens generated | longest completion | load avg before |
    |---|---|---|---|---|---|---|
    | ours | 0.57 | 1.15 | 1.71 | 4258 | 64 | 0.96 |
    | TRL | 0.96 | 2.01 | 2.97 | 4120 | 64 | 0.97 |
    ratio ours/TRL: 0.58 (target <= 0.7) | gen 0.59 | train 0.57
Before prompt sharing and the own decode loop (2026-11-29, previous base, shorter completions): 1.50 s vs
1.57 s (0.95). An update costs about its *longest* completion, because every row runs until the last one
stops and training pads to it: with short completions whichever side samples a 64-token runaway pays about
2x for that update, so use --repeats 10 or more for a steady figure.
"""
import argparse
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_seq  # noqa: E402
from acl.common import resolve_attn  # noqa: E402
from acl.engine import HFBackend
from acl.step import Cursor, train_on  # noqa: E402
from envs import make_env  # noqa: E402
from envs.math import grade  # noqa: E402
from envs.rollout import rollout


def checkpoint(path: str | None, seed: int) -> str:
    """The tiny base if it exists; else a randomly initialised tiny-size Qwen3 with the tiny tokenizer and
    chat template, saved to a temporary directory (it writes until the token limit: the timing still holds)."""
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import Qwen3ForCausalLM

    from pretrain import model_config, protocol_texts, train_tokenizer
    print(f"no checkpoint at {path}: building a random tiny model in a temporary directory")
    tok = train_tokenizer(make_env("math").knowledge(500, seed=seed) + protocol_texts(["math"]))
    torch.manual_seed(seed)
    out = tempfile.mkdtemp(prefix="grpo-vs-trl-")
    Qwen3ForCausalLM(model_config(tok, "tiny")).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_ours(path, env, batches, a):
    """-> [(gen_s, train_s, tokens generated, longest completion)] per update: one train_seq.grpo() step each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=resolve_attn(a.attn))
    backend = HFBackend(policy, tok, a.gen_batch)
    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr, betas=(0.9, 0.999), weight_decay=0.0)
    out = []
    for step, tasks in enumerate(batches, 1):
        t0 = time.perf_counter()
        policy.eval()
        eps = rollout(backend, tok, [(env, t) for t in tasks], a.group, a.temperature, max_tokens=a.max_tokens,
                      max_turn_tokens=a.max_turn_tokens, seed=a.seed * 1000 + step)
        adv, _ = train_seq.group_advantages(eps)
        t1 = time.perf_counter()
        policy.train()
        train_on(policy, opt, eps, lambda lp, b, x: train_seq.grpo_loss(lp, b, x, a), micro_batch=a.micro_batch,
                 agg=a.agg, grad_clip=a.grad_clip, temperature=a.temperature,
                 extras=dict(adv=[adv.get(i, 0.0) for i in range(len(eps))]))   # flat groups: advantage 0
        t2 = time.perf_counter()
        out.append((t1 - t0, t2 - t1, sum(e.n_sampled for e in eps), max(e.n_sampled for e in eps)))
    return out


def run_trl(path, batches, a):
    """-> [(gen_s, train_s, tokens generated, longest completion)] per update of TRL's GRPOTrainer on the same prompt batches."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=resolve_attn(a.attn))
    rows = [dict(prompt=t.messages, answer=t.gold["answer"], kind=t.gold["kind"]) for b in batches for t in b]
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    gen_s, n_tok, ends = [], [], []

    def math_reward(prompts, completions, completion_ids, answer, kind, **_):
        n_tok.append((sum(map(len, completion_ids)), max(map(len, completion_ids))))
        return [0.0 if not ids or ids[-1] not in eos else grade(c[0]["content"], dict(kind=k, answer=g))
                for c, ids, g, k in zip(completions, completion_ids, answer, kind)]

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            gen_s.append(time.perf_counter() - t0)
            return out

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    accum = a.prompts * a.group // a.micro_batch
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-vs-trl-out-"), max_steps=len(batches), seed=a.seed,
        num_generations=a.group, max_completion_length=a.max_turn_tokens, temperature=a.temperature, top_k=0,
        top_p=1.0, per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=accum,
        steps_per_generation=accum, num_iterations=1, beta=0.0, epsilon=a.clip_low, epsilon_high=a.clip_high,
        loss_type="dapo", scale_rewards="group", learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=a.grad_clip, optim="adamw_torch",
        use_cpu=True, bf16=False, fp16=False, use_vllm=False, gradient_checkpointing=False, shuffle_dataset=False,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = Timed(model=model, reward_funcs=math_reward, args=cfg, train_dataset=Dataset.from_list(rows),
                    processing_class=tok, callbacks=[StepClock()])
    torch.set_num_threads(a.threads)   # in case anything above changed it
    trainer.train()
    totals = [t1 - t0 for t0, t1 in zip(ends, ends[1:])]
    if not (len(totals) == len(gen_s) == len(n_tok) == len(batches)):
        sys.exit(f"error: TRL made {len(totals)} optimizer steps and {len(gen_s)} generations for "
                 f"{len(batches)} updates; the one-generation-per-step setup did not hold")
    return [(g, t - g, *n) for g, t, n in zip(gen_s, totals, n_tok)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="runs/tiny/base", help="HF checkpoint (a random tiny model if absent)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per update")
    p.add_argument("--group", type=int, default=8, help="GRPO group size G (TRL num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="completion token limit")
    p.add_argument("--repeats", type=int, default=3, help="timed updates per side, after one warm-up update")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", default="both", choices=["both", "ours", "trl"],
                   help="run both sides (the comparison), or one alone: ours needs no TRL (the tests' smoke run)")
    b = p.parse_args()
    trl = None
    if b.sides != "ours":
        try:
            import trl
        except ImportError:
            sys.exit("error: TRL is not installed; this benchmark needs it: pip install trl (or --sides ours)")
    torch.set_num_threads(b.threads)
    import transformers
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)   # gradient_checkpointing's rename, in TRL's config
    # train_seq's own resolved flags (tiny preset): micro_batch, gen_batch, lr, clip_low/high, agg, tis_cap, ...
    a = train_seq.get_args(["--prompts", str(b.prompts), "--group", str(b.group), "--max-turn-tokens",
                            str(b.max_new_tokens), "--max-tokens", str(b.max_new_tokens + 1024), "--seed", str(b.seed)])
    train_seq.check_shared_flags(a, ["math"])   # the per-stage flags resolved as train_seq.py resolves them
    train_seq.check_grpo_flags(a, ["math"])
    a = train_seq.stage_args(a, "math")   # the math stage's --lr, --kl-coef, --group and token limits as numbers
    a.prompts, a.threads = b.prompts, b.threads
    a.micro_batch = min(a.micro_batch, b.prompts * b.group)
    if b.group < 2 or b.prompts < 1 or b.repeats < 1 or (b.prompts * b.group) % a.micro_batch:
        sys.exit(f"error: need --group >= 2, --prompts >= 1, --repeats >= 1 and prompts x group divisible by the "
                 f"micro-batch {a.micro_batch}")
    path = checkpoint(b.ckpt, b.seed)
    env = make_env("math")
    train = env.tasks("train", seed=b.seed)
    order = Cursor(len(train), b.seed).take(b.prompts * (1 + b.repeats))
    batches = [[train[j] for j in order[i: i + b.prompts]] for i in range(0, len(order), b.prompts)]
    print(f"trl {trl.__version__ if trl else '-'} | torch {torch.__version__} | {torch.get_num_threads()} thread(s) | "
          f"{path} | {b.prompts} prompts x {b.group} samples, <= {b.max_new_tokens} new tokens, "
          f"micro-batch {a.micro_batch}, lr {a.lr} | 1 warm-up + {b.repeats} timed updates per side")
    results = {}
    sides = {"ours": lambda: run_ours(path, env, batches, a), "TRL": lambda: run_trl(path, batches, a)}
    for side, fn in sides.items():
        if b.sides not in ("both", side.lower()):
            continue
        load = os.getloadavg()[0]
        runs = fn()
        for i, (g, t, n, longest) in enumerate(runs):
            print(f"  {side} update {i}{' (warm-up)' if i == 0 else ''}: gen {g:.2f}s train {t:.2f}s tokens {n} "
                  f"(longest {longest})")
        timed = runs[1:]
        results[side] = [sum(r[k] for r in timed) / len(timed) for k in range(4)] + [load]
    print("\n| side | gen s | train s | total s/update | tokens generated | longest completion | load avg before |\n"
          "|---|---|---|---|---|---|---|")
    for side, (g, t, n, longest, load) in results.items():
        print(f"| {side} | {g:.2f} | {t:.2f} | {g + t:.2f} | {n:.0f} | {longest:.0f} | {load:.2f} |")
    if len(results) < 2:
        return
    ours, theirs = sum(results["ours"][:2]), sum(results["TRL"][:2])
    print(f"\nratio ours/TRL: {ours / theirs:.2f} (target <= 0.7) | gen {results['ours'][0] / results['TRL'][0]:.2f}"
          f" | train {results['ours'][1] / results['TRL'][1]:.2f}")


if __name__ == "__main__":
    main()
