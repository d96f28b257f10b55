"""train_seq.py: the GRPO pieces on hand-made numbers, FSDP2 on 2 CPU ranks = 1 process, and the
sequential run end to end on a micro checkpoint (resume, skip finished stages, bad input, NaN)."""
import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import acl.step
import train_seq
from envs import per_domain
from envs.base import UsageError, well_formed
from envs.rollout import Episode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ns(**kw):
    base = dict(clip_low=0.2, clip_high=0.28, tis_cap=2.0, kl_coef=0.0, loss="grpo")
    return argparse.Namespace(**(base | kw))


def grpo(logp, old, sampler, adv, ref, a):
    """train_seq.grpo_loss's per-token loss on hand-made tensors (mask 1 everywhere)."""
    x = dict(adv=adv, old=old) | (dict(ref=ref) if ref is not None else {})
    return train_seq.grpo_loss(logp, dict(slp=sampler, mask=torch.ones_like(logp)), x, a)[0]


def ep(tid, reward, n=3):
    return Episode(tid, "math", "train", 0, [1] * n, [1] * n, [0.0] * n, 0, reward=reward)


def test_group_advantages_by_hand():
    eps = [ep("a", 1.0), ep("a", 0.0), ep("a", 0.0), ep("a", 1.0), ep("b", 1.0), ep("b", 1.0), ep("c", 0.5), ep("c", 0.0)]
    adv, flat = train_seq.group_advantages(eps)
    assert flat == {"b"}                                      # all equal: dropped by dynamic sampling
    s = torch.tensor([1.0, 0, 0, 1]).std().item()             # unbiased std, as torch.std
    assert adv[0] == pytest.approx(0.5 / s, rel=1e-5) and adv[1] == pytest.approx(-0.5 / s, rel=1e-5)
    assert adv[6] == pytest.approx(0.25 / torch.tensor([0.5, 0.0]).std().item(), rel=1e-5)
    assert 4 not in adv and 5 not in adv
    adv_all, _ = train_seq.group_advantages(eps, drop_flat=False)   # without dynamic sampling: flat groups get 0
    assert adv_all[4] == 0.0 and adv_all[5] == 0.0 and adv_all[0] == adv[0] and adv_all[7] == adv[7]


def test_grpo_token_loss_clips_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 1.0, 1.1, 1.5]]))     # ratios 0.5, 1.0, 1.1, 1.5
    a = ns()
    pos = grpo(logp, old, old, torch.ones(1, 1), None, a)
    # A > 0: min(r A, clip(r) A) -> 0.5, 1.0, 1.1, 1.28 (clip-high caps the gain)
    assert pos.tolist()[0] == pytest.approx([-0.5, -1.0, -1.1, -1.28], rel=1e-6)
    neg = grpo(logp, old, old, -torch.ones(1, 1), None, a)
    # A < 0: min(-r, -clip(r)) -> -0.8 (clip-low), -1, -1.1, -1.5
    assert neg.tolist()[0] == pytest.approx([0.8, 1.0, 1.1, 1.5], rel=1e-6)
    # the truncated importance weight: sampler log-prob below the trainer's by log 3 -> weight capped at 2
    w = grpo(old, old, old - torch.log(torch.tensor(3.0)), torch.ones(1, 1), None, a)
    assert w.tolist()[0] == pytest.approx([-2.0] * 4, rel=1e-6)
    # k3 KL: exp(d) - d - 1 with d = ref - logp
    k = grpo(old, old, old, torch.zeros(1, 1), torch.full((1, 4), 0.5), ns(kl_coef=0.1))
    assert k.tolist()[0] == pytest.approx([0.1 * (torch.exp(torch.tensor(0.5)).item() - 1.5)] * 4, rel=1e-5)


def _fixed_episodes():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import dist_grpo
    return dist_grpo.episodes()


