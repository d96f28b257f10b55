"""sdft.py: the four filters on hand-made episodes of every domain, near-dedup, the pool on disk (loss mask, read back
as the same tensors), the batch schedule (mix x order), and end to end: a collection through the real rollout loop,
a run on a pool that evaluate.py scores, a kill and restart that ends with the same weights, bad input."""
import json
import os
import subprocess
import sys

import pytest
import torch

import acl.step
import sdft
from acl.step import pack
from envs import make_env
from envs.rollout import ReplayBackend, rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny-base")
ENV1 = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(TINY)


def replay(tok, env, task, texts, reward=None, truncated=None):
    """The episode a policy that wrote exactly `texts` would have had; reward/truncated forced where given, so that
    one filter is tested at a time."""
    ep = rollout(ReplayBackend(tok, texts), tok, [(env, task)], 1, max_tokens=4000, max_turn_tokens=2000)[0]
    ep.reward = ep.reward if reward is None else reward
    ep.truncated = ep.truncated if truncated is None else truncated
    return ep


def write_task(env):
    """A tiny e-commerce task whose last action is a write (so confirming matters)."""
    from envs.tau_store import WRITES
    return next(t for t in env.tasks("train", n=50) if t.gold["actions"][-1]["name"] in WRITES)


def hand_made(tok, domain):
    """(env, task, [good, wrong, bad tools, not compliant, a copy of good]) for one domain."""
    from envs.base import tool_call_text
    from envs.ecommerce import expert_turns
    env = make_env(domain)
    task = write_task(env) if domain == "ecommerce" else env.tasks("train", n=1)[0]
    good = env.expert(task)
    if domain == "math":
        wrong = [good[0].rsplit("\\boxed{", 1)[0] + "\\boxed{-1}"]
        tools = ['<tool_call>{"name": "calculator", "arguments": {}}</tool_call> ' + good[0]]
        off = [good[0] + " And that is all I have to say."]          # something after the boxed answer
    elif domain == "search":
        wrong = good[:-1] + ["<answer>nobody</answer>"]
        tools = [tool_call_text("search", {"query": 5})] + good     # an argument of the wrong type
        off = good[:-1] + [good[-1] + " I hope this helps."]         # something after the answer
    elif domain == "ecommerce":
        wrong = expert_turns(task, "no_action")
        tools = [tool_call_text("refund_everything", {"order": "x"})] + good   # a tool that does not exist
        off = expert_turns(task, "no_confirm")                       # a write nobody confirmed
    else:
        wrong = ["ok"]
        tools = [tool_call_text("search", {"query": "x"}) + good[0]]  # a tool call where there are no tools
        off = [" \n "]                                               # an empty reply
    eps = [replay(tok, env, task, good), replay(tok, env, task, wrong, reward=0.0),
           replay(tok, env, task, tools, reward=1.0), replay(tok, env, task, off, reward=1.0),
           replay(tok, env, task, good)]
    return env, task, eps


@pytest.mark.parametrize("domain", ["math", "search", "ecommerce", "if"])
def test_each_filter_rejects_exactly_what_it_should(tok, domain):
    env, task, eps = hand_made(tok, domain)
    assert eps[0].reward == 1.0 and eps[-1].reward == 1.0
    kept, counts = sdft.filter_group(env, task, eps, threshold=0.9)
    # wrong answer -> correct; bad tool call -> tools; protocol broken -> compliant; the copy -> distinct
    assert counts == dict(correct=4, tools=3, compliant=2, distinct=1)
    assert kept == [eps[0]]
    # cut at a limit: not compliant, whatever its reward
    cut = replay(tok, env, task, env.expert(task), truncated=True)
    assert sdft.filter_group(env, task, [cut], 0.9)[1]["compliant"] == 0


def test_near_dedup_removes_paraphrases_and_keeps_distinct_traces(tok):
    env = make_env("math")
    task = env.tasks("train", n=1)[0]
    answer = env.expert(task)[0]
    words = [f"w{i}" for i in range(60)]
    long = " ".join(words) + " " + answer
    same_but_case = long.upper().replace("\\BOXED", "\\boxed").replace(" ", "   ")   # normalised: identical
    one_word = " ".join(words[:30] + ["changed"] + words[31:]) + " " + answer        # 3 of ~65 3-grams differ
    other = " ".join(f"v{i}" for i in range(60)) + " " + answer                      # different working
    eps = [replay(tok, env, task, [t], reward=1.0) for t in (long, same_but_case, one_word, other)]
    kept, counts = sdft.filter_group(env, task, eps, threshold=0.9)
    assert kept == [eps[0], eps[3]] and counts["distinct"] == 2
    kept, _ = sdft.filter_group(env, task, eps, threshold=1.0)   # exact-distinct only: the one-word change stays
    assert kept == [eps[0], eps[2], eps[3]]
    assert 0.9 <= sdft.jaccard(sdft.ngrams(sdft.agent_text(eps[0].messages)),
                               sdft.ngrams(sdft.agent_text(eps[2].messages))) < 1.0


