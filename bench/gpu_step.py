"""GPU figures for the full-scale recipe, with no download: a randomly initialised model with the Qwen3-1.7B
configuration, (1) the training-step throughput of train_seq.py's GRPO update (acl.step.train_on with
grpo_loss, under FSDP2 with bf16 MixedPrecisionPolicy) in tokens/s and MFU, and (2) the hf backend's
generation throughput (acl.engine.HFBackend, bf16: eager, then its decode steps as CUDA graphs), with --lora R
(3) the same update on mle.py's expert (the model frozen, a rank-R adapter trained) beside full fine-tuning, and
with --compile (4) the same update with the norms and SwiGLU compiled (--compile) beside the eager one. Run through
bench/gpu.sh on one H200 (under 8 minutes):

    bash bench/gpu.sh                                             # torchrun --nproc_per_node=1 bench/gpu_step.py
    torchrun --standalone --nproc_per_node=1 bench/gpu_step.py --micro-batch 8 --prompt-len 512 --completion-len 1536
    python bench/gpu_step.py --smoke                              # the same code on a micro model on the CPU (tests)
    torchrun --standalone --nproc_per_node=1 bench/gpu_step.py --config Qwen/Qwen3-8B-Base --layers 3 --vs-dry-run \
        --micro-batch 1 --completion-len 3584 --steps 1    # 8B width, 3 layers: the measured peak beside --dry-run's

--vs-dry-run prints acl.scale.dry_run's estimate of the training memory (one rank, this config, micro-batch and length)
beside the peak the update really allocated: at the 8B width with a few layers (--layers) it tests, on one GPU, the
per-layer and root terms that the README's 8B memory table extrapolates to 36 layers and many ranks.

MFU counts the model FLOPs of the tokens the update really processes, PaLM-style (Chowdhery et al. 2022,
appendix B): 6 N + 12 L H T FLOPs per token for forward + backward, N the parameters that do matmuls (every
linear layer and the output head; the embedding lookup is not a matmul), L layers, H = heads x head_dim, T the
sequence length (attention's causal half is not discounted, as in PaLM). Recomputation under activation
checkpointing is not counted (it is overhead, not model FLOPs), nor padding (the tokens are the episodes' own).
Peak: 989 TFLOP/s nominal (H100/H200 bf16 dense), printed beside the bf16 matmul rate measured on the GPU.
Each distinct prompt runs once per micro-batch and its KV cache is shared by its samples (train_seq's
token_logprobs), so the prompt's tokens are counted once per group, the completions once per sample.
"""
import argparse
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from acl.common import checkpoint_activations, init_dist, print0, resolve_attn, shard, teardown  # noqa: E402
from acl.scale import KNOWN_CONFIGS  # noqa: E402
from acl.step import micro_batches, train_on  # noqa: E402

PEAK_TFLOPS = 989.0   # H100/H200 SXM, bf16 dense


def model_flops_per_token(cfg, seq_len: int) -> float:
    h, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv, i = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    n_matmul = L * (h * q + 2 * h * kv + q * h + 3 * h * i) + V * h   # attention + MLP projections, output head
    return 6 * n_matmul + 12 * L * q * seq_len


def matmul_peak(device, n: int = 8192, reps: int = 20) -> float | None:
    """The bf16 dense matmul TFLOP/s this GPU really reaches (n x n x n, after a warm-up): the ceiling MFU is read
    against beside the nominal one; None on the CPU."""
    if device.type != "cuda":
        return None
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(reps):
        x @ y
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.time() - t0) / 1e12


