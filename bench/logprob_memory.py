"""Benchmark: what the training step's log-probs hold and launch, the model's logits (token_logprobs(fused=False),
the path before issue 45) beside the fused head (the default: the output head computes the log-probs a chunk at a
time inside the model's forward, so the (B, T, V) logits are never held). One forward + backward of
token_logprobs on --batch episodes of --prompt + --new tokens, a Qwen3 of --hidden x --layers with Qwen3's own
151,936-token vocabulary (the head is what differs), random weights. Per path, in its own process:

    saved for backward   bytes of the distinct tensors autograd keeps between the forward and the backward
                         (torch.autograd.graph.saved_tensors_hooks): the activation memory the path adds
    peak                 CPU: the process's peak resident memory above its size before the step (ru_maxrss);
                         CUDA: torch.cuda.max_memory_allocated above the memory before the step
    ops / kernels        the profiler's count of aten operators (CPU) or CUDA kernel launches (--device cuda)
    seconds              the step's wall time, best of --repeat

    python bench/logprob_memory.py                       # CPU, 8 x (64 + 256) tokens, hidden 128 (~2 min)
    python bench/logprob_memory.py --device cuda --batch 8 --new 2048 --hidden 2048 --layers 4
    python bench/logprob_memory.py --smoke               # seconds: the test's run
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def build(a):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=a.hidden // 4, intermediate_size=3 * a.hidden,
                      tie_word_embeddings=False, max_position_embeddings=4096, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(a.device).train()


def batch(a):
    from acl.step import pack
    from envs.rollout import Episode
    g = torch.Generator().manual_seed(1)
    eps = []
    for k in range(a.batch):
        ids = torch.randint(2, a.vocab, (a.prompt + a.new,), generator=g).tolist()
        eps.append(Episode("t", "math", "train", k, ids, [0] * a.prompt + [1] * a.new, [0.0] * len(ids), a.prompt))
    return {k: v.to(a.device) for k, v in pack(eps, 0).items()}


def one_path(a) -> dict:
    """Measure one path in this process (the parent runs each path in a fresh one, so the peaks do not mix)."""
    from acl.step import token_logprobs
    torch.set_num_threads(a.threads)
    model, b = build(a), batch(a)
    cuda = a.device.startswith("cuda")

    def step():
        model.zero_grad(set_to_none=True)
        lp = token_logprobs(model, b, fused=a.path == "fused", chunk_tokens=a.chunk_tokens)
        (lp * b["mask"]).sum().backward()

    saved = {}

    def pack_hook(t):
        saved[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        step()
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_now()
    times = []
    for _ in range(a.repeat):
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - before
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        ops = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        ops = sum(1 for e in events if e.name.startswith("aten::"))
    return dict(path=a.path, saved_mib=sum(saved.values()) / 2**20, peak_mib=max(0, peak) / 2**20, ops=ops,
                seconds=min(times))


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk of logits (training's default: "
                   "4,096, for 8B micro-batches of 32,768 tokens; a toy batch needs smaller chunks to show the chunking)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a few seconds: 2 x (8 + 16) tokens in chunks of 8, "
                   "vocabulary 4,096")
    p.add_argument("--path", choices=["logits", "fused"], help=argparse.SUPPRESS)   # the child's
    a = p.parse_args()
    if a.smoke:
        a.batch, a.prompt, a.new, a.hidden, a.vocab, a.repeat, a.chunk_tokens = 2, 8, 16, 32, 4096, 1, 8
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    if a.path:
        print(json.dumps(one_path(a)))
        return
    rows = []
    for path in ("logits", "fused"):
        args = [sys.executable, os.path.abspath(__file__), "--path", path] + sys.argv[1:]
        out = subprocess.run(args, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"the {path} path failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits = a.batch * a.new * a.vocab
    print(f"token_logprobs forward + backward, {a.batch} x ({a.prompt} + {a.new}) tokens, hidden {a.hidden} x "
          f"{a.layers} layers, vocabulary {a.vocab:,} ({logits * 4 / 2**20:.0f} MiB of fp32 logits), chunks of "
          f"{a.chunk_tokens} tokens, {a.device}")
    kind = "CUDA kernels" if a.device.startswith("cuda") else "aten ops"
    print(f"| path | saved for backward | peak above start | {kind} | seconds |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['saved_mib']:.2f} MiB | {r['peak_mib']:.1f} MiB | {r['ops']} | {r['seconds']:.2f} |")
    lo, fu = rows
    print(f"fused / logits: saved {fu['saved_mib'] / max(lo['saved_mib'], 1e-9):.2f}x, peak "
          f"{fu['peak_mib'] / max(lo['peak_mib'], 1e-9):.2f}x, {kind} {fu['ops'] / max(lo['ops'], 1):.2f}x, time "
          f"{fu['seconds'] / lo['seconds']:.2f}x")


if __name__ == "__main__":
    main()
