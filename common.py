"""Plumbing shared by every script, and nothing else: torchrun init/teardown, FSDP2 wrapping, gathering
a full state dict on rank 0, checkpoints written atomically with their acl_meta.json, seeding, print0;
for the training scripts: loading a policy, its rollout backend and the weight push into it, collectives,
and the prompt cursor.

Under torchrun (WORLD_SIZE set) init_dist() starts NCCL on GPUs and gloo on CPUs; without it, it is a
single process and every collective below is a no-op.
"""
import argparse
import json
import math
import os
import random
import shutil
import subprocess
import time

import numpy as np
import torch


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def sharded() -> bool:
    """True when a process group is up, so models are FSDP2-sharded (under torchrun, even with one rank:
    that is how one GPU gets FSDP2's bf16 MixedPrecisionPolicy)."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def init_dist():
    """-> torch.device for this rank. Starts the process group under torchrun (NCCL on GPU, gloo on CPU)."""
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device


def teardown(exit_now: bool = True):
    """Barrier, then destroy the process group (gloo aborts at exit without the barrier). Under torchrun
    the process then exits at once (status 0): on CPU, gloo's worker threads can still abort a finished
    rank during interpreter shutdown ("terminate called without an active exception", about 1 run in 4
    after an FSDP2 update), which would fail a run whose work is all done and saved."""
    import sys

    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        if exit_now:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def shard(model, bf16: bool = False, cpu_offload: bool = False):
    """FSDP2: fully_shard every decoder layer, then the root. With bf16, parameters are cast to bf16 for
    compute and gradients reduced in fp32 (MixedPrecisionPolicy); cpu_offload keeps shards on the CPU.
    A no-op without a process group, so the same training loop runs unsharded on a laptop."""
    if not sharded():
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def full_state_dict(model) -> dict:
    """The whole model's state dict on rank 0 (on the CPU), {} on other ranks; plain state_dict() when
    unsharded. Every rank must call it: the gather is a collective."""
    if not sharded():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_params(model):
    """Yield (name, full tensor) for every parameter, one at a time: under FSDP2 each is all-gathered as it
    is yielded (every rank must iterate in step), so weights can be pushed to a generation engine without
    ever holding a whole unsharded model beside the shards."""
    for name, p in model.named_parameters():
        yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor over ranks (a copy); the tensor itself when not distributed."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return x
    x = x.detach().clone()
    dist.all_reduce(x)
    return x


def save_train_state(path: str, model, opt, extra: dict):
    """Everything needed to resume training beside the checkpoint: the model and optimizer state (full,
    gathered to rank 0 under FSDP2), the RNG states and `extra` (step, data cursor, ...). Atomic: written
    to a temporary file, then renamed. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=opts)
    if rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        state = dict(model=msd, optim=osd, extra=extra, torch_rng=torch.get_rng_state(),
                     py_rng=random.getstate(), np_rng=np.random.get_state())
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)


def load_train_state(path: str, model, opt) -> dict:
    """Restore what save_train_state wrote into `model` and `opt` (broadcast from rank 0 under FSDP2);
    returns `extra`. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    state = torch.load(path, map_location="cpu", weights_only=False)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=sharded())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts)
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
    np.random.set_state(state["np_rng"])
    return state["extra"]


def all_reduce_mean(x: float) -> float:
    """Mean of a Python float over ranks (for logging: loss, reward)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def all_reduce_max(x: float) -> float:
    """Max of a Python float over ranks."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return x
    t = torch.tensor([float(x)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather_mean(values) -> float:
    """Mean of a list of floats over all ranks' lists."""
    s = all_reduce_sum(torch.tensor([float(sum(values)), float(len(values))], dtype=torch.float64))
    return (s[0] / s[1].clamp(min=1)).item()