@pytest.mark.parametrize("agg", ["token", "seq"])
def test_micro_batches_do_not_change_the_update(agg):
    """token-/seq-mean over the global batch: the same update whatever the micro-batch size."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=64,
                      pad_token_id=0)
    eps = _fixed_episodes()
    adv = [(-1.0) ** i * (1 + i / 8) for i in range(len(eps))]
    out = []
    longest = max(len(e.token_ids) for e in eps)
    for mb, tokens in ((1, 0), (3, 0), (8, 0), (8, 2 * longest)):   # the last: a token budget splits the batch
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        loss, _ = acl.step.train_on(model, opt, eps, lambda lp, b, x: train_seq.grpo_loss(lp, b, x, ns()), micro_batch=mb,
                                      micro_tokens=tokens, agg=agg, grad_clip=1e9, extras=dict(adv=adv))
        out.append((loss, {k: v.clone() for k, v in model.state_dict().items()}))
    for loss, sd in out[1:]:
        assert loss == pytest.approx(out[0][0], rel=1e-5, abs=1e-7)
        for k in sd:
            torch.testing.assert_close(sd[k], out[0][1][k], rtol=1e-5, atol=1e-6)


def test_micro_batches_respect_the_sequence_and_token_budgets():
    """Every episode once; at most `size` episodes and `tokens` padded tokens (longest prompt + longest completion,
    times the count) a micro-batch; an episode over the budget alone; similar lengths together."""
    from envs.rollout import Episode

    def ep(prompt, n):
        return Episode(task_id="t", env="math", split="train", sample=0, token_ids=list(range(prompt + n)),
                       loss_mask=[0] * prompt + [1] * n, logprobs=[0.0] * (prompt + n), prompt_len=prompt)
    eps = [ep(10, 50) for _ in range(20)] + [ep(12, 700)] + [ep(10, 40 + i) for i in range(20)]
    micro = acl.step.micro_batches(eps, 16, 2048)
    assert sorted(i for m in micro for i in m) == list(range(len(eps)))
    for m in micro:
        assert len(m) <= 16
        cost = len(m) * (max(eps[i].prompt_len for i in m) + max(len(eps[i].token_ids) - eps[i].prompt_len for i in m))
        assert cost <= 2048 or len(m) == 1
    assert [20] in micro                                 # the 712-token episode: a pass of its own
    assert len(acl.step.micro_batches(eps, 16)) == 3    # no token budget: only the count splits (41 -> 16 + 16 + 9)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_fsdp2_two_cpu_ranks_match_one_process(tmp_path, compiled):
    """One GRPO update under torchrun --nproc_per_node=2 (FSDP2, gloo) = the same update in one process; with
    compiled (--compile), the two ranks' norms and SwiGLU compiled (each rank its own graphs, the weights all-gathered
    before them) and the one process eager, to rounding."""
    import dist_grpo
    a, b = dist_grpo.one_and_two_ranks(tmp_path, "3", "2", *(["token", "compiled-ranks"] if compiled else []))
    assert a["graphs"] == 0 and (b["graphs"] >= 2 if compiled else b["graphs"] == 0)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for k in a["state"]:
        torch.testing.assert_close(b["state"][k], a["state"][k], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- end to end on a micro base

@pytest.fixture(scope="module")
def micro_base(tmp_path_factory):
    """A micro checkpoint saved like the tiny base (tokenizer with the chat template + acl_meta.json)."""
    from transformers import Qwen3ForCausalLM

    from acl.common import save_checkpoint
    from pretrain import model_config, train_tokenizer
    texts = ["What is 12+7? \\boxed{19}", "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"x\"}}</tool_call>",
             "Tomas Velder was born in Brimsk. <answer>Brimsk</answer>"] * 20
    tok = train_tokenizer(texts, vocab_size=400)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(model_config(tok, "micro", 512))
    out = str(tmp_path_factory.mktemp("runs") / "base")
    save_checkpoint(out, model, tok, dict(method="base", stage="base"))
    return out


FAST = ["--steps", "2", "--prompts", "2", "--group", "2", "--rft-prompts", "2", "--rft-samples", "2", "--eval-n", "2",
        "--max-tokens", "160", "--max-turn-tokens", "24", "--no-dynamic-sampling", "--save-every", "1", "--threads", "1"]


def run_cli(args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_seq.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_sequential_run_end_to_end_resume_and_skip(micro_base, tmp_path, monkeypatch, dead_tag):
    runs = str(tmp_path / "runs")
    args = ["--init", micro_base, "--runs", runs, "--curriculum", "math,search", *FAST]
    # a run killed in stage 2's GRPO (the 2nd update of search): stage 1 and the RFT checkpoint are whole
    calls = {"n": 0}
    real = train_seq.train_on

    def dying(model, opt, episodes, loss_fn, **kw):   # train_seq.train_on is GRPO's step (RFT's is in sft_epochs)
        if "search" in episodes[0].env:
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
        return real(model, opt, episodes, loss_fn, **kw)

    monkeypatch.setattr(train_seq, "train_on", dying)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(KeyboardInterrupt):
        train_seq.main(args)
    assert os.path.isfile(os.path.join(runs, "seq", "1-math", "acl_meta.json"))
    assert os.path.isfile(os.path.join(runs, "seq", "2-search-rft", "acl_meta.json"))
    assert os.path.isdir(os.path.join(runs, "seq", ".resume-2-search"))
    assert not os.path.exists(os.path.join(runs, "seq", "2-search"))
    assert os.path.isfile(os.path.join(runs, "eval", "inrun", "seq-1-math.json"))
    # the kill left a resume state with its recipe; what killed writes leave is removed at the next start
    assert os.path.isfile(os.path.join(runs, "seq", ".resume-2-search.json"))
    os.makedirs(os.path.join(runs, "seq", f".tmp-2-search-{dead_tag}-456"))
    os.makedirs(os.path.join(runs, "seq", f".resume-2-search.tmp-{dead_tag}"))   # a killed save leaves such a directory
    # restarted with another recipe for the killed stage only: its resume state is refused, before any work
    r = run_cli([*args, "--steps", "math=2,search=3"])
    assert r.returncode == 2 and "2-search" in r.stderr and "another recipe" in r.stderr
    # the same command again: skips stage 1, reuses the RFT checkpoint, resumes GRPO at step 1
    r = run_cli(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[seq/1-math] finished before, skipping" in r.stdout
    assert "rft: done before" in r.stdout
    assert "resumed at step 1" in r.stdout
    assert r.stdout.count("left by a killed run") == 2 and not [f for f in os.listdir(os.path.join(runs, "seq")) if "tmp" in f]
    meta = json.load(open(os.path.join(runs, "seq", "2-search", "acl_meta.json")))
    assert meta["stage"] == "search" and meta["curriculum_position"] == 2 and meta["method"] == "seq"
    assert meta["parent"] == os.path.abspath(os.path.join(runs, "seq", "1-math"))
    assert not os.path.exists(os.path.join(runs, "seq", ".resume-2-search"))
    # metrics.jsonl beside each stage: the resumed stage's steps each exactly once (the killed attempt's step 2, never
    # saved, is not kept twice)
    rows = [json.loads(x) for x in open(os.path.join(runs, "seq", "2-search.metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, meta["step"] + 1)), rows
    for r in rows:   # what a first-day run is watched by
        assert r["grad_norm"] >= 0 and r["entropy"] > 0 and r["response_tokens"] > 0 and 0 <= r["truncated"] <= 1, r
    res = json.load(open(os.path.join(runs, "eval", "inrun", "seq-2-search.json")))["benchmarks"]
    assert not os.path.exists(os.path.join(runs, "eval", "seq-2-search.json"))   # evaluate.py's name stays free
    assert {"math/test", "search/ood", "ecommerce/test", "if/ood"} <= set(res)
    # the checkpoint loads as a plain HF model
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(os.path.join(runs, "seq", "2-search"))
    # a third run does nothing; a changed recipe under the same --runs is refused
    r = run_cli(args)
    assert r.returncode == 0 and r.stdout.count("finished before, skipping") == 2
    r = run_cli(args + ["--lr", "1e-2"])
    assert r.returncode == 2 and "another recipe" in r.stderr
    # another curriculum before a finished stage, or another base: the stage's lineage differs, refused
    r = run_cli([*args[:4], "--curriculum", "if,search", *args[6:]])
    assert r.returncode == 2 and "2-search was made with another recipe or from another parent" in r.stderr
    other = os.path.join(os.path.dirname(micro_base), "base-copy")
    shutil.copytree(micro_base, other)
    r = run_cli(["--init", other, *args[2:]])
    assert r.returncode == 2 and "1-math was made with another recipe or from another parent" in r.stderr


def test_oracle_writes_oracle_dirs(micro_base, tmp_path):
    runs = str(tmp_path / "runs")
    r = run_cli(["--init", micro_base, "--runs", runs, "--curriculum", "if", "--oracle", *FAST, "--eval-n", "0",
                 "--kv-cache-gb", "0"])   # (no kept cache at all: every turn prefilled whole)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.load(open(os.path.join(runs, "oracle", "if", "acl_meta.json")))
    assert meta["method"] == "oracle" and meta["parent"] == os.path.abspath(micro_base)


def test_another_order_reuses_the_shared_prefix_instead_of_retraining_it(micro_base, tmp_path):
    """--reuse (the order runner): math,if then math,search --reuse: stage 1 is the same stage (the same init, budgets,
    seed, nothing before it), so it is copied whole, acl_meta.json included, and never retrained; stage 2 differs and
    is trained, from the copy. A stage after other stages, or with another seed, matches nothing."""
    study, order = str(tmp_path / "study"), str(tmp_path / "order")
    args = ["--init", micro_base, *FAST, "--steps", "1", "--eval-n", "0"]
    assert run_cli([*args, "--runs", study, "--curriculum", "math,if"]).returncode == 0
    r = run_cli([*args, "--runs", order, "--curriculum", "math,search", "--reuse", study])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[seq/1-math] the same stage is finished in" in r.stdout and "copied, not retrained" in r.stdout
    assert "[seq/1-math] step" not in r.stdout and "[seq/1-math] rft" not in r.stdout   # no cold start, no GRPO
    assert "[seq/2-search] step 1/1" in r.stdout
    for f in ("model.safetensors", "acl_meta.json"):
        assert open(os.path.join(order, "seq", "1-math", f), "rb").read() == \
            open(os.path.join(study, "seq", "1-math", f), "rb").read()
    meta = json.load(open(os.path.join(order, "seq", "2-search", "acl_meta.json")))
    assert meta["parent"] == os.path.abspath(os.path.join(order, "seq", "1-math")) and meta["curriculum"] == ["math", "search"]
    c = meta["cost"]   # the stage's cost for the report's cost table: its cold start's and GRPO's episodes and tokens
    assert c["episodes"] >= 2 * 2 and c["env_calls"] >= c["episodes"] and c["trained_tokens"] > c["sampled_tokens"] > 0
    r = run_cli([*args, "--runs", order, "--curriculum", "math,search", "--reuse", study])   # again: both finished here
    assert r.returncode == 0 and r.stdout.count("finished before, skipping") == 2 and "copied" not in r.stdout
    parse = lambda *extra: train_seq.check_args(train_seq.get_args([*args, "--runs", str(tmp_path / "x"), "--reuse",
                                                                     study, *extra]))
    assert train_seq.reused_stage(parse("--curriculum", "math"), 1, "math") == os.path.join(study, "seq", "1-math")
    assert train_seq.reused_stage(parse("--curriculum", "math", "--seed", "1"), 1, "math") is None
    assert train_seq.reused_stage(parse("--curriculum", "search,if"), 2, "if") is None   # after search, not math


@pytest.mark.parametrize("flags,msg", [(["--reuse", "nowhere"], "not a sequential run's directory"),
                                       (["--oracle", "--reuse", "."], "not --oracle")])
def test_bad_reuse_is_refused_in_one_line(micro_base, tmp_path, flags, msg, call):
    r = call(train_seq.main, ["--init", micro_base, "--runs", str(tmp_path / "r"), *flags])
    assert r.returncode == 2 and msg in r.stderr and not os.path.exists(tmp_path / "r")


def test_a_parent_replaced_in_place_makes_its_children_stale(micro_base, tmp_path):
    """Lineage by identity, not by path: the same command again skips every stage; a base rebuilt under the same path,
    or a stage 1 replaced under its own, and the stages made from the old one are refused in one line, before any
    work (never continued from, nor skipped as finished)."""
    base, runs = str(tmp_path / "base"), str(tmp_path / "runs")
    shutil.copytree(micro_base, base)
    args = ["--init", base, "--runs", runs, "--curriculum", "math,if", *FAST, "--steps", "1", "--eval-n", "0"]
    assert run_cli(args).returncode == 0
    r = run_cli(args)
    assert r.returncode == 0 and r.stdout.count("finished before, skipping") == 2, r.stderr[-2000:]

    def resave(ckpt):   # what a rebuild writes: the same kind of acl_meta.json, another save
        path = os.path.join(ckpt, "acl_meta.json")
        meta = json.load(open(path))
        json.dump(dict(meta, save_id="another", saved_at="2030-01-01T00:00:00"), open(path, "w"))
    resave(os.path.join(runs, "seq", "1-math"))
    r = run_cli(args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "2-if" in r.stderr and "another parent" in r.stderr
    resave(base)
    r = run_cli(args)
    assert r.returncode == 2 and "1-math" in r.stderr and "another parent" in r.stderr


def test_group_and_token_limits_per_domain(micro_base, tmp_path):
    """--group, --max-tokens and --max-turn-tokens per stage (the authors' math: group 16, 16k-token responses): each
    stage runs with its own value, its recipe records it, the engine is sized for the largest; the 8B preset says so."""
    a = train_seq.check_args(train_seq.get_args([
        "--init", micro_base, "--runs", str(tmp_path / "runs"), "--curriculum", "math,if", "--group", "math=4,if=2",
        "--max-tokens", "math=300,if=200", "--max-turn-tokens", "math=250,if=40"]))
    m, i = train_seq.stage_args(a, "math"), train_seq.stage_args(a, "if")
    assert (m.group, m.max_tokens, m.max_turn_tokens, i.group, i.max_tokens, i.max_turn_tokens) == (4, 300, 250, 2, 200, 40)
    rec = train_seq.recipe(a, "if")
    assert (rec["group"], rec["max_tokens"], rec["max_turn_tokens"]) == (2, 200, 40) and a.max_tokens == 300
    with pytest.raises(UsageError, match="--max-tokens > --max-turn-tokens"):
        train_seq.check_args(train_seq.get_args(["--init", micro_base, "--curriculum", "math,if", "--max-tokens",
                                                 "math=300,if=30", "--max-turn-tokens", "40"]))
    with pytest.raises(UsageError, match="--group must be >= 2"):
        train_seq.check_args(train_seq.get_args(["--init", micro_base, "--curriculum", "math,if", "--group",
                                                 "math=4,if=1"]))
    big = train_seq.get_args(["--preset", "qwen3-8b"])
    assert big.group.startswith("math=16") and big.max_turn_tokens.startswith("math=16384")


@pytest.mark.parametrize("bad, msg", [
    (["--curriculum", "math,serch"], "serch"),
    (["--curriculum", "math,math"], "distinct"),
    (["--init", "runs/nope/base"], "not found"),
    (["--group", "1"], "--group"),
    (["--clip-low", "1.5"], "--clip-low"),
    (["--steps", "math=3"], "search"),
    (["--dist-timeout", "0"], "--dist-timeout must be > 0"),
    (["--save-dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--threads", "-1"], "--threads must be >= 1"),
    (["--kv-cache-gb", "-1"], "--kv-cache-gb must be >= 0"),
    pytest.param(["--wandb", "aclarena"], "--wandb needs the wandb package",
                 marks=pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")),
])
def test_bad_input_stops_before_writing(micro_base, tmp_path, bad, msg, call):
    runs = str(tmp_path / "runs")
    args = ["--init", micro_base, "--runs", runs, "--curriculum", "math,search", *FAST] + bad
    r = call(train_seq.main, args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], r.stderr
    assert not os.path.exists(runs)


def test_bad_data_for_the_last_stage_refuses_before_the_first_trains(micro_base, tmp_path, call):
    runs = str(tmp_path / "runs")
    run_cli = lambda args: call(train_seq.main, args)   # noqa: E731  (in this process: no fresh Python per refusal)
    r = run_cli(["--init", micro_base, "--runs", runs, "--curriculum", "math,if", *FAST, "--if-data",
                 str(tmp_path / "missing.jsonl")])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and "if: " in r.stderr
    assert not os.path.exists(os.path.join(runs, "seq"))
    bad = tmp_path / "if.jsonl"   # an instruction id with no checker
    bad.write_text(json.dumps({"key": 1, "prompt": "Write.", "instruction_id_list": ["x:no_such_check"],
                               "kwargs": [{}]}) + "\n")
    r = run_cli(["--init", micro_base, "--runs", runs, "--curriculum", "math,if", *FAST, "--if-data", str(bad)])
    assert r.returncode == 2 and "no_such_check" in r.stderr and not os.path.exists(os.path.join(runs, "seq"))
    r = run_cli(["--init", micro_base, "--runs", runs, "--curriculum", "math", *FAST, "--lr", "-1e-3"])
    assert r.returncode == 2 and r.stderr.strip() == "error: --lr must be > 0"


@pytest.mark.parametrize("flag, name, content, reason", [
    ("--if-data", "if.jsonl", '{"key": 1, "prompt": "x", "instruction_id_list": [], "kwargs": []}\n{not json\n',
     "malformed JSON on line 2 of"),
    ("--math-data", "math.jsonl", '{"problem": "1+1", "answer": "2"}\n[1, 2]\n', "row 2 of"),
    ("--math-data", "math.parquet", "not a parquet file", "cannot load"),
    ("--if-data", "empty_dir", None, "no .jsonl/.json/.parquet/.csv files in"),
])
def test_a_malformed_data_file_stops_in_one_line(micro_base, tmp_path, flag, name, content, reason, call):
    """One line naming the file, the row when known, and the reason; the datasets library's progress bars and
    logged errors stay out of it."""
    path = tmp_path / name
    path.mkdir() if content is None else path.write_text(content)
    r = call(train_seq.main, ["--init", micro_base, "--runs", str(tmp_path / "runs"), "--curriculum", flag[2:-5], *FAST, flag,
                 str(path)])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and reason in r.stderr and name in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


def test_divergence_stops_saves_nothing_nonfinite_and_is_not_continued(micro_base, tmp_path, monkeypatch):
    """A huge learning rate (the micro base earns no reward, so every sample gets a made-up advantage of +-1); the
    finite blow-up guard is lifted so that the weights go non-finite after a resume state was saved."""
    from safetensors.torch import load_file
    monkeypatch.setattr(acl.step, "MAX_WEIGHT_CHANGE", float("inf"))
    runs = str(tmp_path / "runs")
    args = ["--init", micro_base, "--runs", runs, "--curriculum", "math", *FAST, "--steps", "4", "--lr", "1e30"]
    monkeypatch.setattr(train_seq, "group_advantages",
                        lambda eps, drop_flat=True: ({i: (-1.0) ** i for i in range(len(eps))}, set()))
    with pytest.raises(SystemExit) as e:
        train_seq.main(args)
    msg = str(e.value.code)
    assert msg.startswith("error: [seq/1-math] GRPO step ") and "non-finite" in msg and "\n" not in msg
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    states = []
    for d, _, files in os.walk(runs):   # nothing non-finite on disk: resume states (DCP) and checkpoints
        for f in files:
            p = os.path.join(d, f)
            if f == ".metadata":   # a resume state: its shards as one state dict
                states.append(d)
                dcp_to_torch_save(d, str(tmp_path / "state.pt"))
                tensors = torch.load(tmp_path / "state.pt", weights_only=False)["model"].values()
            else:
                tensors = load_file(p).values() if f.endswith(".safetensors") else []
            assert all(torch.isfinite(t).all() for t in tensors if t.is_floating_point()), p
    assert len(states) == 1   # the state saved before the divergence was read too
    r = run_cli(args)
    assert r.returncode == 2 and "diverged in an earlier run" in r.stderr


def test_a_finite_blow_up_stops_and_saves_nothing(tmp_path, tiny_agent):
    """lr 1e6: every weight finite, but up to 1e6 in size (it passed as a finished stage before): the first update
    changes the weights' norm by far more than MAX_WEIGHT_CHANGE, and the run stops in one line, saving nothing."""
    runs = str(tmp_path / "runs")   # the tiny agent: its math groups' rewards differ, so there is a gradient
    r = run_cli(["--init", tiny_agent, "--runs", runs, "--curriculum", "math", *FAST,
                 "--eval-n", "0", "--steps", "3", "--prompts", "8", "--group", "4", "--lr", "1e6"])
    last = r.stderr.strip().splitlines()[-1]   # (transformers' loading bars above it)
    assert r.returncode != 0 and last.startswith("error: [seq/1-math] GRPO step 1: ") and "a finite blow-up" in last
    assert not os.path.exists(os.path.join(runs, "seq", "1-math", "model.safetensors"))


@pytest.mark.slow
def test_a_kill_during_the_inrun_evaluation_is_redone_on_restart(micro_base, tmp_path, monkeypatch):
    runs = str(tmp_path / "runs")
    args = ["--init", micro_base, "--runs", runs, "--curriculum", "if", *FAST]

    def killed(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_seq, "evaluate_inrun", killed)
    with pytest.raises(KeyboardInterrupt):
        train_seq.main(args)
    assert os.path.isfile(os.path.join(runs, "seq", "1-if", "acl_meta.json"))
    assert not os.path.exists(os.path.join(runs, "eval", "inrun", "seq-1-if.json"))
    r = run_cli(args)
    assert r.returncode == 0 and "finished before" in r.stdout and "evaluating it now" in r.stdout
    assert os.path.isfile(os.path.join(runs, "eval", "inrun", "seq-1-if.json"))


def test_the_kl_reference_is_the_policy_after_the_cold_start(micro_base, tmp_path, monkeypatch):
    """--kl-coef on an agentic stage: the reference GRPO's KL pulls toward is the cold start's checkpoint (the authors'
    --ref-load is their SFT checkpoint), not the stage's parent (it was, and undid the cold start)."""
    from safetensors.torch import load_file
    runs, seen = str(tmp_path / "runs"), {}
    real = train_seq.grpo

    def grpo(policy, tok, backend, env, domain, a, stage_name, steps, resume_path, ref_model=None, **kw):
        seen["ref"] = {k: v.clone() for k, v in ref_model.state_dict().items()}
        return real(policy, tok, backend, env, domain, a, stage_name, steps, resume_path, ref_model, **kw)
    monkeypatch.setattr(train_seq, "grpo", grpo)
    train_seq.main(["--init", micro_base, "--runs", runs, "--curriculum", "search", *FAST, "--eval-n", "0",
                    "--kl-coef", "0.1", "--steps", "1", "--max-tokens", "1536", "--max-turn-tokens", "256"])
    rft = load_file(os.path.join(runs, "seq", "1-search-rft", "model.safetensors"))
    parent = load_file(os.path.join(micro_base, "model.safetensors"))
    assert any(not torch.equal(rft[k], parent[k]) for k in rft)          # the cold start moved the weights
    for k, v in rft.items():
        assert torch.equal(seen["ref"][k].to(v.dtype), v), k


def test_nan_loss_stops_and_keeps_last_good_checkpoint(micro_base, tmp_path, monkeypatch, capsys):
    runs = str(tmp_path / "runs")
    real = train_seq.grpo_loss

    def nan_on_search(logp, *a):
        out, stats = real(logp, *a)
        return (out * float("nan") if logp.size(1) > 0 and nan_on_search.stage == "search" else out), stats

    nan_on_search.stage = None
    real_stage = train_seq.run_stage

    def stage(i, domain, *a):
        nan_on_search.stage = domain
        return real_stage(i, domain, *a)

    monkeypatch.setattr(train_seq, "grpo_loss", nan_on_search)
    monkeypatch.setattr(train_seq, "run_stage", stage)
    with pytest.raises(SystemExit) as e:
        train_seq.main(["--init", micro_base, "--runs", runs, "--curriculum", "math,search", *FAST, "--eval-n", "0",
                        "--rft-prompts", "0"])
    assert "non-finite loss" in str(e.value.code) and "seq/1-math" in str(e.value.code)
    assert os.path.isfile(os.path.join(runs, "seq", "1-math", "acl_meta.json"))
    assert not os.path.exists(os.path.join(runs, "seq", "2-search"))


@pytest.mark.slow
def test_torchrun_two_ranks_four_stages_with_a_slow_writer(micro_base, tmp_path):
    """The README's torchrun line, the four stages under torchrun on 2 CPU ranks: FSDP2 policy, an hf engine per rank refreshed by the weight push, RFT,
    GRPO, the checkpoint gathered to rank 0, the evaluation on rank 0; every checkpoint write on rank 0 takes 4 s
    longer (tests/dist_slow_write.py), as at 8B, so rank 1 reaches the next stage's load (and GRPO after the cold
    start's save) long before rank 0 has written what it loads: it must wait (it died there before)."""
    runs = str(tmp_path / "runs")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "tests", "dist_slow_write.py"), "4", "--init", micro_base, "--runs", runs,
                        *FAST], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 process(es)" in r.stdout and all(f"[seq/{s}] step 2/2" in r.stdout for s in
                                               ("1-math", "2-search", "3-ecommerce", "4-if"))
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(os.path.join(runs, "seq", "2-search"))
    # rank 0's unsharded engine copy also scores the expert's episodes (the gold log-likelihood)
    rec = json.load(open(os.path.join(runs, "eval", "inrun", "seq-2-search.json")))
    assert all("gold" in b for b in rec["benchmarks"].values())


