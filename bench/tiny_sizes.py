"""Benchmark: what a bigger tiny model costs on this CPU, the first lever of a stronger tiny arena. The Qwen3
architecture (the 8B code path) at about 1, 3, 6 and 12 M parameters with the tiny tokenizer's 1,024-token
vocabulary: decoding tokens/s through the project's own hf engine (acl.engine.HFBackend.generate: --batch
sequences, --prompt prompt tokens, --new sampled tokens each, no stop), and training tokens/s (forward, backward and
an AdamW step on --batch sequences of prompt + new tokens, the loss on every token), each size beside the 1 M model
(today's tiny base, SIZES["tiny"]) as the peer. Random weights: speed does not depend on what a model knows.

    python bench/tiny_sizes.py                               # the four sizes at 2 threads (~2 min)
    python bench/tiny_sizes.py --threads 1 --sizes 1m,3m     # as one lane of arena.sh runs
    python bench/tiny_sizes.py --smoke                       # seconds: the test's run

Each figure is the best of --repeat timed runs after one warm-up (the least disturbed by other processes); run it on
a quiet machine.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# hidden, layers, heads (kv heads 1, head_dim 32 as the tiny base), MLP width: ~1, 3, 6 and 12 M parameters with the
# 1,024-token vocabulary (tied embeddings); "1m" is the committed tiny base's shape
SHAPES = {"1m": (160, 3, 5, 512), "3m": (256, 4, 8, 768), "6m": (320, 5, 10, 896), "12m": (448, 6, 14, 1024)}


def build(shape, vocab: int = 1024):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    h, layers, heads, inter = shape
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=1, head_dim=32, intermediate_size=inter, tie_word_embeddings=True,
                      max_position_embeddings=2048, rope_theta=10000.0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def best(fn, repeat: int) -> float:
    fn()   # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def decode_rate(model, batch: int, prompt: int, new: int, repeat: int) -> float:
    from types import SimpleNamespace

    from acl.engine import HFBackend
    model.eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, model.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]
    engine = HFBackend(model, SimpleNamespace(pad_token_id=0), max_batch=batch, reuse_kv=False)
    seconds = best(lambda: engine.generate(prompts, new, 1.0, stop_ids=[]), repeat)
    return batch * new / seconds


def train_rate(model, batch: int, seq: int, repeat: int) -> float:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(2, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(2))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return batch * seq / best(step, repeat)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--batch", type=int, default=64, help="sequences per decode batch and per training step")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=64, help="sampled tokens per sequence")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per figure (the best is kept)")
    p.add_argument("--smoke", action="store_true", help="two sizes at toy batch and length, one timed run each")
    a = p.parse_args(argv)
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SHAPES]
    if bad or a.threads < 1 or min(a.batch, a.prompt, a.new, a.repeat) < 1:
        sys.exit(f"error: unknown size {bad[0]!r} (of {', '.join(SHAPES)})" if bad else
                 "error: need --threads, --batch, --prompt, --new, --repeat >= 1")
    if a.smoke:
        sizes, a.batch, a.prompt, a.new, a.repeat = sizes[:2], 4, 16, 8, 1
    torch.set_num_threads(a.threads)
    print(f"tiny sizes on {os.cpu_count()} cores, {a.threads} thread(s): decode {a.batch} x ({a.prompt} prompt + "
          f"{a.new} sampled) tokens; train {a.batch} x {a.prompt + a.new} tokens per AdamW step; best of {a.repeat}")
    rows = []
    for s in sizes:
        model = build(SHAPES[s])
        n = sum(t.numel() for t in model.parameters())
        dec = decode_rate(model, a.batch, a.prompt, a.new, a.repeat)
        trn = train_rate(model, a.batch, a.prompt + a.new, a.repeat)
        rows.append((s, n, dec, trn))
        print(f"  {s}: {n / 1e6:.2f} M parameters, decode {dec:,.0f} tokens/s, train {trn:,.0f} tokens/s", flush=True)
    peer = rows[0]
    print(f"\n| size | parameters | decode tokens/s | train tokens/s | decode ÷ {peer[0]} | train ÷ {peer[0]} |")
    print("|---|---|---|---|---|---|")
    for s, n, dec, trn in rows:
        print(f"| {s} | {n / 1e6:.2f} M | {dec:,.0f} | {trn:,.0f} | {dec / peer[2]:.2f} | {trn / peer[3]:.2f} |")


if __name__ == "__main__":
    main()