def print0(*args, **kwargs):
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def code_revision() -> str:
    """The git commit of this code (with '+dirty' when the tree has changes), or 'unknown'."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_atomically(out_dir: str, write) -> str:
    """Call write(tmp) on a temporary sibling directory, then rename it to out_dir: a half-written checkpoint
    never exists under its final name, and an existing one is replaced only after the new one is whole."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out_dir)}-{os.getpid()}-{int(time.time() * 1000)}")
    os.makedirs(tmp)
    try:
        write(tmp)
        old = None
        if os.path.exists(out_dir):
            old = tmp + ".old"
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def write_meta(ckpt_dir: str, meta: dict):
    """acl_meta.json of a checkpoint being written, stamped with the code revision and the time."""
    meta = dict(meta, code_revision=code_revision(), saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    with open(os.path.join(ckpt_dir, "acl_meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True, default=str)


def save_checkpoint(out_dir: str, model, tokenizer, meta: dict, state_dict: dict | None = None):
    """Write a Hugging Face checkpoint (safetensors + config + tokenizer) plus acl_meta.json, atomically
    (write_atomically). For a sharded model pass state_dict=full_state_dict(model) and call this on rank 0 only."""
    def write(tmp):
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_meta(tmp, meta)
    return write_atomically(out_dir, write)


def read_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, "acl_meta.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- shared by the training scripts

def to_device(b: dict, dev) -> dict:
    return {k: v.to(dev) for k, v in b.items()}


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


def resolve_attn(attn: str) -> str:
    """--attn auto: flash_attention_2 where flash-attn is installed and a GPU is there, sdpa otherwise."""
    if attn != "auto":
        return attn
    import importlib.util
    return "flash_attention_2" if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") else "sdpa"


def checkpoint_activations(model):
    """Activation checkpointing, non-reentrant (the only kind that composes with FSDP2's hooks), through
    whichever name this transformers has (activation_checkpointing_enable from 5.2x, gradient_... before)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def checkpoints_activations(model) -> bool:
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def load_policy(path: str, device, attn: str = "sdpa", grad_ckpt: bool = False, dtype=torch.float32):
    """(model, tokenizer) from a HF checkpoint, fp32 master weights by default (FSDP2's MixedPrecisionPolicy
    casts for compute)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=resolve_attn(attn))
    model = model.to(device)
    if grad_ckpt:
        checkpoint_activations(model)
    return model, tok


def selected_logprobs(logits, targets, temperature: float = 1.0, chunk_tokens: int = 4096):
    """log softmax(logits / temperature) at the targets: (B, T, V), (B, T) -> (B, T). Computed a time chunk of
    about chunk_tokens tokens at a time, each chunk checkpointed: its float32 copy, log-softmax and gradient
    are rebuilt in the backward pass instead of kept, so the logits are held once, at their own dtype (about
    2 bytes per vocabulary entry under bf16, and their gradient, instead of ~10 bytes; for 4 x 8192 tokens of
    Qwen3-8B, 46 -> 24 GiB per rank).
    Values and gradients equal the one-piece computation up to float rounding (tested)."""
    def piece(x, y):
        x = x.float()
        if temperature > 0 and temperature != 1.0:
            x = x / temperature
        return -torch.nn.functional.cross_entropy(x.transpose(1, 2), y, reduction="none")
    step = max(1, chunk_tokens // max(1, logits.size(0)))
    if logits.size(1) <= step:
        return piece(logits, targets)
    from torch.utils.checkpoint import checkpoint
    out = []
    for s in range(0, logits.size(1), step):
        x, y = logits[:, s: s + step], targets[:, s: s + step]
        out.append(checkpoint(piece, x, y, use_reentrant=False) if x.requires_grad else piece(x, y))
    return torch.cat(out, 1)


def add_scale_flags(p, preset: dict):
    """The flags of the engine and the sharding (make_backend, shard, dry_run below), shared by the training
    scripts; `preset` gives the defaults of backend, gen_batch, bf16 and grad_ckpt."""
    p.add_argument("--backend", default=preset["backend"], choices=["hf", "vllm"],
                   help="rollout engine: hf (transformers) or vllm (colocated, pip install -r requirements-gpu.txt)")
    p.add_argument("--gen-batch", type=int, default=preset["gen_batch"], help="sequences per generate call")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=preset["bf16"],
                   help="bf16 compute under FSDP2 (MixedPrecisionPolicy)")
    p.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction, default=preset["grad_ckpt"],
                   help="activation checkpointing")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload of parameters")
    p.add_argument("--attn", default="auto", help="attention implementation: auto (flash_attention_2 where "
                                                 "flash-attn is installed, else sdpa), sdpa, flash_attention_2, eager")
    p.add_argument("--vllm-gpu-util", type=float, default=0.5, help="vllm backend: share of GPU memory for the "
                                                                    "engine (weights + KV cache) while it generates")
    p.add_argument("--dry-run", action="store_true", help="build the model on the meta device, apply the FSDP2 "
                   "plan for --world-size ranks, print parameters and memory per rank and the config; no download")
    p.add_argument("--world-size", type=int, default=None, help="ranks assumed by --dry-run (default $WORLD_SIZE or 8)")


def make_backend(a, policy, tok, path, device):
    """(backend, engine_model): what rollouts are sampled with. --backend vllm: a colocated vLLM engine
    (engine_model None). Single process + hf: the policy itself.
    Under FSDP2 + hf: an unsharded copy on each rank (bf16 with --bf16), refreshed by push_weights after
    every update."""
    if a.backend == "vllm":
        # one colocated engine per rank for the whole run (vLLM holds one per process): built from the first
        # checkpoint, then given each later stage's starting weights by a push, like after an update
        from envs.rollout import shared_vllm
        engine, started = shared_vllm(path, tok, dtype="bfloat16" if a.bf16 else "float32", gpu_util=a.vllm_gpu_util,
                                      max_model_len=a.max_tokens, seed=a.seed + rank(), max_batch=a.gen_batch)
        if started:
            print0(f"vllm backend: {engine.support}")
        else:
            engine.load_weights(full_params(policy))
        return engine, None
    from envs.rollout import HFBackend
    if not sharded():
        return HFBackend(policy, tok, a.gen_batch), policy
    engine, _ = load_policy(path, device, a.attn, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    return HFBackend(engine.eval(), tok, a.gen_batch), engine


def push_weights(backend, policy):
    """After an update: gather the policy's parameters one at a time and copy them into the engine
    (a no-op when the engine is the policy itself)."""
    if getattr(backend, "model", None) is not policy:
        backend.load_weights(full_params(policy))


# ----------------------------------------------------------------------------- --dry-run: a launch checked on paper
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


def model_config(init: str):
    """The transformers config of --init without downloading: its config.json if it is a local directory,
    the built-in copy for a model KNOWN_CONFIGS names, else the local hub cache (or a ValueError)."""
    from transformers import AutoConfig, Qwen3Config
    if os.path.isfile(os.path.join(init, "config.json")):
        return AutoConfig.from_pretrained(init)
    if init in KNOWN_CONFIGS:
        return Qwen3Config(**KNOWN_CONFIGS[init])
    try:
        return AutoConfig.from_pretrained(init, local_files_only=True)
    except OSError:
        raise ValueError(f"no config for {init}: not a local checkpoint, not cached, not one of "
                         f"{', '.join(KNOWN_CONFIGS)}") from None


def shard_rows(n: int, world: int, r: int) -> int:
    """Rows of a dim-0 size n that FSDP2 puts on rank r: torch.chunk's split (ceil(n / world) per rank,
    the last ranks short or empty)."""
    per = -(-n // world)
    return max(0, min(per, n - r * per))


def dry_run(a, world: int, micro_batch: int, seq_len: int, gpu_gb: float = 141.0):
    """Build --init's architecture on the meta device (no weights, no download), apply shard()'s FSDP2 plan
    under a fake process group of `world` ranks, and print the parameters per rank, an estimate of the
    memory per rank and the resolved configuration. Returns the figures (tests read them).

    Memory per rank, in bytes, P_r = this rank's parameters (FSDP2 shards every tensor on dim 0):
      fp32 master weights 4 P_r + fp32 gradients 4 P_r + AdamW moments 8 P_r (on the host with --cpu-offload);
      the all-gathered unit: the root (embeddings, lm_head, final norm; gathered for the whole step) plus two
      decoder layers (the one computing and the one prefetched), at the compute dtype, plus the largest unit's
      unsharded fp32 gradient before its reduce-scatter;
      activations: with activation checkpointing each layer keeps its input (h per token) and one layer is
      recomputed at a time; without it every layer keeps the inputs of its matmuls and norms,
      4h + 3q + 2kv + 4i values per token (q = heads x head_dim, kv = kv_heads x head_dim, i = intermediate);
      logits: micro_batch x seq_len x vocab at the compute dtype, and their gradient; the float32 log-softmax
      runs 4,096 tokens at a time and is recomputed in backward (selected_logprobs);
      the frozen reference model (--kl-coef > 0): its fp32 shard, 4 P_r;
      the hf backend under FSDP2: one unsharded copy of the policy at the compute dtype.
    vLLM's colocated engine is asleep while training (its weights offloaded, its KV cache freed) and takes
    --vllm-gpu-util of the GPU while generating, so it is listed apart."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    from transformers import AutoModelForCausalLM
    cfg = model_config(a.init)
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
    tokens = micro_batch * seq_len
    per_layer_acts = (4 * h + 3 * q + 2 * kv + 4 * i) * cb * tokens
    acts = (L * h * cb * tokens + per_layer_acts) if a.grad_ckpt else L * per_layer_acts
    states = 16 * P_r
    mem = {
        "weights+grads+adam (fp32, sharded)": 0 if a.cpu_offload else states,
        "gathered params (root + 2 layers)": (root + 2 * layer) * cb + max(root, layer) * 4,
        "activations": acts,
        "logits (+ grad; fp32 work chunked)": tokens * V * 2 * cb + min(tokens, 4096) * V * 10,
        "reference model (--kl-coef)": 4 * P_r if a.kl_coef > 0 else 0,
        "hf engine (unsharded copy)": n_total * cb if getattr(a, "backend", "hf") == "hf" and world > 1 else 0,
    }
    gb = lambda x: x / 2**30
    total = sum(mem.values())
    print(f"dry run: {a.init} ({cfg.model_type}, {n_total / 1e9:.3f}B parameters) on {world} ranks, FSDP2 plan: "
          f"each of {L} decoder layers, then the root; bf16 compute {a.bf16}, activation checkpointing "
          f"{a.grad_ckpt}, cpu offload {a.cpu_offload}, attention {resolve_attn(a.attn)}")
    print(f"parameters per rank: max {P_r / 1e6:.1f}M, min {min(per_rank) / 1e6:.1f}M "
          f"(one layer {layer / 1e6:.1f}M, root {root / 1e6:.1f}M)")
    print(f"estimated GPU memory per rank, micro-batch {micro_batch} x {seq_len} tokens:")
    for k, v in mem.items():
        print(f"  {k:<38} {gb(v):8.2f} GiB")
    if a.cpu_offload:
        print(f"  {'(host) weights+grads+adam, offloaded':<38} {gb(states):8.2f} GiB")
    vllm = getattr(a, "vllm_gpu_util", 0.0) * gpu_gb * 2**30 if getattr(a, "backend", "hf") == "vllm" else 0.0
    print(f"  {'training total':<38} {gb(total):8.2f} GiB")
    generating = 0.0
    if vllm:   # while vLLM generates, the sharded training state stays on the GPU beside it
        generating = vllm + mem["weights+grads+adam (fp32, sharded)"] + mem["reference model (--kl-coef)"]
        print(f"  {'vLLM while generating (--vllm-gpu-util)':<38} {gb(vllm):8.2f} GiB  (asleep while training)")
        print(f"  {'generation total (vLLM + sharded state)':<38} {gb(generating):8.2f} GiB")
    peak = max(total, generating)
    verdict = "fits" if peak < gpu_gb * 2**30 else "does NOT fit"
    print(f"peak {gb(peak):.1f} GiB: {verdict} in a {gpu_gb:.0f} GiB GPU")
    print(f"resolved config: {vars(a)}")
    return dict(n_params=n_total, per_rank=per_rank, memory=mem, total=total, generating=generating, peak=peak,
                fits=verdict == "fits")


# ----------------------------------------------------------------------------- checkpoints tensor by tensor
# safetensors by hand: an 8-byte header length, a JSON header {name: {dtype, shape, data_offsets}}, the bytes.
# Reading one tensor is a seek and a read (no mmap, so pages of a checkpoint do not pile up in memory): merge.py
# and analyze.py stream over 8B checkpoints this way.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def read_header(path: str) -> tuple:
    """(header without __metadata__, offset of the data section) of a .safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_tensor(path: str, name: str, headers: dict, rows: tuple | None = None) -> torch.Tensor:
    """One tensor of a .safetensors file (headers: a cache of read_header by path); rows=(start, stop) reads
    only those rows of its first dimension."""
    if path not in headers:
        headers[path] = read_header(path)
    header, data = headers[path]
    info = header[name]
    start, end = info["data_offsets"]
    shape = list(info["shape"])
    if rows is not None:
        row_bytes = (end - start) // shape[0]
        start, end = start + rows[0] * row_bytes, start + rows[1] * row_bytes
        shape[0] = rows[1] - rows[0]
    with open(path, "rb") as f:
        f.seek(data + start)
        buf = bytearray(f.read(end - start))
    dtype = DTYPES[info["dtype"]]
    return torch.frombuffer(buf, dtype=dtype).reshape(shape) if buf else torch.empty(shape, dtype=dtype)


def shard_files(ckpt: str) -> dict:
    """tensor name -> safetensors file of a HF checkpoint directory (one file or an index of shards)."""
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(ckpt, file) for name, file in json.load(f)["weight_map"].items()}
    single = os.path.join(ckpt, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no safetensors weights in {ckpt} (model.safetensors or its index)")
    return {name: single for name in read_header(single)[0]}


def checkpoint_tensors(ckpt: str):
    """Yield (name, tensor) for every tensor of a HF checkpoint, one at a time, read by seek: how evaluate.py
    pushes checkpoint after checkpoint into one vLLM engine without loading a model."""
    files, headers = shard_files(ckpt), {}
    for name, path in files.items():
        yield name, read_tensor(path, name, headers)


def tensor_infos(files: dict) -> dict:
    """tensor name -> {dtype, shape, data_offsets} over a checkpoint's shards (files: shard_files())."""
    out = {}
    for path in sorted(set(files.values())):
        out.update(read_header(path)[0])
    return {name: out[name] for name in files}


def same_tensors(base: str, ckpts: list) -> dict:
    """{checkpoint: {tensor name: file}} for the base and ckpts; ValueError unless every checkpoint has the
    base's tensor names and shapes (FileNotFoundError when one has no safetensors weights)."""
    files = {c: shard_files(c) for c in [base, *ckpts]}
    infos = {c: tensor_infos(f) for c, f in files.items()}
    for m in ckpts:
        if set(infos[m]) != set(infos[base]):
            extra = sorted(set(infos[m]) ^ set(infos[base]))[0]
            raise ValueError(f"mismatched architectures: tensor {extra} is in only one of {m} and the base")
        for name, info in infos[base].items():
            if infos[m][name]["shape"] != info["shape"]:
                raise ValueError(f"mismatched architectures: {name} is {infos[m][name]['shape']} in {m}, "
                                 f"{info['shape']} in the base")
    return files