# ----------------------------------------------------------------------------- the pool on disk

@pytest.fixture(scope="module")
def pool(tok, tmp_path_factory):
    """A pool of the expert's episodes (3 train prompts per domain) written as sdft.py writes one."""
    from acl.common import tokenizer_hash
    from envs.rollout import expert_episodes
    eps, records = {}, {}
    for d in ["math", "search", "ecommerce", "if"]:
        env = make_env(d)
        tasks = env.tasks("train", n=3)
        eps[d] = expert_episodes(tok, env, tasks)
        records[d] = [sdft.pool_record(e, t, pass_rate=p) for e, t, p in zip(eps[d], tasks, (1.0, 0.25, 0.5))]
    path = str(tmp_path_factory.mktemp("pool") / "sdft-pool")
    sdft.write_pool(path, records, dict(format=sdft.POOL_FORMAT, domains=list(records), funnel={},
                                        tokenizer=tokenizer_hash(TINY)))
    return path, eps


def test_the_pool_read_back_gives_the_same_training_tensors(pool):
    path, eps = pool
    back = sdft.read_pool(path, ["math", "search", "ecommerce", "if"])
    for d in eps:
        a, b = pack(eps[d], 0), pack(back[d], 0)
        for k in ("p_ids", "p_attn", "rows", "c_ids", "c_attn", "mask"):
            assert torch.equal(a[k], b[k]), (d, k)
        assert [e.pass_rate for e in back[d]] == [1.0, 0.25, 0.5]


def test_the_loss_mask_covers_the_agents_tokens_only(pool, tok):
    path, _ = pool
    for d, eps in sdft.read_pool(path, ["math", "search", "ecommerce", "if"]).items():
        for e in eps:
            trained = tok.decode([t for t, m in zip(e.token_ids, e.loss_mask) if m], skip_special_tokens=False)
            # each turn as sampled: up to its stop token, </tool_call> or <|im_end|> (the template's closing of a
            # tool-call turn is not the policy's)
            said = "".join(m["content"] + ("" if m["content"].endswith("</tool_call>") else "<|im_end|>")
                           for m in e.messages if m["role"] == "assistant")
            assert trained == said, d
            assert not any(e.loss_mask[: e.prompt_len])


# ----------------------------------------------------------------------------- the batches

class Fake:
    def __init__(self, d, i, p):
        self.env, self.i, self.pass_rate = d, i, p


def fake_pools():
    return {d: [Fake(d, i, (i * 7 % 5) / 4) for i in range(n)] for d, n in [("math", 10), ("search", 3),
                                                                             ("ecommerce", 2), ("if", 7)]}


def test_balanced_batches_hold_the_same_count_per_domain_and_other_mixes_and_orders():
    pools = fake_pools()
    plan = sdft.schedule(pools, "balanced", "interleaved", 8, 12, seed=0)
    assert len(plan) == 12 and all([d for d, _ in b].count(x) == 2 for b in plan for x in pools)
    assert plan == sdft.schedule(pools, "balanced", "interleaved", 8, 12, seed=0)   # a resumed run redraws it
    # each domain is walked epoch by epoch: every episode once before any twice
    firsts = [i for b in plan[:5] for d, i in b if d == "ecommerce"][:4]
    assert sorted(firsts[:2]) == [0, 1] and sorted(firsts[2:]) == [0, 1]
    q = acl.step.mix_quota("proportional", {d: len(e) for d, e in pools.items()}, 11)
    assert q == dict(math=5, search=2, ecommerce=1, **{"if": 3})   # 5, 1.5, 1, 3.5: one remainder, to the first
    assert acl.step.mix_quota([1, 0, 0, 3], {d: 1 for d in pools}, 8) == dict(math=2, search=0, ecommerce=0, **{"if": 6})
    staged = sdft.schedule(pools, "balanced", "staged", 4, 8, seed=0)
    assert [b[0][0] for b in staged] == ["math"] * 2 + ["search"] * 2 + ["ecommerce"] * 2 + ["if"] * 2
    assert all(len({d for d, _ in b}) == 1 for b in staged)
    graded = sdft.schedule(pools, "balanced", "graded", 4, 10, seed=0)
    walk = [pools["math"][i].pass_rate for b in graded for d, i in b if d == "math"][:10]
    assert walk == sorted(walk, reverse=True)                     # easy (solved often) to hard, in each epoch


