"""mle.py: the hf backend samples with the live adapter (its log-probs are the trainer's), per-sample adapters in one
batch equal each sample alone, LoRA under FSDP2 on 2 CPU ranks = one process, and end to end on the tiny base: experts
saved as peft directories, the backbone and a finished expert left bit-identical by training another, a killed expert
resumed to the same weights, the merged export equal to backbone + adapter, evaluate.py routing by tag and by the
learned router, bad input and missing experts refused with one line, and the 8B dry run with LoRA."""
import argparse
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import mle
import train_seq
from acl import routing
from acl.common import load_policy
from acl.engine import HFBackend
from acl.step import episode_logprobs
from envs import make_env
from envs.base import UsageError
from envs.rollout import ChatML, rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny-base")
ENV1 = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def lora(rank=4):
    return argparse.Namespace(lora_rank=rank, lora_alpha=2 * rank, lora_dropout=0.0, lora_targets=list(mle.TARGETS))


def random_expert(model, seed):
    """The model with a fresh adapter whose B is random, so the adapter changes what the model does."""
    g = torch.Generator().manual_seed(seed)
    m = mle.with_adapter(copy.deepcopy(model), lora())
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, tok = load_policy(TINY, "cpu")
    return model.eval(), tok


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# ----------------------------------------------------------------------------- the pieces

def test_the_hf_backend_samples_with_the_live_adapter(tiny):
    """During training the engine is the policy itself: rollouts (adapters None) sample with the adapter being trained,
    and their sampling log-probs are the trainer's; switched off, the adapter would give other ones."""
    model, tok = tiny
    policy = random_expert(model, 0)
    env = make_env("math")
    eps = rollout(HFBackend(policy, tok), tok, [(env, t) for t in env.tasks("test")[:4]], 2, seed=0, max_tokens=200)
    trainer = episode_logprobs(policy, eps, micro_batch=8)
    backbone = episode_logprobs(mle.AdapterOff(policy), eps, micro_batch=8)
    worst, off = 0.0, 0.0
    for e, lp, lb in zip(eps, trainer, backbone):
        m = torch.tensor(e.loss_mask[e.prompt_len:], dtype=torch.bool)
        sampled = torch.tensor(e.logprobs[e.prompt_len:])
        worst = max(worst, (sampled[m] - lp[m]).abs().max().item())
        off = max(off, (sampled[m] - lb[m]).abs().max().item())
    # measured: 1.9e-5 at most over every sampled token, as for the same model without an adapter (1.8e-5: the
    # sampler's and the trainer's float32 log-softmax); the adapter switched off is 3 nats away
    assert worst < 1e-4 and off > 1e-2, (worst, off)


def test_per_sample_adapters_in_one_batch_equal_each_sample_alone(tiny, tmp_path):
    model, tok = tiny
    dirs = []
    for s in (1, 2):
        d = str(tmp_path / f"a.{s}")          # a dot in the path: peft adapter names may not hold one
        random_expert(model, s).save_pretrained(d)
        dirs.append(d)
    chat, env = ChatML(tok), make_env("math")
    prompts = [chat.prompt(env.reset(t).messages, t.tools) for t in env.tasks("test")[:4]]
    which = [dirs[0], dirs[1], None, dirs[0]]
    backend = HFBackend(copy.deepcopy(model), tok)
    together = backend.generate(prompts, 12, 0.0, chat.stop_ids, adapters=which)
    for p, a, g in zip(prompts, which, together):
        alone = HFBackend(copy.deepcopy(model), tok).generate([p], 12, 0.0, chat.stop_ids, adapters=[a])[0]
        assert g.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    plain = HFBackend(copy.deepcopy(model), tok).generate(prompts, 12, 0.0, chat.stop_ids)
    assert together[2].token_ids == plain[2].token_ids          # None: the base weights, no adapter left on
    assert [g.logprobs for g in together[:2]] != [g.logprobs for g in plain[:2]]
    after = backend.generate(prompts[:1], 12, 0.0, chat.stop_ids, adapters=[None])[0]
    assert after.token_ids == plain[0].token_ids


