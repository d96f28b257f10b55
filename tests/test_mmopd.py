"""mmopd.py: the loss against brute force (the top-q forward KL, the reverse KL and their gradients), the entropy
gate, teacher routing (each domain's episodes reach its own teacher; a missing teacher fails before training),
masking, the chunked teacher scoring against the one-piece computation, and end to end: a tiny run, the same run
killed and restarted (same weights), bad input, two torchrun ranks, the 8B dry run with four teachers."""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import mmopd
from acl.step import pack, teacher_pass, teacher_scores, train_on
from envs import make_env
from envs.rollout import ReplayBackend, rollout
from mmopd import route_to_teachers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny-base")
ENV1 = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def loss_args(**kw):
    a = dict(gate_entropy="full", alpha=0.5, rkl_gate=False, rkl_coef=1.0, clip_low=0.2, clip_high=0.28, tis_cap=2.0,
             domains=["math"])
    return argparse.Namespace(**(a | kw))


def teacher_extras(t_logits, q):
    """What route_to_teachers hands the loss for teacher logits (B, T, V): its log-prob tables."""
    lz = torch.log_softmax(t_logits, -1)
    top_lp, top_ids = lz.topk(q, -1)
    return lz, dict(t_ent=-(lz.exp() * lz).sum(-1), t_top_lp=top_lp, t_top_ids=top_ids)


# ----------------------------------------------------------------------------- the loss against brute force

def test_forward_kl_over_the_top_q_equals_brute_force_values_and_gradients():
    torch.manual_seed(0)
    V, q, beta = 7, 3, 0.3
    s_logits = torch.randn(1, 2, V, requires_grad=True)
    t_lz, x = teacher_extras(torch.randn(1, 2, V) * 3, q)
    y = torch.tensor([[1, 4]])
    ls = torch.log_softmax(s_logits, -1)
    logp = ls.gather(-1, y[..., None]).squeeze(-1)
    x |= dict(t_lp=t_lz.gather(-1, y[..., None]).squeeze(-1), t_top_ids_logp=ls.gather(-1, x["t_top_ids"]),
              dom=torch.zeros(1, 1))
    b = dict(mask=torch.ones(1, 2), slp=logp.detach())
    a = loss_args(alpha=0.0)                         # every position gated
    loss, _ = mmopd.mmopd_loss(logp, b, x, a, beta)
    # brute force, token by token: the teacher's and the student's distributions over the teacher's top-q ids
    fkl = []
    for t in range(2):
        ids = x["t_top_ids"][0, t].tolist()
        pt = torch.stack([t_lz[0, t, i].exp() for i in ids])
        ps = torch.stack([ls[0, t, i].exp() for i in ids])
        pt, ps = pt / pt.sum(), ps / ps.sum()
        fkl.append(sum(pt[k] * (torch.log(pt[k]) - torch.log(ps[k])) for k in range(q)))
    fkl = torch.stack(fkl)
    rkl_k1 = logp.detach()[0] - x["t_lp"][0]         # the surrogate's value at ratio 1: the sampled token's log-ratio
    assert torch.allclose(loss[0], rkl_k1 + beta * fkl, atol=1e-5)
    g, = torch.autograd.grad(loss.sum(), s_logits, retain_graph=True)
    # the surrogate's gradient at ratio 1 is -A grad log p = (log p_old - log p_T) grad log p
    g_ref, = torch.autograd.grad((beta * fkl).sum() + (rkl_k1 * logp[0]).sum(), s_logits)
    assert torch.allclose(g, g_ref, atol=1e-5)


def test_the_reverse_kl_advantage_is_the_exact_reverse_kl_and_its_gradient_in_expectation():
    """Every token of a V-token vocabulary as its own one-position episode, weighted by the student's probability of
    sampling it: the surrogate's value is KL(student || teacher) and its gradient the exact KL's gradient."""
    torch.manual_seed(1)
    V = 6
    s_logits = torch.randn(V, requires_grad=True)
    t_lz = torch.log_softmax(torch.randn(V) * 2, -1)
    ls = torch.log_softmax(s_logits, -1)
    logp = ls[:, None]                                              # (B=V, T=1): episode y sampled token y
    _, x = teacher_extras(t_lz.expand(V, 1, V).clone(), 2)
    x |= dict(t_lp=t_lz[:, None], t_top_ids_logp=ls.expand(V, V).gather(-1, x["t_top_ids"][:, 0])[:, None],
              dom=torch.zeros(V, 1))
    b = dict(mask=torch.ones(V, 1), slp=logp.detach())
    loss, _ = mmopd.mmopd_loss(logp, b, x, loss_args(alpha=1e9), 0.0)   # no position gated: reverse KL only
    w = ls.exp().detach()
    exact = (ls.exp() * (ls - t_lz)).sum()
    assert torch.allclose((w * loss[:, 0]).sum(), exact.detach(), atol=1e-6)
    g, = torch.autograd.grad((w * loss[:, 0]).sum(), s_logits, retain_graph=True)
    g_exact, = torch.autograd.grad(exact, s_logits)
    assert torch.allclose(g, g_exact, atol=1e-6)


