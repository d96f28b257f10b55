"""Run by tests/test_common.py, once alone and once under `torchrun --nproc_per_node=2` (gloo): one
SGD step of a micro Qwen3 on a fixed global batch, each rank taking its slice, FSDP2-sharded when
distributed. Rank 0 writes the global loss and the updated full state dict to argv[1]."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from acl.common import all_reduce_sum, full_state_dict, init_dist, rank, shard, teardown, world_size  # noqa: E402


def main():
    init_dist()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=64)
    model = shard(Qwen3ForCausalLM(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient itself: compare those
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 12), generator=g)                    # (B, T) the global batch
    mask = (torch.rand(4, 11, generator=g) > 0.3).float()               # (B, T-1) loss mask
    per = ids.size(0) // world_size()
    mine = slice(rank() * per, (rank() + 1) * per)
    logits = model(input_ids=ids[mine]).logits[:, :-1]                   # (b, T-1, V)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[mine, 1:].reshape(-1), reduction="none")
    # token-mean over the *global* batch; FSDP averages gradients over ranks, so scale by the world size
    local = (nll.view(per, -1) * mask[mine]).sum() / mask.sum()
    (local * world_size()).backward()
    opt.step()
    loss = all_reduce_sum(local.item())
    sd = full_state_dict(model)
    if rank() == 0:
        torch.save({"loss": loss, "state": sd}, sys.argv[1])
    teardown()


if __name__ == "__main__":
    main()
