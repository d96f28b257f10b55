"""Run by tests/test_train_seq.py, once alone and once under `torchrun --standalone --nproc_per_node=2`
(gloo): one GRPO update (acl.step.train_on with train_seq's clipped surrogate) of a micro Qwen3 on a fixed
global batch of episodes, each rank taking its share, FSDP2-sharded when distributed. The sampler's
log-probs are perturbed so the clip and the importance weight are exercised. Rank 0 writes the loss,
the clip fraction and the updated full state dict to argv[1]. argv[4] "uneven": rank 0 holds 7 episodes and
rank 1 one (train_on and episode_logprobs must pad the smaller rank's passes), and the episodes' log-probs
(acl.step.episode_logprobs, gathered) are written too. argv[4] "lora": the model is mle.py's expert (the frozen
micro Qwen3 with a LoRA adapter whose B is made non-zero, AdamW on the adapter only, the k3 KL to the adapter-disabled
model through mle.AdapterOff), sharded the same way. argv[4] "compiled-ranks": under torchrun the model's norms and
SwiGLU are compiled (shard(compiled=True), --compile), alone it runs eager: the one-rank run is the reference.
argv[5] "nccl-like": the process group is the one init_dist starts on GPUs with NCCL's part played by gloo
(nccl_like), so it refuses a CPU tensor wherever NCCL would; argv[5] "nccl": the bare NCCL group of before (every run
on GPUs stopped at its first update), which must fail here too."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from acl.common import full_state_dict, init_dist, rank, shard, teardown, world_size  # noqa: E402
from acl.step import episode_logprobs, train_on  # noqa: E402
from envs.rollout import Episode
from train_seq import grpo_loss  # noqa: E402


def episodes(n: int = 8):
    """Fixed episodes of different lengths: prompt tokens (mask 0), sampled tokens (mask 1), a tool
    observation in the middle (mask 0), sampling log-probs near the model's."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        p, s1, o, s2 = 3 + i % 3, 4 + i % 4, 2, 3 + i % 2
        ids = torch.randint(1, 64, (p + s1 + o + s2,), generator=g).tolist()
        mask = [0] * p + [1] * s1 + [0] * o + [1] * s2
        lps = [(-3.0 + 0.8 * float(torch.randn((), generator=g))) * m for m in mask]
        out.append(Episode(f"t{i // 2}", "math", "train", i % 2, ids, mask, lps, p))
    return out


def one_and_two_ranks(tmp_path, micro_one: str, micro_two: str, *mode) -> tuple:
    """Run this script alone (micro-batch micro_one) and under torchrun with 2 CPU ranks (micro_two), with the same
    extra arguments (agg, "uneven" or "lora"); -> what each wrote (the tests compare them)."""
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    root, script = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.abspath(__file__)
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    subprocess.run([sys.executable, script, one, micro_one, *mode], check=True, cwd=root, env=env, timeout=120)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
                        two, micro_two, *mode], cwd=root, env=env, timeout=180, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(one), torch.load(two)


def nccl_like(backend: str) -> str:
    """A process-group backend string's device map with gloo in NCCL's place. NCCL serves CUDA tensors only, so a
    bare "nccl" becomes "cuda:gloo" (a CPU tensor is refused: "No backend type associated with device type cpu") and
    "cpu:gloo,cuda:nccl" becomes "cpu:gloo,cuda:gloo"."""
    pairs = [p.split(":") if ":" in p else ("cuda", p) if p == "nccl" else ("cpu", p) for p in backend.split(",")]
    return ",".join(f"{d}:{'gloo' if b == 'nccl' else b}" for d, b in pairs)


def main():
    if len(sys.argv) > 5:   # "nccl-like": the group init_dist starts on GPUs; "nccl": the bare NCCL group it started before
        from acl import common
        on_gpus = common.dist_backend(True) if sys.argv[5] == "nccl-like" else sys.argv[5]
        common.dist_backend = lambda cuda: nccl_like(on_gpus)
    init_dist()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=64,
                      pad_token_id=0)
    lora = len(sys.argv) > 4 and sys.argv[4] == "lora"
    model = Qwen3ForCausalLM(cfg)
    a = argparse.Namespace(clip_low=0.2, clip_high=0.28, tis_cap=2.0, kl_coef=0.1 if lora else 0.0, loss="grpo")
    if lora:
        import mle
        model = mle.with_adapter(model, argparse.Namespace(lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                                                           lora_targets=list(mle.TARGETS)))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn_like(p) * 0.1)
    model = shard(model, compiled=len(sys.argv) > 4 and sys.argv[4] == "compiled-ranks" and world_size() > 1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2) if lora else \
        torch.optim.SGD(model.parameters(), lr=1.0)
    eps = episodes()
    adv = [(-1.0) ** i * (1 + i / 8) for i in range(len(eps))]
    per = len(eps) // world_size()
    mine = slice(rank() * per, (rank() + 1) * per)
    if len(sys.argv) > 4 and sys.argv[4] == "uneven" and world_size() == 2:
        mine = slice(0, 7) if rank() == 0 else slice(7, 8)
    mb = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    lps = episode_logprobs(model, eps[mine], micro_batch=mb)
    if world_size() > 1:
        import torch.distributed as dist
        parts = [None] * world_size()
        dist.all_gather_object(parts, lps)
        lps = [x for part in parts for x in part]
    extras = dict(adv=adv[mine])
    if lora:
        extras["ref"] = episode_logprobs(mle.AdapterOff(model), eps[mine], micro_batch=mb)
    loss, stats = train_on(model, opt, eps[mine], lambda lp, b, x: grpo_loss(lp, b, x, a),
                           micro_batch=mb,
                           agg=sys.argv[3] if len(sys.argv) > 3 else "token", grad_clip=1e9, extras=extras)
    clip = stats["clip"]
    sd = full_state_dict(model)
    if rank() == 0:
        torch.save({"loss": loss, "clip": clip, "state": sd, "logprobs": lps,
                    "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}, sys.argv[1])   # compiled
    teardown()


if __name__ == "__main__":
    main()
