"""Issue 17's pieces: the scripted expert and its replay, saved episodes, the gold log-likelihood, GSPO's ratio,
per-domain --lr / --kl-coef, and the paired differences of the accuracy matrix."""
import argparse
import json
import math
import os

import pytest
import torch

import evaluate
import report
import train_seq
from acl import forgetting
from envs import make_env, per_domain
from envs.base import UsageError
from envs.rollout import (
    Generation,
    ReplayBackend,
    episode_record,
    expert_episodes,
    expert_records,
    rollout,
    saved_episodes,
)

LIMITS = dict(max_tokens=20000, max_turn_tokens=4000)   # the micro tokenizer spends more tokens than the tiny one


class Sampler:
    """A 'policy' that happens to sample exactly these texts, token by token as the tokenizer splits them, closing
    each turn as a sampler does (at a stop token, else with <|im_end|>), with made-up log-probs."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.i = tok, texts, 0

    def generate(self, prompts, max_new_tokens, temperature, stop_ids, adapters=None):
        ids = self.tok(self.texts[self.i], add_special_tokens=False)["input_ids"]
        self.i += 1
        stop = [j for j, t in enumerate(ids) if t in stop_ids]
        ids = ids[: stop[0] + 1] if stop else ids + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        return [Generation(ids, [-0.3] * len(ids), True)]


@pytest.mark.parametrize("domain", ["math", "search", "ecommerce", "if"])
def test_expert_replay_is_a_sampled_episode_of_the_same_text(micro, domain):
    _, tok = micro
    env = make_env(domain)
    for task in env.tasks("test", n=3) + env.tasks("ood", n=2):
        texts = env.expert(task)
        replay = expert_episodes(tok, env, [task], **LIMITS)[0]
        sampled = rollout(Sampler(tok, texts), tok, [(env, task)], 1, **LIMITS)[0]
        assert replay.token_ids == sampled.token_ids and replay.loss_mask == sampled.loss_mask
        assert replay.prompt_len == sampled.prompt_len and replay.messages == sampled.messages
        assert replay.reward == sampled.reward == 1.0 and not replay.truncated   # the expert solves its task
        assert all(lp == 0.0 for lp in replay.logprobs)
        # the mask covers the expert's turns and nothing else
        said = [tok.decode([t for t, m in zip(replay.token_ids, replay.loss_mask) if m], skip_special_tokens=False)]
        assert said[0].replace("<|im_end|>", "") == "".join(texts)


def test_every_tiny_expert_episode_scores_one(micro):
    _, tok = micro
    for domain in ("math", "search", "ecommerce", "if"):
        env = make_env(domain)
        for split in ("train", "val", "test", "ood"):
            eps = expert_episodes(tok, env, env.tasks(split, n=25), **LIMITS)
            assert len(eps) == 25 and all(e.reward == 1.0 for e in eps), (domain, split)


def test_replay_backend_cuts_at_a_stop_token_and_at_the_limit(micro):
    _, tok = micro
    eos, call_end = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("</tool_call>")
    g = ReplayBackend(tok, ["<tool_call>{}</tool_call> more"]).generate([[1]], 100, 1.0, [eos, call_end])[0]
    assert g.token_ids[-1] == call_end and g.stopped and "more" not in tok.decode(g.token_ids)
    g = ReplayBackend(tok, ["a long reply " * 20]).generate([[1]], 5, 1.0, [eos])[0]
    assert len(g.token_ids) == 5 and not g.stopped
    g = ReplayBackend(tok, ["x"]).generate([[1]], 5, 1.0, [eos])[0]
    assert g.token_ids[-1] == eos and g.stopped


def test_saved_episodes_render_exactly_as_the_live_ones(micro, tmp_path):
    _, tok = micro
    for domain in ("search", "ecommerce"):
        env = make_env(domain)
        tasks = env.tasks("train", n=4)
        live = expert_episodes(tok, env, tasks, **LIMITS)
        path = tmp_path / f"{domain}.jsonl"
        path.write_text("".join(json.dumps(episode_record(e, t)) + "\n" for e, t in zip(live, tasks)))
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        again = saved_episodes(tok, rows, **LIMITS)
        for x, y in zip(live, again):
            assert x.token_ids == y.token_ids and x.loss_mask == y.loss_mask and y.reward == 1.0
        assert expert_records(str(tmp_path), domain) == rows
    with pytest.raises(UsageError, match="not a directory"):
        expert_records(str(tmp_path / "missing"), "search")


def test_gold_likelihood_of_an_expert_copier_beats_a_random_model(micro):
    """A micro model trained on the expert's episodes scores a higher gold log-likelihood and top-1 than the same
    model untrained (random), on the same expert episodes; the values are deterministic."""
    import copy

    from acl.step import sft_epochs
    model, tok = micro
    env = make_env("math")
    tasks = env.tasks("train", n=8)
    rand = copy.deepcopy(model)
    g0 = evaluate.gold_likelihood(rand, tok, env, tasks, **LIMITS)
    assert evaluate.gold_likelihood(rand, tok, env, tasks, **LIMITS) == g0
    copier = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(copier.parameters(), lr=3e-3)
    eps = expert_episodes(tok, env, tasks, **LIMITS)
    sft_epochs(copier, opt, eps, epochs=30, batch=8, micro_batch=8, grad_clip=1.0, seed=0, agg="token", label="copy")
    g1 = evaluate.gold_likelihood(copier.eval(), tok, env, tasks, **LIMITS)
    assert g0["n"] == g1["n"] == 8 and g0["expert_reward"] == 1.0 and g0["tokens"] == sum(e.n_sampled for e in eps)
    assert g1["loglik"] > g0["loglik"] + 1.0 and g1["top1"] > g0["top1"]
    assert g0["loglik"] < 0 and 0 <= g0["top1"] <= 1 and len(g0["per_task_loglik"]) == 8
    # the per-task mean is the masked mean of the teacher-forced log-probs, computed here another way
    e = eps[0]
    with torch.no_grad():
        logits = rand(input_ids=torch.tensor([e.token_ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(e.token_ids[1:])[:, None])[:, 0]
    m = torch.tensor(e.loss_mask[1:], dtype=torch.float)
    assert g0["per_task_loglik"][0] == pytest.approx(((lp * m).sum() / m.sum()).item(), abs=1e-4)


def test_gspo_ratio_by_hand():
    """GSPO: one ratio per sequence, exp(mean over its sampled tokens of log pi - log pi_old), on every token."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.8, -0.6], [-0.25, -0.3, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])        # the second sequence is two tokens long
    adv = torch.tensor([[1.0], [-1.0]])
    a = argparse.Namespace(clip_low=0.2, clip_high=0.28, tis_cap=2.0, kl_coef=0.0, loss="gspo")
    b = dict(slp=old, mask=mask)
    loss, st = train_seq.grpo_loss(logp, b, dict(adv=adv, old=old), a)
    s1 = math.exp(((-1.0 + 1.1) + (-2.0 + 1.8) + (-0.5 + 0.6)) / 3)  # = exp(0) = 1
    s2 = math.exp(((-0.2 + 0.25) + 0.0) / 2)
    tis = torch.exp(old - old)                                       # sampler == trainer here: 1
    want = torch.tensor([[-s1 * 1.0] * 3, [s2 * 1.0] * 3]) * tis      # unclipped: -min(s A, clip(s) A)
    assert torch.allclose(loss, want, atol=1e-6)
    # the gradient of each token's loss is -A * s_i * d log p_t: the sequence ratio scales every token alike
    loss[1, 0].backward()
    assert logp.grad[1, 0].item() == pytest.approx(s2, rel=1e-6) and logp.grad[1, 1].item() == 0.0
    # a sequence whose ratio leaves the clip range is clipped as a whole (every token), per-token GRPO is not
    far = old.clone()
    far[0] = logp[0].detach() - 0.5                                   # mean log-ratio 0.5: s = 1.65 > 1.28
    _, st = train_seq.grpo_loss(logp, b, dict(adv=adv, old=far), a)
    assert st["clip"][0].tolist() == [1.0, 1.0, 1.0] and st["clip"][1].tolist() == [0.0, 0.0, 0.0]
    _, st_grpo = train_seq.grpo_loss(logp, b, dict(adv=adv, old=far), argparse.Namespace(**dict(vars(a), loss="grpo")))
    assert st_grpo["clip"][0].tolist() == [1.0, 1.0, 1.0]   # (here too: each token's own ratio is 1.65)
    far[0, 0] = logp[0, 0].detach() + 0.3                             # tokens disagree: the sequence decides for all
    _, st = train_seq.grpo_loss(logp, b, dict(adv=adv, old=far), a)
    _, st_grpo = train_seq.grpo_loss(logp, b, dict(adv=adv, old=far), argparse.Namespace(**dict(vars(a), loss="grpo")))
    assert st["clip"][0].tolist() == [0.0, 0.0, 0.0] and st_grpo["clip"][0].tolist() == [1.0, 1.0, 1.0]