def test_the_gate_selects_exactly_the_positions_above_alpha_under_both_entropies():
    torch.manual_seed(2)
    V, q = 50, 4
    scale = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0, 8.0])            # flat ... peaked teachers
    t_lz, x = teacher_extras(torch.randn(1, 6, V) * scale[None, :, None], q)
    logp = torch.zeros(1, 6, requires_grad=True)
    x |= dict(t_lp=torch.zeros(1, 6), t_top_ids_logp=torch.zeros(1, 6, q), dom=torch.zeros(1, 1))
    b = dict(mask=torch.ones(1, 6), slp=torch.zeros(1, 6))
    pt = torch.softmax(x["t_top_lp"], -1)
    h_topq = -(pt * pt.log()).sum(-1)
    h_raw = -(x["t_top_lp"].exp() * x["t_top_lp"]).sum(-1)            # the top-q's terms of the full sum
    for which, h in [("full", x["t_ent"]), ("topq", h_topq), ("topq-raw", h_raw)]:
        for alpha in (0.3, 1.0, 2.5):
            _, st = mmopd.mmopd_loss(logp, b, x, loss_args(gate_entropy=which, alpha=alpha), 0.1)
            assert torch.equal(st["gate@math"], (h > alpha).float()), (which, alpha)
    assert (h_topq <= x["t_ent"] + 1e-6).all() and (h_raw <= x["t_ent"] + 1e-6).all()   # both lower bounds
    _, st = mmopd.mmopd_loss(logp, b, x, loss_args(alpha=1.0), 0.1)
    assert torch.equal(st["disagree@math"], ((x["t_ent"] > 1.0) != (h_topq > 1.0)).float())
    # --rkl-gate: the reverse-KL term only where the teacher is sure
    x["t_lp"] = torch.full((1, 6), -1.0)
    loss, st = mmopd.mmopd_loss(logp, b, x, loss_args(alpha=1.0, rkl_gate=True), 0.0)
    assert torch.allclose(loss, (1 - st["gate@math"]) * 1.0)
    # --rkl-coef scales the reverse-KL advantage (the released opd_kl_coef 0.5)
    half, _ = mmopd.mmopd_loss(logp, b, x, loss_args(alpha=1.0, rkl_gate=True, rkl_coef=0.5), 0.0)
    assert torch.allclose(half, 0.5 * loss)


def test_fkl_coefficient_warms_up_linearly():
    a = argparse.Namespace(fkl_start=0.05, fkl_coef=0.2, fkl_warmup=40)
    assert mmopd.fkl_coef_at(a, 1) == pytest.approx(0.05) and mmopd.fkl_coef_at(a, 21) == pytest.approx(0.125)
    assert mmopd.fkl_coef_at(a, 41) == pytest.approx(0.2) and mmopd.fkl_coef_at(a, 400) == pytest.approx(0.2)


# ----------------------------------------------------------------------------- teachers on real models

@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(TINY)


def micro(tok, path, seed):
    from transformers import Qwen3ForCausalLM

    from acl.common import save_checkpoint
    from pretrain import model_config
    torch.manual_seed(seed)
    save_checkpoint(path, Qwen3ForCausalLM(model_config(tok, "micro", 2048)), tok, dict(method="base", stage="base"))
    return path


@pytest.fixture(scope="module")
def models(tok, tmp_path_factory):
    """Three micro Qwen3s with the tiny tokenizer: a student and two teachers that differ."""
    d = tmp_path_factory.mktemp("models")
    return {k: micro(tok, str(d / k), s) for k, s in [("student", 0), ("t_math", 1), ("t_search", 2)]}


def episodes(tok):
    """Replayed episodes of two domains (search with a tool result in the middle: masked tokens)."""
    out = []
    for d in ("math", "search"):
        env = make_env(d)
        for task in env.tasks("train", n=2):
            out += rollout(ReplayBackend(tok, env.expert(task)), tok, [(env, task)], 1, max_tokens=4000,
                           max_turn_tokens=2000)
    return out