def test_an_adapters_first_use_does_not_move_the_sampling_stream(tiny, tmp_path):
    """peft draws a new adapter's initial weights from torch's RNG before loading the saved ones: a rollout seeded
    before an adapter's first use must sample what it samples once the adapter is loaded (found when MLE's learned
    router had used the IF expert earlier in an evaluation than tag routing had: 46 of 300 IF scores moved)."""
    model, tok = tiny
    d = str(tmp_path / "expert")
    random_expert(model, 3).save_pretrained(d)
    env = make_env("math")
    items = [(env, t) for t in env.tasks("test")[:6]]
    fresh = HFBackend(copy.deepcopy(model), tok)
    warm = HFBackend(copy.deepcopy(model), tok)
    warm.generate([[1, 2, 3]], 2, 1.0, [0], adapters=[d])
    a = rollout(fresh, tok, items, 2, seed=0, max_tokens=200, adapters=[d] * len(items))
    b = rollout(warm, tok, items, 2, seed=0, max_tokens=200, adapters=[d] * len(items))
    assert [e.token_ids for e in a] == [e.token_ids for e in b]


def test_the_hf_backend_keeps_a_bounded_number_of_adapters_loaded(tiny, tmp_path):
    """--router-mix can make up to 1,771 blends: cycling through MAX_ADAPTERS + 3 adapter directories, the hf backend
    never holds more than MAX_ADAPTERS loaded (the least recently used unloaded); an adapter used again after it was
    unloaded gives the log-probs it gave before, and reloading it moves no sampling stream (a seeded sample equals a
    fresh backend's)."""
    from acl.engine import MAX_ADAPTERS
    model, tok = tiny
    dirs = []
    for s in range(MAX_ADAPTERS + 3):
        dirs.append(str(tmp_path / f"a{s}"))
        random_expert(model, s).save_pretrained(dirs[-1])
    chat, env = ChatML(tok), make_env("math")
    prompt = chat.prompt(env.reset(env.tasks("test")[0]).messages, None)
    backend, seen = HFBackend(copy.deepcopy(model), tok), []
    for d in dirs + dirs[:3]:
        seen.append(backend.generate([prompt], 8, 0.0, chat.stop_ids, adapters=[d])[0].logprobs)
        assert len(backend.model.peft_config) <= MAX_ADAPTERS, len(backend.model.peft_config)
    assert seen[-3:] == seen[:3] and len(set(map(tuple, seen[:len(dirs)]))) == len(dirs)   # reloaded: the same
    assert dirs[1] in backend.adapter_names and dirs[3] not in backend.adapter_names   # dirs[1]: unloaded, then back
    fresh = HFBackend(copy.deepcopy(model), tok)
    torch.manual_seed(5)
    again = backend.generate([prompt] * 2, 8, 1.0, chat.stop_ids, adapters=[dirs[4]] * 2)
    torch.manual_seed(5)
    first = fresh.generate([prompt] * 2, 8, 1.0, chat.stop_ids, adapters=[dirs[4]] * 2)
    assert [(g.token_ids, g.logprobs) for g in again] == [(g.token_ids, g.logprobs) for g in first]


@pytest.mark.slow
def test_fsdp2_lora_two_cpu_ranks_match_one_process(tmp_path):
    """One GRPO update of an expert (adapter only, AdamW, k3 KL to the adapter-disabled model) under torchrun with 2
    ranks (FSDP2 over the peft model, gloo) = the same update in one process; the frozen weights do not move."""
    import dist_grpo
    a, b = dist_grpo.one_and_two_ranks(tmp_path, "3", "2", "token", "lora")
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert any("lora_A" in k for k in a["state"])
    for k in a["state"]:
        torch.testing.assert_close(b["state"][k], a["state"][k], rtol=1e-5, atol=1e-6)