def test_per_domain_rates_parse_and_refuse_bad_input():
    doms = ["math", "search", "ecommerce", "if"]
    assert per_domain("--lr", "2e-4", doms, float) == {d: 2e-4 for d in doms}
    assert per_domain("--lr", "math=1e-3,search=5e-4,ecommerce=2e-4,if=3e-4", doms, float)["search"] == 5e-4
    assert per_domain("--steps", "math=4,if=2", ["math", "if"]) == {"math": 4, "if": 2}
    for bad, msg in [("math=1e-3", "names no value for search"), ("fast", "takes X or domain=X"),
                     ("math=1e-3,math=2e-3,search=1,ecommerce=1,if=1", "twice"), ("mth=1,math=1,search=1,ecommerce=1,if=1",
                                                                                 "unknown domain 'mth'"),
                     ("nan", "finite"), ("math=inf,search=1,ecommerce=1,if=1", "finite")]:
        with pytest.raises(UsageError, match=msg):
            per_domain("--lr", bad, doms, float)


@pytest.mark.parametrize("flags, msg", [
    (["--lr", "math=1e-3"], "--lr names no value for search"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--kl-coef", "math=0.01,search=0,ecommerce=-0.1,if=0"], "--kl-coef must be >= 0"),
    (["--kl-coef", "lots"], "--kl-coef takes X or domain=X"),
    (["--expert-data", "x", "--cold-start", "self"], "--expert-data is for --cold-start expert"),
    (["--preset", "qwen3-8b", "--cold-start", "expert", "--dry-run", "--world-size", "8"], "needs --expert-data DIR"),
])
def test_train_seq_refuses_bad_rates_in_one_line(flags, msg, tmp_path, micro):
    from acl.common import save_checkpoint
    model, tok = micro
    save_checkpoint(str(tmp_path / "base"), model, tok, {"method": "base"})
    a = train_seq.get_args(["--init", str(tmp_path / "base"), "--runs", str(tmp_path / "runs")] + flags)
    with pytest.raises(UsageError, match=msg):
        train_seq.check_args(a)


def test_per_domain_rates_reach_the_stage_and_its_recipe(tmp_path, micro):
    from acl.common import save_checkpoint
    model, tok = micro
    save_checkpoint(str(tmp_path / "base"), model, tok, {"method": "base"})
    a = train_seq.check_args(train_seq.get_args(["--init", str(tmp_path / "base"), "--runs", str(tmp_path / "r"),
                                                 "--lr", "math=1e-3,search=5e-4,ecommerce=2e-4,if=3e-4",
                                                 "--kl-coef", "math=0.01,search=0,ecommerce=0.1,if=0"]))
    s = train_seq.stage_args(a, "ecommerce")
    assert (s.lr, s.kl_coef) == (2e-4, 0.1)
    r = train_seq.recipe(a, "math")
    assert (r["lr"], r["kl_coef"], r["cold_start"]) == (1e-3, 0.01, None)     # math has no cold start
    assert train_seq.recipe(a, "search")["cold_start"] == "expert"             # the tiny preset's default


# ----------------------------------------------------------------------------- paired differences

def record(values, ids=None, gold=None):
    ids = ids or [f"t{i}" for i in range(len(values))]
    b = {"mean": sum(values) / len(values), "std": 0.0, "n": len(values), "task_ids": ids, "per_task": values}
    if gold is not None:
        b["gold"] = {"loglik": sum(gold) / len(gold), "task_ids": ids, "per_task_loglik": gold}
    return {"math/test": b}


def test_paired_difference_and_matrix_standard_errors():
    x = forgetting.domain_cell(record([0, 1, 0, 1]), "math")
    y = forgetting.domain_cell(record([1, 1, 0, 1]), "math")
    d, se = forgetting.paired_difference(x, y)
    assert d == pytest.approx(0.25) and se == pytest.approx(0.25)     # diffs 1,0,0,0: sd 0.5 / sqrt 4
    # other tasks cannot be paired: the difference of means, no SE
    z = forgetting.domain_cell(record([1, 1, 1, 1], ids=["u0", "u1", "u2", "u3"]), "math")
    assert forgetting.paired_difference(x, z) == (pytest.approx(0.5), None)
    base = record([0, 0, 0, 0], gold=[-3.0, -3.0, -3.0, -3.0])
    s1 = record([1, 1, 0, 1], gold=[-1.0, -1.2, -1.1, -0.9])
    s2 = record([0, 1, 0, 0], gold=[-2.0, -2.0, -2.5, -1.5])
    stages = [("seq-1-math", "math", s1), ("seq-2-if", "if", s2)]
    m = forgetting.accuracy_matrix(stages, base, ["math", "if"])
    assert m["gain"]["math"] == (pytest.approx(0.75), pytest.approx(0.25))
    assert m["forgetting"]["math"] == pytest.approx(0.5) and m["bwt"] == pytest.approx(-0.5)
    assert m["forgetting_se"]["math"] == pytest.approx(math.sqrt(1 / 3) / 2)   # diffs 1,0,0,1
    assert m["bwt_se"] == pytest.approx(m["forgetting_se"]["math"])
    g = forgetting.accuracy_matrix(stages, base, ["math", "if"], metric="gold")
    assert g["matrix"][1][0] == pytest.approx(-1.05) and g["bwt"] == pytest.approx(-2.0 + 1.05)
    assert "±" in forgetting.matrix_table(g) and "gold log-likelihood" in forgetting.matrix_table(g)


def test_across_training_seeds(tmp_path):
    runs = []
    for k, (a, b) in enumerate([(0.5, 0.2), (0.7, 0.4), (0.6, 0.3)]):
        m = forgetting.accuracy_matrix([("seq-1-math", "math", record([a] * 4)), ("seq-2-if", "if", record([b] * 4))],
                                     record([0.1] * 4), ["math"])
        run = tmp_path / f"runs/tiny-seed{k}"
        os.makedirs(run / "eval")
        (run / "eval" / "seq_matrix.json").write_text(json.dumps(m))
        runs.append(str(run))
    text = report.across_seeds(runs)
    assert "mean ± std over 3 training seeds" in text and "| seq-1-math | 0.600 ± 0.100 |" in text
    assert "BWT -0.300 ± 0.000" in text
    saved = json.loads(open(os.path.join(runs[0], "eval", "seq_matrix_seeds.json")).read())
    assert saved["score"]["matrix"][1][0] == [pytest.approx(0.6), pytest.approx(0.1), 3]
    with pytest.raises(UsageError, match="no accuracy matrix"):
        report.across_seeds(runs + [str(tmp_path / "nothing")])
