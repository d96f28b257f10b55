"""Run by tests/test_gpu.py under torchrun on the test device (GPUs: the process group init_dist starts there, NCCL for
CUDA tensors): every collective helper, one GRPO update of a micro Qwen3 under FSDP2 (bf16 on GPUs), and a round trip
of its sharded resume state (torch.distributed.checkpoint). Rank 0 writes what it measured to argv[1]."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_grpo import episodes  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from acl import common  # noqa: E402
from acl.step import train_on  # noqa: E402
from train_seq import grpo_loss  # noqa: E402


def main():
    cuda = torch.cuda.is_available()
    device = common.init_dist(bf16=cuda)
    r, w = common.rank(), common.world_size()
    seen = dict(device=str(device), backend=str(torch.distributed.get_backend()) if common.sharded() else None,
                sum=common.all_reduce_sum(r + 1), max=common.all_reduce_max(r), mean=common.gather_mean([r, r]),
                bcast=common.broadcast_object({"from": r}))
    common.barrier()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=64,
                      pad_token_id=0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    model = common.shard(model, bf16=cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    a = argparse.Namespace(clip_low=0.2, clip_high=0.28, tis_cap=2.0, kl_coef=0.0, loss="grpo")
    eps = episodes()[r::w]
    loss, stats = train_on(model, opt, eps, lambda lp, b, x: grpo_loss(lp, b, x, a), micro_batch=2,
                           extras=dict(adv=[(-1.0) ** i for i in range(len(eps))]))
    seen.update(loss=loss, grad_norm=stats["grad_norm"])
    state = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "state")
    before = common.full_state_dict(model)
    common.save_train_state(state, model, opt, dict(step=1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    extra = common.load_train_state(state, model, opt)
    after = common.full_state_dict(model)
    if r == 0:
        seen.update(extra=extra, restored=all(torch.equal(before[k], after[k]) for k in before))
        torch.save(seen, sys.argv[1])
    common.teardown()


if __name__ == "__main__":
    main()