def test_each_domain_reaches_its_own_teacher_and_a_missing_one_fails(tok, models):
    from acl.common import load_policy
    eps = episodes(tok)
    tm, _ = load_policy(models["t_math"], "cpu")
    ts, _ = load_policy(models["t_search"], "cpu")
    routed = route_to_teachers(dict(math=tm, search=ts), eps, micro_batch=3, q=5)
    by_math = teacher_scores(tm, eps, micro_batch=3, q=5)
    by_search = teacher_scores(ts, eps, micro_batch=3, q=5)
    for e, r, m, s in zip(eps, routed, by_math, by_search):
        own, other = (m, s) if e.env == "math" else (s, m)
        assert torch.allclose(r["lp"], own["lp"], atol=1e-5) and torch.equal(r["top_ids"], own["top_ids"])
        assert not torch.allclose(r["lp"], other["lp"], atol=1e-3)
    with pytest.raises(KeyError, match="no teacher for search"):
        route_to_teachers(dict(math=tm), eps, micro_batch=3, q=5)


def test_chunked_teacher_scoring_equals_the_one_piece_computation(tok, models):
    from acl.common import load_policy
    tm, _ = load_policy(models["t_math"], "cpu")
    b = pack(episodes(tok), 0)
    whole = teacher_pass(tm, b, q=6, chunk_tokens=10**9)
    chunked = teacher_pass(tm, b, q=6, chunk_tokens=7)
    ids = torch.cat([b["p_ids"][b["rows"]], b["c_ids"]], 1)
    attn = torch.cat([b["p_attn"][b["rows"]], b["c_attn"]], 1)
    with torch.no_grad():
        logits = tm(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    lz = torch.log_softmax(logits[:, b["p_ids"].size(1) - 1: -1].float(), -1)
    ref = dict(lp=lz.gather(-1, b["c_ids"][..., None]).squeeze(-1), ent=-(lz.exp() * lz).sum(-1),
               top_lp=lz.topk(6, -1).values)
    for k in ("lp", "ent", "top_lp"):
        assert torch.allclose(whole[k], ref[k], atol=1e-5) and torch.allclose(chunked[k], ref[k], atol=1e-5), k
    assert torch.equal(whole["top_ids"], chunked["top_ids"])


def test_a_failing_teacher_drops_its_episodes(tok, models):
    from acl.common import load_policy
    eps = episodes(tok)
    bad, _ = load_policy(models["t_search"], "cpu")
    with torch.no_grad():
        bad.model.norm.weight.fill_(float("nan"))
    scores = teacher_scores(bad, eps, micro_batch=4, q=3)
    assert all(s is None for s in scores)


def test_masked_tokens_contribute_nothing_to_the_loss_or_the_gradient(tok, models):
    """Garbage teacher scores on the tool-result tokens (mask 0) leave the loss and every gradient unchanged."""
    from acl.common import load_policy
    eps = [e for e in episodes(tok) if e.env == "search"]
    assert any(0 in e.loss_mask[e.prompt_len:] for e in eps)
    tm, _ = load_policy(models["t_search"], "cpu")
    scores = teacher_scores(tm, eps, micro_batch=4, q=4)
    a = loss_args(alpha=0.3, domains=["search"])

    def step(poison):
        model, _ = load_policy(models["student"], "cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        x = dict(t_lp=[], t_ent=[], t_top_lp=[], t_top_ids=[], dom=[0] * len(eps))
        for e, s in zip(eps, scores):
            off = torch.tensor(e.loss_mask[e.prompt_len:]) == 0
            lp, ent, top = s["lp"].clone(), s["ent"].clone(), s["top_lp"].clone()
            if poison:
                lp[off], ent[off], top[off] = 50.0, 9.0, 3.0
            x["t_lp"].append(lp)
            x["t_ent"].append(ent)
            x["t_top_lp"].append(top)
            x["t_top_ids"].append(s["top_ids"])
        loss, _ = train_on(model, opt, eps, lambda lp, b, x: mmopd.mmopd_loss(lp, b, x, a, 0.2), micro_batch=8,
                           extras=x, gather="t_top_ids")
        return loss, [p.grad.clone() for p in model.parameters()]
    (l0, g0), (l1, g1) = step(False), step(True)
    assert l0 == pytest.approx(l1, abs=1e-6) and all(torch.allclose(u, v, atol=1e-7) for u, v in zip(g0, g1))


# ----------------------------------------------------------------------------- end to end

def run(args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "mmopd.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=ENV1)


def base_args(models, tmp_path):
    return ["--runs", str(tmp_path / "runs"), "--domains", "math,search", "--student", models["student"],
            "--teachers", f"math={models['t_math']},search={models['t_search']}", "--prompts", "2", "--group", "2",
            "--steps", "4", "--save-every", "2", "--max-turn-tokens", "48", "--max-tokens", "1200", "--threads", "1",
            "--micro-batch", "4"]


@pytest.mark.slow
def test_a_tiny_run_is_scored_by_evaluate_and_a_killed_run_resumes_to_the_same_weights(models, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    args = base_args(models, tmp_path)
    whole = str(tmp_path / "whole")
    r = run([*args, "--out", whole])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[mmopd] step 4/4" in r.stdout and "    math      rkl" in r.stdout and "    search    rkl" in r.stdout
    meta = json.load(open(os.path.join(whole, "acl_meta.json")))
    assert meta["method"] == "mmopd" and len(meta["history"]) == 4
    assert set(meta["teachers"]) == {"math", "search"} and set(meta["history"][-1]["domains"]) == {"math", "search"}
    h = meta["history"][0]["domains"]["math"]
    assert h["rkl"] > 0 and 0 <= h["gate"] <= 1 and h["dropped"] == 0 and h["t_ent"] > 0
    ev = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--ckpt", whole, "--suite", "tiny",
                         "--domains", "math", "--splits", "test", "--n", "2", "--no-gold", "--threads", "1",
                         "--out-dir", str(tmp_path / "eval")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env=ENV1)
    assert ev.returncode == 0 and os.listdir(tmp_path / "eval"), ev.stderr[-3000:]
    png = str(tmp_path / "kl.png")
    import report
    report.main(["--mmopd-kl", whole, "--out", png])
    assert os.path.getsize(png) > 1000
    # killed in its 3rd step (after the resume state of step 2), restarted with the same command
    killed = str(tmp_path / "killed")
    calls = {"n": 0}
    real = mmopd.train_on

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(mmopd, "train_on", dying)
    with pytest.raises(KeyboardInterrupt):
        mmopd.main([*args, "--out", killed])
    assert os.path.isdir(os.path.join(str(tmp_path), ".resume-killed")) and not os.path.exists(killed)
    r = run([*args, "--out", killed])
    assert r.returncode == 0 and "resumed at step 2" in r.stdout, r.stderr[-3000:]
    a, b = load_file(os.path.join(whole, "model.safetensors")), load_file(os.path.join(killed, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(os.path.join(killed, "acl_meta.json")))["history"] == meta["history"]
    rows = [json.loads(x) for x in open(killed + ".metrics.jsonl")]   # each step once, though step 3 ran twice
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all("domains" in r and "gen_tok_s" in r for r in rows)
    r = run([*args, "--out", whole])
    assert r.returncode == 0 and "nothing to do" in r.stdout
    r = run([*args, "--out", whole, "--lr", "1e-3"])
    assert r.returncode == 2 and "another recipe" in r.stderr and "--overwrite" in r.stderr


def test_bad_input_stops_with_one_line_before_anything_is_written(models, tok, tmp_path, call):
    args = base_args(models, tmp_path)
    runs = str(tmp_path / "runs")

    def refused(extra, *needles, base=args):
        r = call(mmopd.main, [*base, "--out", str(tmp_path / "out"), *extra])
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
        assert all(n in r.stderr for n in needles), r.stderr
        assert not os.path.exists(runs) and not os.path.exists(tmp_path / "out")

    refused(["--teachers", f"math={models['t_math']}"], "no teacher for search")
    refused(["--teachers", "oracle"], "no teacher for math", "train_seq.py --oracle")
    refused(["--top-q", str(len(tok) + 1)], "larger than the vocabulary")
    refused(["--alpha", "-0.1"], "--alpha must be >= 0")
    refused(["--domains", "math,chess"], "unknown domain 'chess'")
    refused(["--teachers", f"math={models['t_math']},search={models['t_search']},chess=x"], "unknown domain 'chess'")
    from transformers import Qwen3ForCausalLM

    from acl.common import save_checkpoint
    from pretrain import model_config, train_tokenizer
    other_tok = train_tokenizer(["What is 1+1? \\boxed{2}"] * 20, vocab_size=300)
    other = str(tmp_path / "other")
    save_checkpoint(other, Qwen3ForCausalLM(model_config(other_tok, "micro", 256)), other_tok, dict(method="base"))
    refused(["--teachers", f"math={models['t_math']},search={other}"], "search teacher", "another tokenizer")
    cfg = model_config(tok, "micro", 2048)
    cfg.vocab_size += 8                      # the same tokenizer, a padded vocabulary
    wide = str(tmp_path / "wide")
    save_checkpoint(wide, Qwen3ForCausalLM(cfg), tok, dict(method="base"))
    refused(["--teachers", f"math={wide},search={models['t_search']}"], "math teacher", "vocabulary of")


@pytest.mark.slow
def test_torchrun_two_ranks_route_score_and_train(models, tmp_path):
    """Two CPU ranks (gloo, FSDP2): student and teachers sharded, every rank visits every teacher (stand-in passes
    where it holds none of a domain's episodes), the checkpoint is saved once."""
    args = base_args(models, tmp_path)
    args[args.index("--steps") + 1] = "2"
    args[args.index("--prompts") + 1] = "3"          # 3 prompts on 2 ranks: one rank holds one domain only
    args = [x for x in args if x not in ("--threads", "1")]
    out = str(tmp_path / "dist")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "mmopd.py"), *args, "--out", out], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=ENV1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 process(es)" in r.stdout and "[mmopd] step 2/2" in r.stdout
    assert len(json.load(open(os.path.join(out, "acl_meta.json")))["history"]) == 2


def test_dry_run_qwen3_8b_counts_the_four_teachers(capsys):
    a = mmopd.check_args(mmopd.get_args(["--preset", "qwen3-8b", "--dry-run", "--world-size", "8"]))
    from acl.scale import dry_run
    on = dry_run(a, a.arch, 8, a.micro_batch, a.max_tokens, teachers=4)
    off = dry_run(a, a.arch, 8, a.micro_batch, a.max_tokens, teachers=4, teacher_offload=True)
    key = "teachers (4, compute-dtype shards)"
    assert on["memory"][key] == 4 * 2 * max(on["per_rank"]) and off["memory"][key] == 0
    assert on["fits"] and "(host) teachers, offloaded" in capsys.readouterr().out
    r = run(["--preset", "qwen3-8b", "--dry-run"])
    assert r.returncode == 0 and "teachers (4, compute-dtype shards)" in r.stdout, r.stderr[-2000:]


def test_a_teacher_that_fails_drops_and_counts_its_episodes_and_all_failing_stops_the_run(models, tok, tmp_path):
    """A teacher whose scores are not finite: its domain's episodes are dropped and counted (never scored by the
    student instead); when every teacher fails, the run stops before it trains or writes anything."""
    from acl.common import load_policy, save_checkpoint
    m, _ = load_policy(models["t_search"], "cpu")
    with torch.no_grad():
        m.model.norm.weight.fill_(float("nan"))
    nan = str(tmp_path / "nan")
    save_checkpoint(nan, m, tok, dict(method="base"))
    args = base_args(models, tmp_path)
    args[args.index("--steps") + 1] = "1"
    out = str(tmp_path / "half")
    r = run([*args, "--teachers", f"math={models['t_math']},search={nan}", "--out", out])
    assert r.returncode == 0, r.stderr[-3000:]
    h = json.load(open(os.path.join(out, "acl_meta.json")))["history"][0]
    assert h["dropped"] == dict(math=0, search=2) and h["domains"]["math"]["dropped"] == 0 and "search" not in h["domains"]
    assert "search    no episode scored | dropped 2" in r.stdout
    out = str(tmp_path / "none")
    r = run([*args, "--teachers", f"math={nan},search={nan}", "--out", out])
    assert r.returncode == 1 and "every episode of step 1 was dropped" in r.stderr, r.stderr[-3000:]
    assert not os.path.exists(out)


def test_the_default_student_is_the_recorded_seq_final(tmp_path):
    """--domains math,search,ecommerce (the authors' three-teacher run) distils into Seq-Final, the last stage of the
    four-stage curriculum the sequential run recorded, never silently into Seq-Ecom."""
    curriculum = ["math", "search", "ecommerce", "if"]
    for i, d in enumerate(curriculum, 1):
        (tmp_path / "seq" / f"{i}-{d}").mkdir(parents=True)
        (tmp_path / "seq" / f"{i}-{d}" / "acl_meta.json").write_text(json.dumps(dict(method="seq", curriculum=curriculum)))
    assert mmopd.seq_final(str(tmp_path), ["math", "search", "ecommerce"]) == str(tmp_path / "seq" / "4-if")
    assert mmopd.seq_final(str(tmp_path / "none"), ["math", "search"]) == str(tmp_path / "none" / "seq" / "2-search")
