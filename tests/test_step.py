"""acl/step.py, the step every method runs: the same numbers as before it was shared code, the FSDP padding of
episode_logprobs, and the shared flag groups being enough for every shared function."""
import argparse
import copy
import json
import os
import sys

import pytest
import torch

import acl.step
import train_seq
from acl import common, scale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import dist_grpo  # noqa: E402

# The golden numbers came from the code before the training step moved out of train_seq.py (tests/golden/; the
# generator is in docs/LOG.md): the absolute sum and the norm of every tensor's change.
GOLDEN = json.load(open(os.path.join(ROOT, "tests", "golden", "train_step_before_refactor.json")))
CFG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
           head_dim=16, intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=64, pad_token_id=0)


def start():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CFG))
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model, ref, {k: v.clone() for k, v in model.state_dict().items()}


def assert_delta(model, init, golden):
    for k, v in model.state_dict().items():
        d = v.double() - init[k].double()
        got = [float(d.abs().sum()), float(d.norm())]
        assert got == pytest.approx(golden[k], rel=1e-4, abs=1e-9), k


@pytest.mark.parametrize("agg", ["token", "seq"])
def test_grpo_update_equals_the_pre_refactor_numbers(agg):
    """Two minibatch updates (the second off-policy against episode_logprobs' old log-probs), a k3 KL to a frozen
    reference, temperature 0.9, plain SGD so that any change of the loss's scale or aggregation shows."""
    model, ref, init = start()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    eps = dist_grpo.episodes()
    adv = [(-1.0) ** i * (1 + i / 8) for i in range(len(eps))]
    a = argparse.Namespace(clip_low=0.2, clip_high=0.28, tis_cap=2.0, kl_coef=0.05, loss="grpo")
    old = acl.step.episode_logprobs(model, eps, micro_batch=3, temperature=0.9)
    for k, (loss, clip) in enumerate(GOLDEN[f"grpo_{agg}"]["losses"]):
        sl = slice(k * 4, (k + 1) * 4)
        x = dict(adv=adv[sl], old=old[sl], ref=acl.step.episode_logprobs(ref, eps[sl], micro_batch=3, temperature=0.9))
        got, stats = acl.step.train_on(model, opt, eps[sl], lambda lp, b, x: train_seq.grpo_loss(lp, b, x, a),
                                         micro_batch=3, agg=agg, grad_clip=1e9, temperature=0.9, extras=x)
        assert got == pytest.approx(loss, rel=1e-5) and stats["clip"] == pytest.approx(clip, abs=1e-9)
    assert_delta(model, init, GOLDEN[f"grpo_{agg}"]["delta"])


def test_rft_epochs_equal_the_pre_refactor_numbers(monkeypatch, tmp_path):
    """train_seq.rft on fixed rollouts: the success filter (a failure, a malformed tool call and a duplicate are
    dropped) and two SFT epochs give the weights the code gave before it was shared; each SFT step is a row of the
    cold-start checkpoint's metrics.jsonl."""
    def fixed(*_a, **_k):
        eps = dist_grpo.episodes()
        for i, e in enumerate(eps):
            e.reward = 0.0 if i == 5 else 1.0
            e.messages = [{"role": "assistant", "content": '<tool_call>{"name": "x", "argu</tool_call>' if i == 6 else "ok"}]
        return eps + [copy.deepcopy(eps[0])]

    class NoBackend:
        model = None

        def sleep(self):
            pass

        def wake(self, tags=None):
            pass

        def load_weights(self, named):
            list(named)

    monkeypatch.setattr(train_seq, "rollouts", fixed)
    model, _, init = start()
    a = argparse.Namespace(rft_samples=2, seed=3, micro_batch=4, micro_tokens=0, rft_lr=1e-2, rft_epochs=2, agg="token", grad_clip=1.0,
                           temperature=1.0, cold_start="self", wandb=None)
    out = str(tmp_path / "2-search-rft")
    assert train_seq.cold_start(model, None, NoBackend(), None, "search", [None], a, "golden", out=out) == \
        GOLDEN["rft"]["kept"] == 6
    assert_delta(model, init, GOLDEN["rft"]["delta"])
    rows = [json.loads(x) for x in open(out + ".metrics.jsonl")]   # 6 kept, 2 per step, 2 epochs
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and all(r["nll"] > 0 and r["grad_norm"] > 0 for r in rows)