def episodes(n_prompts, group, prompt_len, completion_len, vocab, seed=0):
    """Synthetic GRPO batch: random prompts, each with `group` random completions, every completion token
    sampled (mask 1), sampling log-probs near the trainer's, random group-normalised advantages."""
    from envs.rollout import Episode
    g = torch.Generator().manual_seed(seed)
    eps, adv = [], []
    for p in range(n_prompts):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        a = torch.randn(group, generator=g)
        a = (a - a.mean()) / (a.std() + 1e-6)
        for k in range(group):
            comp = torch.randint(3, vocab, (completion_len,), generator=g).tolist()
            eps.append(Episode(f"p{p}", "math", "train", k, prompt + comp, [0] * prompt_len + [1] * completion_len,
                               [0.0] * prompt_len + [-12.0] * completion_len, prompt_len))
            adv.append(a[k].item())
    return eps, adv


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="Qwen/Qwen3-1.7B", help=f"architecture: one of {', '.join(sorted(KNOWN_CONFIGS))}, "
                   "or a local checkpoint directory (its config.json; e.g. runs/tiny/base for CPU figures)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per update")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--completion-len", type=int, default=1536)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing (recompute is not counted)")
    p.add_argument("--steps", type=int, default=5, help="timed updates (after one warm-up)")
    p.add_argument("--gen-batch", type=int, default=64, help="generation: sequences")
    p.add_argument("--gen-prompt-len", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=256, help="generation: new tokens per sequence")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="also time the same update on mle.py's expert: "
                   "the model frozen, a LoRA adapter of this rank on every projection trained (printed beside)")
    p.add_argument("--compile", action="store_true", help="also time the same update with the norms and SwiGLU "
                   "compiled (--compile: acl/compiled.py), printed beside the eager one")
    p.add_argument("--profile", action="store_true", help="also count, with torch.profiler, the kernels one update "
                   "launches (CUDA kernels on a GPU, aten ops on a CPU) for each update timed")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's): the config's "
                   "width with a few layers, for --vs-dry-run at 8B width on one GPU")
    p.add_argument("--vs-dry-run", action="store_true", help="also print --dry-run's estimate of the training memory "
                   "for this model, micro-batch and length beside the measured peak")
    p.add_argument("--smoke", action="store_true", help="a micro model and tiny sizes on the CPU (for tests)")
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, Qwen3Config

    import train_seq
    from acl.engine import HFBackend
    if a.config not in KNOWN_CONFIGS and not os.path.isfile(os.path.join(a.config, "config.json")):
        p.error(f"--config {a.config}: not one of {', '.join(sorted(KNOWN_CONFIGS))} nor a checkpoint directory")
    known = KNOWN_CONFIGS.get(a.config) or Qwen3Config.from_pretrained(a.config).to_dict()
    cfg = Qwen3Config(**known)
    if a.smoke:
        cfg = Qwen3Config(**dict(known, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512))
        a.prompts, a.group, a.prompt_len, a.completion_len, a.micro_batch, a.steps = 2, 2, 16, 24, 2, 1
        a.gen_batch, a.gen_prompt_len, a.gen_tokens = 4, 8, 8
    if a.layers is not None:
        if a.layers < 1:
            p.error(f"--layers must be >= 1, got {a.layers}")
        cfg = Qwen3Config(**dict(cfg.to_dict(), num_hidden_layers=a.layers, layer_types=None))   # types re-derived
    estimate = None
    if a.vs_dry_run:   # before init_dist: the dry run builds the model on the meta device under its own fake group
        from acl.scale import dry_run
        est_args = SimpleNamespace(bf16=torch.cuda.is_available(), cpu_offload=False, grad_ckpt=a.grad_ckpt,
                                   micro_tokens=None, attn="auto", backend="none", vllm_gpu_util=0.0)
        estimate = dry_run(est_args, a.config, 1, a.micro_batch, a.prompt_len + a.completion_len, cfg=cfg)["total"]
    device = init_dist(bf16=torch.cuda.is_available())   # one GPU without torchrun: a one-rank group, bf16 as under it
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    attn = resolve_attn("auto")
    def build(lora_rank=0, compiled=False):
        torch.manual_seed(0)
        with torch.device(device):
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
        if a.grad_ckpt:
            checkpoint_activations(m)
        if lora_rank:
            import mle
            m = mle.with_adapter(m, SimpleNamespace(lora_rank=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                                    lora_targets=list(mle.TARGETS)))
        m = shard(m, bf16=cuda, cpu_offload=False, compiled=compiled)
        return m, torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=1e-6, betas=(0.9, 0.999),
                                    weight_decay=0.0)
    gpu_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    measured = matmul_peak(device)   # before any model: the GPU's memory is free
    with torch.device("meta"):
        n_params = sum(t.numel() for t in AutoModelForCausalLM.from_config(cfg).parameters())
    run = train_seq.get_args(["--preset", "qwen3-8b", "--micro-batch", str(a.micro_batch), "--curriculum", "math",
                              "--world-size", "1", "--dry-run"])   # (--dry-run: resolve the flags, load nothing)
    flags = train_seq.stage_args(train_seq.check_args(run), "math")
    eps, adv = episodes(a.prompts, a.group, a.prompt_len, a.completion_len, cfg.vocab_size)
    seq = a.prompt_len + a.completion_len
    per_micro_prompts = sum(len({e.task_id for e in [eps[i] for i in idx]})
                            for idx in micro_batches(eps, a.micro_batch))
    tokens = len(eps) * a.completion_len + (len(eps) if a.grad_ckpt else per_micro_prompts) * a.prompt_len
    flops = tokens * model_flops_per_token(cfg, seq)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    failed = []   # each measurement that raised (out of memory, a compiler error): its row says so, the rest still run

    def attempt(what, fn):
        """fn() -> its value, or None with `what` in `failed` and the error as the row's value (the table goes on)."""
        try:
            return fn()
        except Exception as e:
            failed.append(what)
            print0(f"| {what} | failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''} |")
            return None
        finally:
            if cuda:
                torch.cuda.empty_cache()

    # each row is printed as soon as it is measured: a run cut short by a timeout keeps what it measured
    print0(f"bench/gpu_step.py on {gpu_name}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, attention {attn}, "
           f"{a.config} config{f' at {a.layers} layers' if a.layers else ''} ({n_params / 1e9:.2f}B parameters"
           f"{', micro smoke' if a.smoke else ''}), random init")
    print0("| measure | value |\n|---|---|")

    # ---- the training step: one GRPO update on the batch, timed after a warm-up -> (seconds, loss, peak GiB)
    launches = {}   # --profile: update -> kernels launched (CUDA kernels; on a CPU, aten ops) by one update

    def timed(lora_rank=0, compiled=False, name="eager"):
        model, opt = build(lora_rank, compiled)
        n_trained = sum(q.numel() for q in model.parameters() if q.requires_grad)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model.train()
        times = []
        update = lambda: train_on(model, opt, eps, lambda lp, b, x: train_seq.grpo_loss(lp, b, x, flags),  # noqa: E731
                                  micro_batch=flags.micro_batch, agg=flags.agg, grad_clip=flags.grad_clip,
                                  extras=dict(adv=adv))
        for s in range(1 + a.steps):
            sync()
            t0 = time.time()
            loss, _ = update()
            sync()
            if s:
                times.append(time.time() - t0)
        if a.profile:   # one more update, after the timed ones
            from torch.autograd import DeviceType
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                update()
                sync()
            launches[name] = sum(1 for e in prof.events() if (e.device_type == DeviceType.CUDA if cuda else
                                                              e.name.startswith("aten::")))
        mem = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30) if cuda \
            else (float("nan"),) * 2
        return sum(times) / len(times), loss, mem, n_trained
    update_name = (f"GRPO update: {len(eps)} sequences of {a.prompt_len}+{a.completion_len} tokens, micro-batch "
                   f"{a.micro_batch}, grad ckpt {a.grad_ckpt}")
    eager = attempt(update_name, timed)
    if eager:
        dt, loss, peak_mem, _ = eager
        tflops = flops / dt / 1e12
        print0(f"| {update_name} | {dt:.2f} s (loss {loss:+.4f}) |")
        print0(f"| training tokens/s | {tokens / dt:,.0f} |")
        print0(f"| model TFLOP/s | {tflops:.1f} |")
        print0(f"| MFU (vs {PEAK_TFLOPS:.0f} TFLOP/s nominal bf16 dense) | {100 * tflops / PEAK_TFLOPS:.1f}% "
               "(target >= 35%) |")
        if measured:
            print0(f"| bf16 matmul 8192^3 measured here; MFU against it | {measured:.0f} TFLOP/s; "
                   f"{100 * tflops / measured:.1f}% |")
        print0(f"| peak GPU memory, training: allocated, reserved | {peak_mem[0]:.1f} GiB, {peak_mem[1]:.1f} GiB |")
        if estimate is not None:
            print0(f"| training memory: --dry-run's estimate, measured allocated ÷ it | {estimate / 2**30:.1f} GiB, "
                   f"{peak_mem[0] * 2**30 / estimate:.2f} |")
    vs_eager = lambda t: f"{eager[0] / t:.2f}x" if eager else "eager failed"  # noqa: E731
    compile_name = "same update, norms and SwiGLU compiled (--compile): tokens/s, x eager, MFU, peak memory"
    if a.compile and (r := attempt(compile_name, lambda: timed(compiled=True, name="compiled"))):
        print0(f"| {compile_name} | {tokens / r[0]:,.0f} ({vs_eager(r[0])} eager; loss {r[1]:+.4f}), "
               f"{100 * flops / r[0] / 1e12 / PEAK_TFLOPS:.1f}%, {r[2][0]:.1f} GiB |")
    # the same update on the expert (MFU is not comparable: the frozen weights get no gradient)
    lora_name = f"LoRA rank {a.lora} expert, same update: tokens/s, x full, peak memory"
    if a.lora and (r := attempt(lora_name, lambda: timed(a.lora, name=f"LoRA rank {a.lora}"))):
        print0(f"| LoRA rank {a.lora} expert ({r[3] / 1e6:.1f}M trainable), same update: tokens/s, x full, peak "
               f"memory | {tokens / r[0]:,.0f} ({vs_eager(r[0])} full fine-tuning), {r[2][0]:.1f} GiB |")
    if a.profile:
        print0(f"| {'CUDA kernels' if cuda else 'aten ops'} launched by one update (torch.profiler) | "
               f"{', '.join(f'{k} {v:,}' for k, v in launches.items())} |")

    # ---- generation: the hf backend on a bf16 copy (what an FSDP2 rank samples with under --backend hf)
    with torch.device(device):
        engine = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32,
                                                  attn_implementation=attn).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (a.gen_prompt_len,), generator=g).tolist() for _ in range(a.gen_batch)]

    def gen_rate(graphs):   # eager decode steps, or each step replayed as a CUDA graph (GraphDecode)
        backend = HFBackend(engine, SimpleNamespace(pad_token_id=0), max_batch=a.gen_batch, graphs=graphs)  # token ids
        backend.generate(prompts[:2], 4, 1.0, [])   # warm-up (the batch's own graph is captured inside the timing)
        sync()
        t0 = time.time()
        gens = backend.generate(prompts, a.gen_tokens, 1.0, [])   # no stop token: every row runs to the limit
        sync()
        return sum(len(x.token_ids) for x in gens) / (time.time() - t0)
    gen_name = f"hf generation: {a.gen_batch} x ({a.gen_prompt_len} prompt + {a.gen_tokens} new) tokens/s, eager"
    if (plain := attempt(gen_name, lambda: gen_rate(False))):
        print0(f"| {gen_name} | {plain:,.0f} |")
    graph_name = "same, decode steps as CUDA graphs (ACL_CUDA_GRAPHS=1; on a CPU the static step, eager)"
    if (graphed := attempt(graph_name, lambda: gen_rate(True))):
        print0(f"| {graph_name} | {graphed:,.0f} ({f'{graphed / plain:.2f}x' if plain else 'eager failed'} eager; "
               "target >= 4x the 882 of 2026-12-04) |")
    if failed:
        print0(f"bench/gpu_step.py: FAILED: {'; '.join(failed)}")
    status = 1 if failed else 0
    teardown(status)   # under a process group the process ends here, with this status
    sys.exit(status)


if __name__ == "__main__":
    main()