def test_dry_run_qwen3_8b_with_lora_counts_the_adapter_and_a_frozen_backbone(capsys):
    a = mle.check_args(mle.get_args(["--preset", "qwen3-8b", "--dry-run", "--world-size", "8"]))
    from acl.scale import dry_run
    out = dry_run(a, "Qwen/Qwen3-8B-Base", 8, a.micro_batch, a.max_tokens,
                  lora=dict(rank=16, targets=list(mle.TARGETS.values())))
    assert out["n_lora"] == 43_646_976                       # peft's count for Qwen3-8B, rank 16, all seven projections
    assert out["memory"]["backbone (frozen) + adapter w+g+adam"] == 4 * max(out["per_rank"]) + 16 * 43_646_976 // 8
    assert out["memory"]["reference model"] == 0 and out["fits"]
    assert "43.6M trainable parameters" in capsys.readouterr().out


# ----------------------------------------------------------------------------- end to end on the tiny base

FAST = ["--backbone", TINY, "--domains", "math,search", "--steps", "3", "--prompts", "2", "--group", "2",
        "--no-dynamic-sampling", "--save-every", "1", "--max-tokens", "512", "--threads", "1"]


def run(args, script="mle.py"):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=ENV1)


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """One MLE run of two experts with the learned router and the merged export."""
    out = str(tmp_path_factory.mktemp("mle") / "runs" / "mle")
    before = sha(os.path.join(TINY, "model.safetensors"))
    r = run([*FAST, "--out", out, "--router", "learned", "--router-prompts", "8", "--router-steps", "50",
             "--export", "merged"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert sha(os.path.join(TINY, "model.safetensors")) == before
    return out, r.stdout


def test_experts_are_peft_directories_with_their_sizes(done):
    from peft import PeftModel
    out, stdout = done
    meta = json.load(open(os.path.join(out, "acl_meta.json")))
    assert meta["method"] == "mle" and meta["finished"] and set(meta["expert_summary"]) == {"math", "search"}
    assert 0 <= meta["router_accuracy"]["test"] <= 1 and "learned router: train accuracy" in stdout
    model, _ = load_policy(TINY, "cpu")
    n_lora = sum(p.numel() for n, p in PeftModel.from_pretrained(model, os.path.join(out, "experts", "math"))
                 .named_parameters() if "lora_" in n)
    for d in ("math", "search"):
        e = json.load(open(os.path.join(out, "experts", d, "acl_meta.json")))
        assert e["trainable_params"] == n_lora and e["adapter_bytes"] > 4 * n_lora
        assert e["recipe"]["lora"]["rank"] == 16 and e["recipe"]["init"] == os.path.abspath(TINY)
        assert f"[mle/{d}] step 3/3" in stdout


def test_the_merged_export_equals_backbone_plus_adapter(done):
    from peft import PeftModel
    out, _ = done
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])
    for d in ("math", "search"):
        base, _ = load_policy(TINY, "cpu")
        want = PeftModel.from_pretrained(base, os.path.join(out, "experts", d)).eval()(input_ids=ids).logits
        merged, _ = load_policy(os.path.join(out + "-merged", d), "cpu")
        # folding B A into W rounds otherwise than adding x A B: fp32 differences of ~1e-5 (seen 1.2e-5); a wrong fold
        # (scaling, transposition, a missed module) differs by orders of magnitude more
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, want, atol=1e-4, rtol=1e-5)
        assert json.load(open(os.path.join(out + "-merged", d, "acl_meta.json")))["method"] == "mle-merged"