def test_a_changed_aggregation_would_fail_the_golden_test():
    """The golden comparison can fail: token-mean and sequence-mean give different updates on these episodes."""
    g = GOLDEN
    k = "model.embed_tokens.weight"
    assert abs(g["grpo_token"]["delta"][k][1] - g["grpo_seq"]["delta"][k][1]) > 1e-2 * g["grpo_token"]["delta"][k][1]


def test_a_script_with_only_the_shared_flag_groups_runs_every_shared_function(tmp_path, capsys):
    """The contract: a new script that declares add_scale_flags + add_step_flags can call check_shared_flags,
    make_backend, train_on, episode_logprobs, sft_epochs and dry_run without any flag of its own."""
    from transformers import Qwen3ForCausalLM

    from acl.common import save_checkpoint
    from acl.engine import make_backend
    from pretrain import model_config, train_tokenizer
    p = argparse.ArgumentParser()
    acl.step.add_scale_flags(p, "tiny")
    acl.step.add_step_flags(p, "tiny")
    a = acl.step.check_shared_flags(p.parse_args(["--micro-batch", "3"]))
    assert a.world_size == 1 and a.micro_batch == 3 and a.max_tokens > a.max_turn_tokens
    tok = train_tokenizer(["What is 1+2? \\boxed{3}"] * 20, vocab_size=300)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(model_config(tok, "micro", 256))
    ckpt = str(tmp_path / "m")
    save_checkpoint(ckpt, model, tok, dict(method="test"))
    backend, engine = make_backend(a.backend, tok, ckpt, policy=model, gen_batch=a.gen_batch, bf16=a.bf16,
                                   gpu_util=a.vllm_gpu_util, max_tokens=a.max_tokens, attn=a.attn)
    assert engine is model
    eps = dist_grpo.episodes()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(micro_batch=a.micro_batch, agg=a.agg, grad_clip=a.grad_clip)
    loss, stats = acl.step.train_on(model, opt, eps, acl.step.sft_loss, temperature=a.temperature, **kw)
    assert loss > 0 and stats["grad_norm"] > 0
    lp = acl.step.episode_logprobs(model, eps, micro_batch=a.micro_batch, temperature=a.temperature)
    assert [len(x) for x in lp] == [len(e.token_ids) - e.prompt_len for e in eps]
    assert len(acl.step.sft_epochs(model, opt, eps, epochs=1, batch=4, seed=0, **kw)) == 2
    figures = scale.dry_run(a, ckpt, 2, a.micro_batch, a.max_tokens)
    assert figures["fits"] and "dry run" in capsys.readouterr().out
    p2 = argparse.ArgumentParser()
    acl.step.add_scale_flags(p2, "qwen3-8b")
    acl.step.add_step_flags(p2, "qwen3-8b")
    big = p2.parse_args([])
    assert (big.backend, big.bf16, big.grad_ckpt, big.micro_batch) == ("vllm", True, True, 4)
    for bad in (["--micro-batch", "0"], ["--max-tokens", "10", "--max-turn-tokens", "20"], ["--grad-clip", "0"]):
        with pytest.raises(acl.step.UsageError):
            acl.step.check_shared_flags(p.parse_args(bad))