def test_weight_push_copies_every_parameter(micro):
    """push_weights: the engine's model ends up equal to the policy (here, two separate micro models)."""
    import copy

    from acl.engine import HFBackend, push_weights
    policy, tok = micro
    engine = copy.deepcopy(policy)
    with torch.no_grad():
        for p in engine.parameters():
            p.add_(1.0)
    backend = HFBackend(engine, tok)
    push_weights(backend, policy)
    for (n, p), (_, q) in zip(policy.named_parameters(), engine.named_parameters()):
        assert torch.equal(p, q), n
    push_weights(HFBackend(policy, tok), policy)   # the engine is the policy: nothing to do


def test_prompt_shared_logprobs_equal_full_sequence_teacher_forcing():
    """token_logprobs (one prompt pass per group, cache shared by its samples) = log-probs of each whole
    episode run alone, on every completion token."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=64,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    eps = _fixed_episodes()
    for i in range(1, len(eps), 2):   # groups of two: the odd episode takes its even neighbour's prompt
        eps[i].token_ids, eps[i].prompt_len = (eps[i - 1].token_ids[: eps[i - 1].prompt_len]
                                               + eps[i].token_ids[eps[i].prompt_len:]), eps[i - 1].prompt_len
        eps[i].loss_mask = [0] * eps[i].prompt_len + [1] * (len(eps[i].token_ids) - eps[i].prompt_len)
        eps[i].logprobs = [0.0] * len(eps[i].token_ids)
    b = acl.step.pack(eps, 0)
    assert b["p_ids"].size(0) == len(eps) // 2                     # one prompt row per group
    with torch.no_grad():
        lp = acl.step.token_logprobs(model, b)
        for j, e in enumerate(eps):
            ids = torch.tensor([e.token_ids])
            ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            n = len(e.token_ids) - e.prompt_len
            torch.testing.assert_close(lp[j, :n], ref[e.prompt_len - 1:], rtol=1e-4, atol=1e-5)


def test_rft_keeps_only_well_formed_tool_use():
    good = Episode("t", "search", "train", 0, [1], [1], [0.0], 0, reward=1.0,
                   messages=[{"role": "assistant", "content": '<tool_call>{"name": "search", "arguments": {}}</tool_call>'}])
    bad = Episode("t", "search", "train", 1, [1], [1], [0.0], 0, reward=1.0,
                  messages=[{"role": "assistant", "content": '<tool_call>{"name": "search", "argu</tool_call>'}])
    assert well_formed(good.messages) and not well_formed(bad.messages)


def test_selected_logprobs_chunked_equals_one_piece():
    """The chunked, checkpointed log-prob equals the one-piece cross-entropy, values and gradients."""
    from acl.step import selected_logprobs
    torch.manual_seed(0)
    x = torch.randn(3, 50, 97, requires_grad=True)
    y = torch.randint(0, 97, (3, 50))
    w = torch.arange(50.0)
    for temp in (1.0, 0.7):
        ref = -torch.nn.functional.cross_entropy((x / temp).transpose(1, 2), y, reduction="none")
        g_ref = torch.autograd.grad((ref * w).sum(), x)[0]
        got = selected_logprobs(x, y, temp, chunk_tokens=30)     # 10 positions per chunk: 5 chunks
        g_got = torch.autograd.grad((got * w).sum(), x)[0]
        assert torch.allclose(got, ref, atol=1e-5) and torch.allclose(g_got, g_ref, atol=1e-5)
    with torch.no_grad():   # the no-grad path (old log-probs, the reference model) chunks without checkpoints
        one_piece = -torch.nn.functional.cross_entropy(x.transpose(1, 2), y, reduction="none")
        assert torch.allclose(selected_logprobs(x, y, 1.0, chunk_tokens=30), one_piece, atol=1e-5)


def test_token_logprobs_same_with_activation_checkpointing(micro):
    """The activation-checkpointing path (prompt and completion as one sequence, logits kept for the completion
    only) gives the shared-prompt path's log-probs and gradients."""
    import copy

    from acl.common import checkpoint_activations, uses_activation_checkpointing
    model, tok = micro
    eps = [Episode("a", "math", "train", k, [5, 6, 7, 8] + c, [0] * 4 + [1] * len(c), [0.0] * (4 + len(c)), 4)
           for k, c in enumerate([[9, 10, 11], [12, 13], [14, 15, 16, 17]])]
    eps.append(Episode("b", "math", "train", 0, [20, 21] + [22, 23], [0, 0, 1, 1], [0.0] * 4, 2))
    b = acl.step.pack(eps, tok.pad_token_id)
    plain, ckpt = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    checkpoint_activations(ckpt)
    assert uses_activation_checkpointing(ckpt) and not uses_activation_checkpointing(plain)
    out = {}
    for name, m in (("plain", plain), ("ckpt", ckpt)):
        lp = acl.step.token_logprobs(m, b, temperature=0.8)
        (lp * b["mask"]).sum().backward()
        out[name] = (lp.detach() * b["mask"], [p.grad.clone() for p in m.parameters()])
    assert torch.allclose(out["plain"][0], out["ckpt"][0], atol=1e-5)
    assert all(torch.allclose(g1, g2, atol=1e-5) for g1, g2 in zip(out["plain"][1], out["ckpt"][1]))


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
    (["--cold-start", "math=self,search=expert,ecommerce=teacher,if=self"], "--cold-start takes expert or self"),
    (["--cold-start", "math=self,search=expert"], "--cold-start names no value for ecommerce"),
    (["--preset", "qwen3-8b", "--cold-start", "search=self,ecommerce=expert", "--dry-run", "--world-size", "8"],
     "needs --expert-data DIR \\(teacher rollouts of ecommerce\\)"),
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
                                                 "--kl-coef", "math=0.01,search=0,ecommerce=0.1,if=0",
                                                 "--rft-prompts", "math=0,search=8,ecommerce=8,if=8"]))
    s = train_seq.stage_args(a, "ecommerce")
    assert (s.lr, s.kl_coef) == (2e-4, 0.1)
    r = train_seq.recipe(a, "math")
    assert (r["lr"], r["kl_coef"], r["cold_start"]) == (1e-3, 0.01, None)     # math has no cold start
    assert train_seq.recipe(a, "search")["cold_start"] == "expert"             # the tiny preset's default


def test_the_cold_start_per_domain_reaches_each_stage_and_its_recipe(tmp_path, micro):
    """--cold-start search=self,ecommerce=expert (the authors' e-commerce SFT on teacher rollouts beside self-RFT):
    each stage gets its own, in its arguments and its recipe; a domain without a cold start needs none named."""
    from acl.common import save_checkpoint
    model, tok = micro
    save_checkpoint(str(tmp_path / "base"), model, tok, {"method": "base"})
    a = train_seq.check_args(train_seq.get_args(["--init", str(tmp_path / "base"), "--runs", str(tmp_path / "r"),
                                                 "--rft-prompts", "math=0,search=8,ecommerce=8,if=0",
                                                 "--cold-start", "search=self,ecommerce=expert"]))
    assert a.cold_start_by_domain == {"math": None, "search": "self", "ecommerce": "expert", "if": None}
    assert [train_seq.stage_args(a, d).cold_start for d in ("search", "ecommerce")] == ["self", "expert"]
    assert [train_seq.recipe(a, d)["cold_start"] for d in ("math", "search", "ecommerce", "if")] == [None, "self", "expert", None]
