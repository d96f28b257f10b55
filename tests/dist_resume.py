"""Run by tests/test_common.py under `torchrun --standalone --nproc_per_node=N` (gloo) or alone: the sharded resume
state (common.save_train_state / load_train_state, torch.distributed.checkpoint) of a micro Qwen3 under FSDP2.
  dist_resume.py STATE OUT save [lora]   one AdamW step on batch A, save the state to STATE, one more step on batch B
  dist_resume.py STATE OUT load [lora]   load STATE (saved by any number of ranks), the same step on batch B
Rank 0 writes to OUT the full weights after the first step ("w1": right after saving, or right after loading), after
the second ("w2"), the optimizer's first moment of one weight after loading or saving ("m1") and the restored extra.
Each rank trains on its share of the same global batch (equal lengths), so N ranks and one compute the same update.
"lora": mle.py's expert (frozen micro Qwen3, a LoRA adapter trained), whose state holds the adapter only."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from acl.common import (  # noqa: E402
    full_state_dict,
    init_dist,
    load_train_state,
    rank,
    save_train_state,
    shard,
    teardown,
    world_size,
)


def step(model, opt, batch):
    mine = batch[rank()::world_size()]
    model(mine, labels=mine).loss.backward()
    opt.step()
    opt.zero_grad()


def main():
    state, out, mode = sys.argv[1:4]
    lora = sys.argv[4:] == ["lora"]
    init_dist()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=64)
    model = Qwen3ForCausalLM(cfg)
    if lora:
        import mle
        model = mle.with_adapter(model, argparse.Namespace(lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                                                           lora_targets=list(mle.TARGETS)))
    model = shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(1, 64, (4, 12), generator=g), torch.randint(1, 64, (4, 12), generator=g)
    if mode == "save":
        step(model, opt, a)
        save_train_state(state, model, opt, dict(step=1, cursor=7), recipe=dict(lr=1e-2))
        extra = None
    else:
        extra = load_train_state(state, model, opt)
    w1 = {k: v.clone() for k, v in full_state_dict(model).items()}   # unsharded, the live tensors themselves
    name = next(n for n, p in model.named_parameters() if p.requires_grad and "layers.1.mlp.up_proj" in n)
    m = opt.state[dict(model.named_parameters())[name]]["exp_avg"]
    m1 = (m.full_tensor() if hasattr(m, "full_tensor") else m).detach().clone()
    step(model, opt, b)
    w2 = full_state_dict(model)
    if rank() == 0:
        torch.save(dict(w1=w1, w2=w2, m1=m1, extra=extra, rng=torch.rand(3)), out)
    teardown()


if __name__ == "__main__":
    main()