def test_training_another_expert_leaves_the_backbone_and_a_finished_expert_bit_identical(done, tmp_path):
    out, _ = done
    copy_ = str(tmp_path / "runs" / "mle")
    shutil.copytree(out, copy_)
    shutil.rmtree(os.path.join(copy_, "experts", "search"))
    math_before = sha(os.path.join(copy_, "experts", "math", "adapter_model.safetensors"))
    r = run([*FAST, "--out", copy_])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[mle/math] finished before, skipping" in r.stdout and "[mle/search] step 3/3" in r.stdout
    assert sha(os.path.join(copy_, "experts", "math", "adapter_model.safetensors")) == math_before
    # the same recipe, the same seed: the retrained expert is the first run's, bit for bit
    assert sha(os.path.join(copy_, "experts", "search", "adapter_model.safetensors")) == \
        sha(os.path.join(out, "experts", "search", "adapter_model.safetensors"))


def test_a_rerun_that_trains_nothing_rewrites_nothing(done, tmp_path):
    """The same command again (arena.sh restarted): every expert is finished, so the router and the merged exports
    are kept and no file is written, and the evaluations made after them (evaluate.py --resume) stay valid."""
    out, _ = done
    copy_ = str(tmp_path / "runs" / "mle")
    shutil.copytree(out, copy_)
    shutil.copytree(out + "-merged", copy_ + "-merged")
    stamp = {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for top in (copy_, copy_ + "-merged")
             for d, _, fs in os.walk(top) for f in fs}
    r = run([*FAST, "--out", copy_, "--router", "learned", "--router-prompts", "8", "--router-steps", "50",
             "--export", "merged"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "router.pt kept" in r.stdout and r.stdout.count("kept (made from") == 2, r.stdout[-2000:]
    assert {p: os.path.getmtime(p) for p in stamp} == stamp
    r = run([*FAST, "--out", copy_, "--router", "learned", "--router-prompts", "9", "--router-steps", "50"])
    assert r.returncode == 0 and "learned router: train accuracy" in r.stdout   # other router settings: fitted again


def test_a_backbone_replaced_in_place_makes_the_experts_stale(tmp_path):
    """sdft.py --overwrite, then arena.sh: the experts, router and exports trained on the old backbone are not kept
    ("finished before") under the new one of the same path: refused in one line before any work."""
    bb, out = tmp_path / "sdft", str(tmp_path / "mle")
    shutil.copytree(TINY, bb)
    args = [*FAST, "--backbone", str(bb), "--domains", "math", "--steps", "1", "--out", out]
    assert run(args).returncode == 0
    assert "finished before" in run(args).stdout
    meta = json.loads((bb / "acl_meta.json").read_text())
    (bb / "acl_meta.json").write_text(json.dumps(dict(meta, save_id="another")))   # what a re-save writes
    r = run(args)
    assert r.returncode == 2 and "since replaced" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    top = json.loads(open(os.path.join(out, "acl_meta.json")).read())   # without the top's record (an MLE made
    top.pop("backbone_id")                                               # before it), the expert's own refuses
    open(os.path.join(out, "acl_meta.json"), "w").write(json.dumps(top))
    r = run(args)
    assert r.returncode == 2 and "experts/math" in r.stderr and "another parent" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_killed_expert_resumes_to_the_same_weights(done, tmp_path, monkeypatch):
    out, _ = done
    killed = str(tmp_path / "runs" / "mle")
    calls = {"n": 0}
    real = train_seq.train_on

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(train_seq, "train_on", dying)
    args = [x if x != "math,search" else "math" for x in FAST]
    with pytest.raises(KeyboardInterrupt):
        mle.main([*args, "--out", killed])
    assert os.path.isdir(os.path.join(killed, "experts", ".resume-math"))
    assert not os.path.exists(os.path.join(killed, "experts", "math"))
    r = run([*args, "--out", killed])
    assert r.returncode == 0 and "[mle/math] resumed at step 2" in r.stdout, r.stderr[-3000:]
    name = "adapter_model.safetensors"
    assert sha(os.path.join(killed, "experts", "math", name)) == sha(os.path.join(out, "experts", "math", name))


def test_evaluate_routes_by_tag_and_by_the_learned_routers(done, tmp_path):
    """Tag routing, the learned router and the request router (no tag, system prompt or tools: router-request.pt,
    fit beside router.pt): each record names its router and which expert served each task (routed_to)."""
    out, _ = done
    assert os.path.isfile(os.path.join(out, "router-request.pt"))
    assert "router_accuracy_request" in json.load(open(os.path.join(out, "acl_meta.json")))
    for router, name in (("tag", "mle.json"), ("learned", "mle-learned.json"), ("request", "mle-request.json")):
        r = run(["--ckpt", out, "--router", router, "--domains", "math,search", "--splits", "test", "--n", "3",
                 "--threads", "1", "--out-dir", str(tmp_path)], script="evaluate.py")
        assert r.returncode == 0, r.stderr[-3000:]
        rec = json.load(open(tmp_path / name))
        assert rec["router"] == router and set(rec["experts"]) == {"math", "search"}
        b = rec["benchmarks"]["math/test"]
        assert b["n"] == 3 and "gold" in b and len(b["routed_to"]) == 3 and set(b["routed_to"]) <= {"math", "search"}
        assert router != "tag" or b["routed_to"] == ["math"] * 3


def test_a_router_reuses_the_tag_records_benchmarks_it_routes_alike_and_samples_the_rest(done, tmp_path):
    """evaluate.py --router learned beside the tag-routed record of the same MLE directory (arena.sh evaluates it
    first): a benchmark whose every task goes to the expert the tag chose is copied (reused_from), and equals a fresh
    evaluation with nothing to reuse, per task and gold; one routed otherwise (here a tag record edited to disagree
    on search) is sampled anew; a tag record of other settings is not used."""
    out, _ = done
    args = ["--ckpt", out, "--domains", "math,search", "--splits", "test", "--n", "3", "--threads", "1"]
    fresh, beside = tmp_path / "fresh", tmp_path / "beside"
    for router, d in (("learned", fresh), ("tag", beside)):
        r = run([*args, "--router", router, "--out-dir", str(d)], script="evaluate.py")
        assert r.returncode == 0, r.stderr[-3000:]
    tag_path = beside / "mle.json"
    tag = json.load(open(tag_path))
    want = json.load(open(fresh / "mle-learned.json"))["benchmarks"]
    agree = [b for b in want if want[b]["routed_to"] == tag["benchmarks"][b]["routed_to"]]
    assert "math/test" in agree   # the tiny learned router sends these math tasks to the math expert
    tag["benchmarks"]["search/test"]["routed_to"] = ["nowhere"] * 3   # as if the tag had routed search elsewhere
    tag_path.write_text(json.dumps(tag))
    r = run([*args, "--router", "learned", "--out-dir", str(beside)], script="evaluate.py")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.load(open(beside / "mle-learned.json"))["benchmarks"]
    for b in want:
        reused = b in agree and b != "search/test"
        assert (got[b].get("reused_from") == "mle") == reused, b
        assert got[b]["per_task"] == want[b]["per_task"] and got[b]["gold"] == want[b]["gold"], b
    # other settings (--n 2): nothing reused
    other = tmp_path / "other"
    for router in ("tag", "learned"):
        n2 = [*args[:-4], "--n", "2", "--threads", "1"] if router == "learned" else [*args]
        r = run([*n2, "--router", router, "--out-dir", str(other)], script="evaluate.py")
        assert r.returncode == 0, r.stderr[-3000:]
    assert not any("reused_from" in b for b in json.load(open(other / "mle-learned.json"))["benchmarks"].values())


def test_the_request_router_never_sees_the_tag_system_prompt_or_tools(tiny):
    """What the request router reads of a task with a system prompt naming its domain, the search tool and its tag is
    exactly what it reads of the same request that never had them; the learned router's input differs."""
    import dataclasses
    model, tok = tiny
    env = make_env("search")
    task = env.tasks("test")[0]
    assert task.tools and any(m["role"] == "system" for m in task.messages)
    bare = dataclasses.replace(task, env="unknown", tools=None, messages=[m for m in task.messages if m["role"] == "user"])
    request = routing.prompt_features(model, tok, [(env, task), (env, bare)], request=True)
    assert torch.equal(request[0], request[1])
    full = routing.prompt_features(model, tok, [(env, task), (env, bare)])
    assert not torch.allclose(full[0], full[1])
    assert routing.request_messages(task.messages) == [{"role": "user", "content": bare.messages[0]["content"]}]


class Payload:
    """A pickle that would create a file when unpickled without weights_only."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def test_a_router_file_with_a_pickled_payload_is_refused(done, tmp_path):
    import shutil

    from envs.base import UsageError
    out, _ = done
    crafted = str(tmp_path / "mle")
    shutil.copytree(out, crafted)
    marker = str(tmp_path / "pwned")
    torch.save({"dim": 8, "domains": ["math"], "state": Payload(marker)}, os.path.join(crafted, "router.pt"))
    with pytest.raises(UsageError, match="is not a router this project saved"):
        routing.router(crafted, "learned", object())
    assert not os.path.exists(marker)


def test_a_task_whose_tag_has_no_expert_and_a_missing_expert_fail_with_one_line(done, tmp_path):
    out, _ = done
    _, tok = load_policy(TINY, "cpu")
    route = routing.router(out, "tag", tok)
    math, eco = make_env("math"), make_env("ecommerce")
    assert route(math, math.tasks("test")[0]).endswith(os.path.join("experts", "math"))
    with pytest.raises(UsageError, match="no expert for the tag 'ecommerce'"):
        route(eco, eco.tasks("test")[0])
    broken = str(tmp_path / "runs" / "mle")
    shutil.copytree(out, broken)
    os.remove(os.path.join(broken, "experts", "search", "adapter_config.json"))
    r = run(["--ckpt", broken, "--domains", "math", "--n", "2", "--out-dir", str(tmp_path / "eval")],
            script="evaluate.py")
    assert r.returncode == 2 and "the search expert is missing" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "eval")
    os.remove(os.path.join(broken, "router.pt"))
    r = run(["--ckpt", broken, "--router", "learned", "--out-dir", str(tmp_path / "eval")], script="evaluate.py")
    assert r.returncode == 2 and not os.path.exists(tmp_path / "eval")


@pytest.mark.parametrize("bad, msg", [(["--lora-targets", "q,qq"], "--lora-targets: unknown qq"),
                                      (["--lora-rank", "0"], "--lora-rank must be >= 1"),
                                      (["--backbone", "/nonexistent/sdft"], "--backbone checkpoint not found"),
                                      (["--domains", "math,cooking"], "cooking")])
def test_bad_input_stops_with_one_line_before_anything_is_written(tmp_path, bad, msg, call):
    out = str(tmp_path / "runs" / "mle")
    args = [*FAST, "--out", out]
    for flag in bad[::2]:
        if flag in args:
            i = args.index(flag)
            del args[i: i + 2]
    r = call(mle.main, [*args, *bad])
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "runs")


def test_a_router_mix_blend_is_the_weighted_sum_of_the_experts_updates(done, tmp_path):
    """--router-mix: a blend of 0.52 / 0.49 (rounded to 0.05: one half each) gives the logits of the backbone plus half
    of each expert's merged update; a near one-hot blend is the expert itself; evaluate.py runs with it."""
    from peft import PeftModel
    out, _ = done
    experts = routing.experts_of(out)
    blends = routing.Blends(TINY, experts)
    path = blends({"math": 0.52, "search": 0.49})
    assert blends({"math": 0.99, "search": 0.01}) == experts["math"] and blends({"math": 0.5, "search": 0.5}) == path
    base, _ = load_policy(TINY, "cpu")
    sd0 = {k: v.clone() for k, v in base.state_dict().items()}
    manual = {k: v.clone() for k, v in sd0.items()}
    for e in experts.values():
        m, _ = load_policy(TINY, "cpu")
        merged = PeftModel.from_pretrained(m, e).merge_and_unload().state_dict()
        for k in manual:
            manual[k] += 0.5 * (merged[k] - sd0[k])
    base.load_state_dict(manual)
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])
    m, _ = load_policy(TINY, "cpu")
    got = PeftModel.from_pretrained(m, path).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, base.eval()(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    r = run(["--ckpt", out, "--router", "learned", "--router-mix", "--domains", "math", "--splits", "test", "--n", "2",
             "--threads", "1", "--out-dir", str(tmp_path)], script="evaluate.py")
    assert r.returncode == 0 and json.load(open(tmp_path / "mle-learned-mix.json"))["router_mix"], r.stderr[-3000:]
    r = run(["--ckpt", out, "--router-mix", "--out-dir", str(tmp_path / "x")], script="evaluate.py")
    assert r.returncode == 2 and "--router learned" in r.stderr and not os.path.exists(tmp_path / "x")


@pytest.mark.slow
def test_torchrun_two_ranks_train_and_save_an_expert(tmp_path):
    """Two CPU ranks (gloo): the peft model sharded with FSDP2, each rank sampling with its own unsharded copy of
    the backbone + adapter, refreshed by the adapter-only push after every update; the expert is saved once."""
    out = str(tmp_path / "runs" / "mle")
    args = [x if x != "math,search" else "math" for x in FAST]
    del args[args.index("--threads"): args.index("--threads") + 2]
    args[args.index("--steps") + 1] = "2"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "mle.py"), *args, "--out", out], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=ENV1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 process(es)" in r.stdout and "[mle/math] step 2/2" in r.stdout
    from peft import PeftModel
    model, _ = load_policy(TINY, "cpu")
    PeftModel.from_pretrained(model, os.path.join(out, "experts", "math"))
    assert not os.path.exists(os.path.join(out, "experts", "math.live"))