def test_lr_warms_up_then_decays_to_a_tenth():
    class A:
        lr, warmup = 1.0, 4
    lrs = [sdft.lr_at(A, s, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1) and all(x >= y for x, y in zip(lrs[4:], lrs[5:]))


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def student(tok, tmp_path_factory):
    """A micro Qwen3 with the tiny arena's tokenizer (so the pool's token ids are its own)."""
    from transformers import Qwen3ForCausalLM

    from acl.common import save_checkpoint
    from pretrain import model_config
    torch.manual_seed(0)
    out = str(tmp_path_factory.mktemp("student") / "micro")
    save_checkpoint(out, Qwen3ForCausalLM(model_config(tok, "micro", 2048)), tok, dict(method="base", stage="base"))
    return out


def run(args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "sdft.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=ENV1)


def test_collect_filter_write_and_train_end_to_end_through_the_rollout_loop(tmp_path, tiny_agent):
    """The tiny agent (conftest.py) as the if domain's 'oracle' (it follows ~45% of the instructions) and the
    committed base as the student: real sampling, the funnel, the pool on disk, a student trained on it; a rerun
    reuses both."""
    runs = str(tmp_path / "runs")
    args = ["--runs", runs, "--domains", "if", "--oracles", f"if={tiny_agent}", "--student", TINY, "--prompts", "16",
            "--group", "4", "--steps", "2", "--batch", "4", "--threads", "1"]
    r = run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| domain | generated | correct | tools | compliant | distinct | kept | prompts with a kept trace |" in r.stdout
    assert "sampled tok/s" in r.stdout and "tok/s (" in r.stdout
    meta = json.load(open(os.path.join(runs, "sdft-pool", "pool.json")))
    f = meta["funnel"]["if"]
    assert f["generated"] == 64 and f["generated"] >= f["correct"] >= f["tools"] >= f["compliant"] >= f["distinct"] > 0
    lines = open(os.path.join(runs, "sdft-pool", "if.jsonl")).read().splitlines()
    assert len(lines) == f["distinct"] and all(json.loads(x)["reward"] == 1.0 for x in lines)
    ck = json.load(open(os.path.join(runs, "sdft", "acl_meta.json")))
    assert ck["method"] == "sdft" and ck["pool_sizes"] == {"if": f["distinct"]} and ck["step"] == 2
    r = run(args)
    assert r.returncode == 0 and "collected before with this recipe" in r.stdout and "nothing to do" in r.stdout


@pytest.mark.slow
def test_a_run_on_a_pool_is_scored_by_evaluate_and_a_killed_run_resumes_to_the_same_weights(pool, student, tmp_path,
                                                                                               monkeypatch):
    from safetensors.torch import load_file
    path, _ = pool
    common_args = ["--pool", path, "--student", student, "--steps", "4", "--batch", "4", "--micro-batch", "4",
                   "--save-every", "2", "--threads", "1", "--runs", str(tmp_path / "runs")]
    whole = str(tmp_path / "whole")
    r = run([*common_args, "--out", whole])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "per batch {'math': 1, 'search': 1, 'ecommerce': 1, 'if': 1}" in r.stdout
    ev = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--ckpt", whole, "--suite", "tiny",
                         "--domains", "math,if", "--splits", "test", "--n", "2", "--no-gold", "--threads", "1",
                         "--out-dir", str(tmp_path / "eval")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env=ENV1)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert os.listdir(tmp_path / "eval")
    # killed in its 3rd step (after the resume state of step 2), then restarted with the same command
    killed = str(tmp_path / "killed")
    calls = {"n": 0}
    real = sdft.train_on

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(sdft, "train_on", dying)
    with pytest.raises(KeyboardInterrupt):
        sdft.main([*common_args, "--out", killed])
    assert os.path.isdir(os.path.join(str(tmp_path), ".resume-killed")) and not os.path.exists(killed)
    r = run([*common_args, "--out", killed])
    assert r.returncode == 0 and "resumed at step 2" in r.stdout, r.stderr[-3000:]
    a, b = load_file(os.path.join(whole, "model.safetensors")), load_file(os.path.join(killed, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not os.path.exists(os.path.join(str(tmp_path), ".resume-killed"))
    assert [json.loads(x)["step"] for x in open(killed + ".metrics.jsonl")] == [1, 2, 3, 4]   # each step once
    # another recipe into a finished student: refused, unless --overwrite
    r = run([*common_args, "--out", whole, "--lr", "5e-4"])
    assert r.returncode == 2 and "another recipe" in r.stderr and "--overwrite" in r.stderr
    r = run([*common_args, "--out", whole, "--lr", "5e-4", "--overwrite", "--steps", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(os.path.join(whole, "acl_meta.json")))["recipe"]["lr"] == 5e-4


def test_bad_input_stops_with_one_line_before_anything_is_written(pool, student, tmp_path, tok, call):
    path, _ = pool
    runs = str(tmp_path / "runs")

    def refused(args, *needles):
        r = call(sdft.main, ["--runs", runs, "--threads", "1", *args])
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
        assert all(n in r.stderr for n in needles), r.stderr
        assert not os.path.exists(runs)

    refused(["--student", student], "no oracle for math", "train_seq.py --oracle")
    os.makedirs(tmp_path / "junk")
    (tmp_path / "junk" / "math.jsonl").write_text('{"a": 1}\n')
    refused(["--pool", str(tmp_path / "junk"), "--student", student], "not an SDFT pool")
    bad = tmp_path / "badpool"
    os.makedirs(bad)
    (bad / "pool.json").write_text(json.dumps(dict(format=sdft.POOL_FORMAT, domains=["math"])))
    (bad / "math.jsonl").write_text('{"env": "math", "task_id": "x", "reward": 1, "token_ids": [1, 2], "loss_mask": [0]}\n')
    refused(["--pool", str(bad), "--student", student, "--domains", "math"], "line 1", "not a math pool record")
    refused(["--pool", path, "--student", student, "--domains", "math,search", "--mix", "1,2,3"], "--mix weights")
    refused(["--pool", path, "--student", student, "--batch", "6"], "divisible")
    # a student whose tokenizer is not the oracles' (the conftest-style micro tokenizer)
    from transformers import Qwen3ForCausalLM

    from acl.common import save_checkpoint
    from pretrain import model_config, train_tokenizer
    other_tok = train_tokenizer(["What is 1+1? \\boxed{2}"] * 20, vocab_size=300)
    other = str(tmp_path / "other")
    save_checkpoint(other, Qwen3ForCausalLM(model_config(other_tok, "micro", 256)), other_tok, dict(method="base"))
    refused(["--pool", path, "--student", other], "another tokenizer")


def test_a_filter_that_empties_a_domain_is_named_and_nothing_is_written(tmp_path, student):
    """The micro student as the math oracle: it never answers right, so the 'correct' filter empties math."""
    runs = str(tmp_path / "runs")
    r = run(["--runs", runs, "--domains", "math", "--oracles", f"math={student}", "--student", student,
             "--prompts", "2", "--group", "2", "--max-tokens", "300", "--max-turn-tokens", "8", "--threads", "1"])
    assert r.returncode == 1 and "the 'correct' filter left no math episode" in r.stderr, r.stderr[-2000:]
    assert not os.path.exists(os.path.join(runs, "sdft-pool")) and not os.path.exists(os.path.join(runs, "sdft"))


@pytest.mark.slow
def test_torchrun_two_ranks_collect_and_train_like_one_process(tmp_path, tiny_agent):
    """Under torchrun on 2 CPU ranks (gloo): each rank samples half the prompts, the pool is gathered and written once
    in prompt order, and FSDP2 training on it ends where one process training on the same pool ends."""
    from safetensors.torch import load_file
    runs = str(tmp_path / "runs")
    args = ["--runs", runs, "--domains", "if", "--oracles", f"if={tiny_agent}", "--student", TINY, "--prompts", "8",
            "--group", "4", "--steps", "2", "--batch", "4", "--micro-batch", "2", "--max-turn-tokens", "128"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "sdft.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=ENV1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 process(es)" in r.stdout and "[sdft] step 2/2" in r.stdout
    f = json.load(open(os.path.join(runs, "sdft-pool", "pool.json")))["funnel"]["if"]
    assert f["generated"] == 32 and f["prompts"] == 8
    ids = [json.loads(x)["task_id"] for x in open(os.path.join(runs, "sdft-pool", "if.jsonl"))]
    assert len(ids) == f["distinct"] > 0
    one = str(tmp_path / "one")
    r = run([*args[:-4], "--micro-batch", "2", "--pool", os.path.join(runs, "sdft-pool"), "--out", one,
             "--threads", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(os.path.join(runs, "sdft", "model.safetensors")), load_file(os.path.join(one, "model.safetensors"))
    for k in b:   # (the one-process checkpoint leaves out the lm_head tied to the embeddings)
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