def test_nonfinite_gradient_stops_before_the_weights_change():
    model, _, _ = start()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def inf_loss(logp, b, x):
        return logp * float("inf"), {}
    with pytest.raises(FloatingPointError):
        acl.step.train_on(model, opt, dist_grpo.episodes(), inf_loss, micro_batch=4)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_episode_logprobs_with_uneven_ranks_under_torchrun(tmp_path):
    """Two CPU ranks holding 7 and 1 episodes: episode_logprobs and train_on pad the passes of the smaller rank
    (it hung before), and the log-probs and the update equal one process's on all 8. The group is the one init_dist
    starts on GPUs, with gloo playing NCCL's part: it refuses a CPU tensor wherever NCCL would."""
    a, b = dist_grpo.one_and_two_ranks(tmp_path, "2", "2", "token", "uneven", "nccl-like")
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for x, y in zip(a["logprobs"], b["logprobs"]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    for k in a["state"]:
        torch.testing.assert_close(b["state"][k], a["state"][k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_nccl_like_group_refuses_cpu_tensors_as_nccl_does(tmp_path):
    """The emulation above is faithful: the bare NCCL group that init_dist started before (every GPU run died at its
    first update, in train_on's all_reduce_max of a CPU scalar) fails the same way here."""
    assert dist_grpo.nccl_like("nccl") == "cuda:gloo"
    assert dist_grpo.nccl_like(common.dist_backend(True)) == "cpu:gloo,cuda:gloo"
    with pytest.raises(AssertionError, match="No backend type associated with device type cpu"):
        dist_grpo.one_and_two_ranks(tmp_path, "2", "2", "token", "uneven", "nccl")


def test_the_prompts_of_a_step_do_not_depend_on_the_world_size():
    """What a torchrun run shares with a 1-process run (README): each step's global batch of prompts, in the same
    order; each rank samples its slice with a seed of its own, so the samples (and the run) differ."""
    def step_prompts(world):
        cursor = acl.step.Cursor(100, seed=3)
        out = []
        for _ in range(5):
            batch = cursor.take(16)
            out.append(sorted(j for r in range(world) for j in batch[r::world]))
        return out
    assert step_prompts(1) == step_prompts(2) == step_prompts(4)


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("tied", [True, False])
def test_the_fused_head_gives_the_logits_path_values_and_gradients(ckpt, tied):
    """token_logprobs with the output head computing the log-probs chunk by chunk (the default, the (B, T, V) logits
    never held) equals the model's-logits path: values, the log-probs at extra ids (a distillation loss's) and every
    gradient, on the shared-prompt path and under activation checkpointing, tied and untied heads, chunks of 7
    tokens (one position per chunk for 4 episodes); the head is the plain Linear again afterwards."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from acl.common import checkpoint_activations
    from envs.rollout import Episode
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**dict(CFG, tie_word_embeddings=tied))).train()
    if ckpt:
        checkpoint_activations(model)
    eps = [Episode("a", "math", "train", k, [5, 6, 7, 8] + c, [0] * 4 + [1] * len(c), [0.0] * (4 + len(c)), 4)
           for k, c in enumerate([[9, 10, 11, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [12, 13], [14, 15, 16, 17]])]
    eps.append(Episode("b", "math", "train", 0, [20, 21] + [22, 23], [0, 0, 1, 1], [0.0] * 4, 2))
    b = acl.step.pack(eps, 0)
    extra = torch.randint(0, 64, b["c_ids"].shape + (3,))
    w = torch.rand(b["c_ids"].shape)
    out = {}
    for fused in (False, True):
        model.zero_grad()
        lp, ex = acl.step.token_logprobs(model, b, temperature=0.8, extra_ids=extra, fused=fused, chunk_tokens=7)
        ((lp * w * b["mask"]).sum() + (ex.exp() * b["mask"][..., None]).sum()).backward()
        out[fused] = (lp.detach() * b["mask"], ex.detach() * b["mask"][..., None],
                      {n: p.grad.clone() for n, p in model.named_parameters()})
    assert type(model.get_output_embeddings().forward).__name__ == "method"       # the Linear's own forward again
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    assert torch.allclose(out[True][1], out[False][1], atol=1e-5)
    for n, g in out[False][2].items():
        assert torch.allclose(out[True][2][n], g, atol=1e-5), n


def test_a_lora_policy_takes_the_fused_head_and_its_frozen_weights_get_no_gradient():
    """mle.py's expert: the peft-wrapped policy's head is still a plain Linear, so the fused path serves it; only the
    adapter's weights get gradients, and they equal the logits path's."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from envs.rollout import Episode
    torch.manual_seed(0)
    model = get_peft_model(Qwen3ForCausalLM(Qwen3Config(**CFG)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                               init_lora_weights=False))
    eps = [Episode("a", "math", "train", k, [5, 6, 7] + c, [0] * 3 + [1] * len(c), [0.0] * (3 + len(c)), 3)
           for k, c in enumerate([[9, 10, 11], [12, 13]])]
    b = acl.step.pack(eps, 0)
    grads = {}
    for fused in (False, True):
        model.zero_grad()
        (acl.step.token_logprobs(model, b, fused=fused) * b["mask"]).sum().backward()
        grads[fused] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True] and all("lora_" in n for n in grads[True])
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.allclose(grads[True][n], grads[False][n], atol=1e-5) for n in grads[True])


@pytest.mark.parametrize("ckpt", [False, True])
def test_compiled_norms_and_swiglu_give_the_eager_values_and_gradients(ckpt):
    """--compile (acl.compiled.compile_layers): the RMSNorms and the MLP's SiLU * up through torch.compile give the eager
    log-probs and every gradient to rounding: on the shared-prompt path, under activation checkpointing, for a
    batch of other lengths (one graph, dynamic shapes), without gradients (a reference model), and on a LoRA policy
    (adapter gradients only); the state-dict keys stay, and the compiled functions really ran."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from acl.common import checkpoint_activations
    from acl.compiled import compile_layers
    from envs.rollout import Episode
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**dict(CFG, tie_word_embeddings=False))).train()
    if ckpt:
        checkpoint_activations(model)
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "up_proj", "down_proj"],
                                                           init_lora_weights=False))
    eps = [Episode("a", "math", "train", k, [5, 6, 7, 8] + c, [0] * 4 + [1] * len(c), [0.0] * (4 + len(c)), 4)
           for k, c in enumerate([[9, 10, 11, 3, 4, 5, 6, 7, 8, 9], [12, 13], [14, 15, 16, 17]])]
    eps.append(Episode("b", "math", "train", 0, [20, 21] + [22, 23], [0, 0, 1, 1], [0.0] * 4, 2))
    batches = [acl.step.pack(eps, 0), acl.step.pack(eps[1:3], 0)]

    def run(m, b):
        m.zero_grad()
        lp = acl.step.token_logprobs(m, b, temperature=0.8)
        (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp) * b["mask"]).sum().backward()
        with torch.no_grad():
            frozen = acl.step.token_logprobs(m, b)
        return lp.detach() * b["mask"], frozen * b["mask"], \
            {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    keys = sorted(model.state_dict())
    eager = [run(model, b) for b in batches] + [run(lora, batches[0])]
    torch._dynamo.utils.counters.clear()
    compile_layers(model), compile_layers(lora)
    got = [run(model, b) for b in batches] + [run(lora, batches[0])]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2     # the norm's and the SwiGLU's, compiled
    assert sorted(model.state_dict()) == keys
    assert all("lora_" in n for n in got[2][2]) and got[2][2].keys() == eager[2][2].keys()
    for (lp, frozen, grads), (lp0, frozen0, grads0) in zip(got, eager):
        assert torch.allclose(lp, lp0, atol=1e-5) and torch.allclose(frozen, frozen0, atol=1e-5)
        for n, g in grads0.items():
            assert torch.allclose(grads[n], g, atol=1e-5), n