# ----------------------------------------------------------------------------- --continual (issue 42)

@pytest.mark.slow
def test_continual_mle_refreshes_the_backbone_keeps_or_refits_old_experts_and_equals_one_shot_after_one_domain(
        tmp_path):
    """mle.py --continual on math then search, from a pool of the expert's episodes: a backbone per arriving domain
    (SDFT on the pools seen so far, from the previous one), the new expert trained on it, the old expert carried
    unchanged (kept) and, in the -refit directory, trained on from its previous fit; after k = 1 it is one-shot MLE on
    one domain from that backbone, weight for weight; a rerun trains nothing."""
    from safetensors.torch import load_file

    import sdft
    from acl.common import identity, tokenizer_hash
    from envs.rollout import expert_episodes
    _, tok = load_policy(TINY, "cpu")
    records = {}
    for d in ("math", "search"):
        env = make_env(d)
        tasks = env.tasks("train", n=4)
        records[d] = [sdft.pool_record(e, t, pass_rate=1.0) for e, t in zip(expert_episodes(tok, env, tasks), tasks)]
    pool = str(tmp_path / "runs" / "sdft-pool")
    sdft.write_pool(pool, records, dict(format=sdft.POOL_FORMAT, domains=list(records), funnel={},
                                        tokenizer=tokenizer_hash(TINY)))
    out = str(tmp_path / "runs" / "mle-continual")
    args = ["--continual", "--runs", str(tmp_path / "runs"), "--student", TINY, "--domains", "math,search",
            "--steps", "2", "--prompts", "2", "--group", "2", "--no-dynamic-sampling", "--max-tokens", "512",
            "--threads", "1", "--refit-steps", "1", "--refresh-epochs", "1", "--refresh-batch", "4"]
    r = run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    adapter = lambda *p: load_file(os.path.join(out, *p, "adapter_model.safetensors"))   # noqa: E731
    for k, d in ((1, "math"), (2, "search")):
        meta = json.load(open(os.path.join(out, "backbone", f"{k}-{d}", "acl_meta.json")))
        assert meta["method"] == "sdft" and meta["recipe"]["domains"] == ["math", "search"][:k]
        assert meta["parent"] == os.path.abspath(TINY if k == 1 else os.path.join(out, "backbone", "1-math"))
    top = json.load(open(os.path.join(out, "2-search", "acl_meta.json")))
    assert top["format"] == routing.FORMAT and top["backbone"] == os.path.abspath(os.path.join(out, "backbone", "2-search"))
    kept, first = adapter("2-search", "experts", "math"), adapter("1-math", "experts", "math")
    assert all(torch.equal(kept[n], first[n]) for n in first)            # kept: the old expert as it was
    # re-fitted: one GRPO step on the new backbone from the old expert (at this toy size every group's rewards are
    # equal, so the step moves nothing: with_adapter's init is tested apart)
    rmeta = json.load(open(os.path.join(out, "2-search-refit", "experts", "math", "acl_meta.json")))
    assert rmeta["recipe"]["steps"] == 1 and rmeta["parent"] == os.path.abspath(os.path.join(out, "backbone", "2-search"))
    assert rmeta["recipe"]["init_adapter_id"] == identity(os.path.join(out, "1-math", "experts", "math"))
    assert "[mle-continual/2-search-refit/experts/math] step 1/1" in r.stdout
    assert all(torch.equal(a, b) for a, b in zip(adapter("2-search", "experts", "search").values(),
                                                 adapter("2-search-refit", "experts", "search").values()))
    # after k = 1: one-shot MLE on math from the first backbone gives the same expert
    one = str(tmp_path / "runs" / "mle-one")
    r1 = run(["--backbone", os.path.join(out, "backbone", "1-math"), "--domains", "math", "--out", one, *args[7:-6]])
    assert r1.returncode == 0, r1.stderr[-3000:]
    shot = load_file(os.path.join(one, "experts", "math", "adapter_model.safetensors"))
    assert set(shot) == set(first) and all(torch.equal(shot[n], first[n]) for n in first)
    # both MLE directories of step 2 are served by evaluate.py (tag routing) on the domains seen
    ev = subprocess.run([sys.executable, "evaluate.py", "--ckpt", os.path.join(out, "2-search"),
                         os.path.join(out, "2-search-refit"), "--domains", "math,search", "--splits", "test", "--n", "2",
                         "--out-dir", str(tmp_path / "eval"), "--max-tokens", "512", "--threads", "1"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV1)
    assert ev.returncode == 0, ev.stderr[-3000:]
    again = run(args)
    assert again.returncode == 0 and "step 1/" not in again.stdout, again.stdout[-3000:]
    assert again.stdout.count("finished before, skipping") == 3 and again.stdout.count("nothing to do") == 2


def test_an_expert_trained_on_from_a_saved_adapter_starts_at_it_and_trains_it(tiny, tmp_path):
    """with_adapter(init=DIR), --continual's re-fit: the adapter saved there, on another backbone, its weights loaded
    as they were and trainable (the backbone frozen)."""
    model, _ = tiny
    saved = random_expert(model, 3)
    saved.save_pretrained(str(tmp_path / "e"))
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    m = mle.with_adapter(other, lora(), init=str(tmp_path / "e"))
    want = dict(saved.named_parameters())
    got = {n: p for n, p in m.named_parameters() if "lora_" in n}
    assert got and all(torch.equal(p, want[n]) and p.requires_grad for n, p in got.items())
    assert not any(p.requires_grad for n, p in m.named_parameters() if "lora_" not in n)
