"""--compile: the decoder's elementwise work through torch.compile (common.shard(compiled=True) applies it).

    python train_seq.py --compile        # any trainer; bench/gpu_step.py --compile times it beside the eager update
"""
import functools

import torch


def _rms_norm(x, weight, eps: float):
    """Qwen3RMSNorm's forward as one function of tensors (what compile_layers compiles): fp32 statistics, the
    input's dtype back before the scale."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _swiglu(gate, up):
    """The MLP's SiLU(gate) * up (what compile_layers compiles)."""
    return torch.nn.functional.silu(gate) * up


@functools.cache
def _compiled() -> tuple:
    """(_rms_norm, _swiglu) compiled once per process, shared by every layer and every model: one graph per kind (and
    per grad mode and dtype: the recompile limit raised to 32 for those, from torch's 8)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    return torch.compile(_rms_norm, dynamic=True), torch.compile(_swiglu, dynamic=True)


def compile_layers(model):
    """--compile: torch.compile the decoder's elementwise work, which eager PyTorch launches as many small memory-bound
    kernels: every RMSNorm (fp32 cast, square, mean, rsqrt, scale) and the MLP's SiLU(gate) * up, each one fused
    kernel. The matmuls stay cuBLAS's (under peft the LoRA ones too), attention stays SDPA's, and FSDP2's hooks,
    activation checkpointing and the KV cache stay eager: a whole compiled decoder layer recompiles for every layer
    index (the cache grows layer by layer) and soon falls back to eager. Each compiled function sees its input
    flattened to (tokens, width) with dynamic shapes, so micro-batches of other lengths reuse one graph; the patched
    modules keep their parameters and state-dict keys. Values and gradients equal the eager ones to rounding
    (tests/test_step.py). Opt-in until a GPU measures what it buys (bench/gpu.sh prints it beside the eager update)."""
    rms_norm_c, swiglu_c = _compiled()

    def norm(mod, x):
        return rms_norm_c(x.reshape(-1, x.shape[-1]), mod.weight, mod.variance_epsilon).view(x.shape)

    def mlp(mod, x):
        flat = x.reshape(-1, x.shape[-1])
        return mod.down_proj(swiglu_c(mod.gate_proj(flat), mod.up_proj(flat))).view(*x.shape[:-1], -1)

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model   # a peft model wraps it
    n = 0
    for mod in inner.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
            mod.forward, n = functools.partial(norm, mod), n + 1
        elif name.endswith("MLP") and type(getattr(mod, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"):
            mod.forward, n = functools.partial(mlp, mod), n + 1
    if not n:
        raise ValueError(f"--compile: no RMSNorm or SiLU MLP module in {type(inner).__name__}")
    return model
