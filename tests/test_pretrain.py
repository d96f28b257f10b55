"""pretrain.py end to end (micro size, seconds) and its bad-input handling."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "pretrain.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))


def test_build_base_end_to_end(tmp_path):
    out = tmp_path / "base"
    r = run("--out", str(out), "--size", "micro", "--steps", "30", "--n-docs", "40", "--vocab-size", "400",
            "--threads", "1", "--drill-steps", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "induction drill" not in r.stdout            # --drill-steps 0 turns the default drill off
    meta = json.loads((out / "acl_meta.json").read_text())
    assert meta["method"] == "base" and meta["step"] == 30 and meta["config"]["size"] == "micro"
    from pretrain import DEFAULT_MIX
    assert meta["config"]["mix"] == DEFAULT_MIX == {} and meta["config"]["drill_steps"] == 0   # the default mix
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]  # nothing half-written left
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from acl.engine import HFBackend
    from envs import make_env
    from envs.rollout import rollout
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    # digits are single tokens, the tool-call markers are single tokens
    assert len(tok("12345")["input_ids"]) == 5
    assert len(tok("<tool_call></tool_call>")["input_ids"]) == 2
    for d in ("math", "search", "ecommerce", "if"):
        env = make_env(d)
        eps = rollout(HFBackend(model, tok), tok, [(env, t) for t in env.tasks("test", n=2)], n_samples=1,
                      max_tokens=400, max_turn_tokens=24, seed=0)
        assert all(0.0 <= e.reward <= 1.0 for e in eps)


@pytest.mark.parametrize("args,msg", [
    (["--domains", "math,chess"], "unknown domain 'chess'"),
    (["--steps", "0"], "--steps"),
    (["--n-docs", "0"], "--n-docs"),
    (["--mix", "search=0"], "bad --mix item 'search=0'"),
    (["--mix", "chess=2"], "bad --mix item 'chess=2'"),
    (["--drill-steps", "-1"], "--drill-steps"),
])
def test_bad_flags_stop_before_writing(tmp_path, args, msg, call):
    import pretrain
    out = tmp_path / "base"
    r = call(pretrain.main, ["--out", str(out), *args])
    assert r.returncode != 0
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


def test_mix_weights_the_groups_a_step_draws():
    """pretrain draws each step's group with weight --mix (1 for groups not named); no mix: uniform."""
    import types

    from pretrain import pretrain

    class Recorder(torch.nn.Module):  # a stand-in model that records which group each step trained on
        def __init__(self):
            super().__init__()
            self.emb, self.config, self.seen = torch.nn.Embedding(4, 4), types.SimpleNamespace(pad_token_id=0), []

        def forward(self, input_ids, attention_mask):
            self.seen.append(int(input_ids[0, 0]))
            return types.SimpleNamespace(logits=self.emb(input_ids))

    rows = [(g, [i] * 3, [1] * 3) for i, g in enumerate(("math", "search", "generic"), 1) for _ in range(4)]
    share = {}
    for mix in (None, {"search": 3.0}):
        model = Recorder()
        pretrain(model, rows, steps=1500, batch_tokens=3, lr=1e-3, seed=0, log_every=10_000, mix=mix)
        share[bool(mix)] = model.seen.count(2) / len(model.seen)
    assert abs(share[False] - 1 / 3) < 0.05 and abs(share[True] - 3 / 5) < 0.05, share


def test_copy_rows_are_fresh_sequences_said_three_times():
    from pretrain import copy_rows
    rows = copy_rows(list(range(10, 500)), 50, seed=0)
    assert len({tuple(ids) for _, ids, _ in rows}) == 50
    for group, ids, mask in rows:
        L = len(ids) // 3
        assert group == "copy" and ids == ids[:L] * 3 and 8 <= L <= 48
        assert mask == [0] * L + [1] * (2 * L)          # no loss on the first copy: it is noise


@pytest.fixture(scope="module")
def drill_build(tmp_path_factory):
    """(checkpoint dir, finished process) of a micro build with the drill, made once for the tests below."""
    out = tmp_path_factory.mktemp("drill") / "base"
    r = run("--out", str(out), "--size", "micro", "--steps", "10", "--n-docs", "20", "--vocab-size", "400",
            "--threads", "1", "--drill-steps", "10", "--copy-docs", "30")
    assert r.returncode == 0, r.stderr[-2000:]
    return out, r


@pytest.mark.slow
def test_build_base_with_the_drill(drill_build):
    out, r = drill_build
    assert "induction drill: at most 12 rounds of 10 steps" in r.stdout
    meta = json.loads((out / "acl_meta.json").read_text())
    assert meta["config"]["drill_steps"] == 10 and meta["config"]["copy_docs"] == 30
    # 10 steps never form copying: twelve rounds ran, the build says so and records it (the base is still saved)
    assert "drill round 12 step    10/10" in r.stdout and "warning: the induction drill did not form copying" in r.stdout
    assert meta["drill_stopped_at"] == 120 and meta["drill_formed"] is False


def test_the_drill_goes_on_in_rounds_until_copying_forms(monkeypatch, tmp_path):
    """A drill round that ends at its cap is followed by a random restart: a fresh initialisation and fresh
    sequences (seed + 1000 r); the first round is exactly the one-round drill the committed base was built with (the
    same model, sequences and seed), and a round that forms copying ends the drill."""
    import pretrain as tiny
    calls, models = [], []

    def fake_pretrain(model, rows, steps, batch_tokens, lr, seed, stop_below=None, name="", **kw):
        if stop_below is None:            # the pre-training after the drill
            return [1.0] * steps
        calls.append((name, seed, rows[0]))
        models.append(model)
        formed = len(calls) == 2          # round 2 forms copying, after 7 steps
        return [0.1] * 7 if formed else [3.0] * steps

    real_copy_rows, drills = tiny.copy_rows, []
    monkeypatch.setattr(tiny, "copy_rows", lambda pool, n, seed: drills.append((pool, n, seed)) or real_copy_rows(pool, n, seed))
    monkeypatch.setattr(tiny, "pretrain", fake_pretrain)
    from acl import common
    monkeypatch.setattr(common, "save_checkpoint", lambda out, model, tok, meta: calls.append(("meta", meta)))
    tiny.build_base(str(tmp_path / "b"), steps=2, seed=5, size="micro", n_docs=5, vocab_size=400, threads=1,
                    drill_steps=20)
    names = [c[0] for c in calls[:-1]]
    assert names == ["drill", "drill round 2"] and [c[1] for c in calls[:-1]] == [5, 1005]
    (pool, n, s1), (pool2, _, s2) = drills
    assert pool == pool2 == list(range(10, pool[-1] + 1)) and n == 800 and (s1, s2) == (5, 1005)
    assert calls[0][2] == real_copy_rows(pool, 800, 5)[0] != calls[1][2] == real_copy_rows(pool, 800, 1005)[0]
    meta = calls[-1][1]
    assert meta["drill_stopped_at"] == 27 and meta["drill_formed"] is True
    # round 2 drilled a fresh model, initialised from seed + 1000, not round 1's
    a, b = (dict(m.named_parameters())["model.layers.0.mlp.up_proj.weight"] for m in models)
    assert models[0] is not models[1] and not torch.equal(a, b)


def test_a_drill_round_that_gives_up_is_the_same_computation_until_then():
    """give_up_at stops a round early without changing it: the schedule stays `steps` long, so its first steps are
    exactly those of the round that runs on (a round that forms copying before DRILL_PATIENCE is unchanged)."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    import pretrain as tiny
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-base"))
    rows = tiny.copy_rows(list(range(10, len(tok))), 200, 0)
    runs = []
    for give_up in (None, 4):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(tiny.model_config(tok, "micro", 256))
        runs.append(tiny.pretrain(model, rows, 10, 512, 1e-2, 0, stop_below=1e-6, give_up_at=give_up))
    assert len(runs[0]) == 10 and len(runs[1]) == 4 and runs[1] == runs[0][:4]
    assert tiny.DRILL_PATIENCE <= 3000 and tiny.DRILL_ROUNDS >= 2


def test_build_prints_progress_with_eta(drill_build):
    """Every phase of the build says where it is: a line per corpus domain, the tokenizer, the encoding, and
    step/steps with loss, lr, elapsed time and ETA for the drill (an upper bound: it may stop early) and the
    pre-training, each ending on its last step."""
    lines = drill_build[1].stdout.splitlines()
    assert [l.split(":")[0] for l in lines if l.startswith("corpus ")] == [f"corpus {i}/4" for i in range(1, 5)]
    assert any(re.fullmatch(r"tokenizer: 400 tokens \| \d+s elapsed", l) for l in lines), lines
    encode = [l for l in lines if l.startswith("encode ")]
    assert encode and all(re.fullmatch(r"encode \d+/80 documents \| \d+s elapsed, ETA \d+s", l) for l in encode)
    assert encode[-1].startswith("encode 80/80 ")         # 4 domains x 20 knowledge documents
    for name, eta in (("drill", "<="), ("pre-train", "")):
        steps = [re.fullmatch(rf"{name} step +(\d+)/10 \| loss \d+\.\d{{4}} \| lr \S+ \| \d+s elapsed, ETA {eta}\d+s", l)
                 for l in lines if l.startswith(f"{name} step")]
        assert steps and all(steps) and int(steps[-1].group(1)) == 10, lines
    order = [next(i for i, l in enumerate(lines) if l.startswith(p)) for p in
             ("corpus 1/4", "tokenizer:", "encode ", "induction drill:", "drill step", "pre-training:", "pre-train step",
              "saved ")]
    assert order == sorted(order), lines


def test_progress_every_five_percent_with_eta(capsys, monkeypatch):
    """pretrain prints about every 5% of its steps (not every step), the mean loss since the previous line,
    and an ETA at the rate so far; printing draws no random numbers (the same losses with any log_every)."""
    import types

    import pretrain as tiny

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.config = torch.nn.Embedding(4, 4), types.SimpleNamespace(pad_token_id=0)

        def forward(self, input_ids, attention_mask):
            return types.SimpleNamespace(logits=self.emb(input_ids))

    rows = [(g, [i] * 3, [1] * 3) for i, g in enumerate(("math", "search"), 1) for _ in range(4)]
    losses = tiny.pretrain(Tiny(), rows, steps=200, batch_tokens=3, lr=1e-3, seed=0)
    lines = capsys.readouterr().out.splitlines()
    assert [int(l.split()[2].split("/")[0]) for l in lines] == list(range(10, 201, 10))
    assert float(lines[1].split("| loss ")[1].split()[0]) == pytest.approx(sum(losses[10:20]) / 10, abs=1e-4)
    assert tiny.pretrain(Tiny(), rows, steps=200, batch_tokens=3, lr=1e-3, seed=0, log_every=7) == losses
    clock = iter([100.0, 110.0])
    monkeypatch.setattr(tiny.time, "time", lambda: next(clock))
    t0 = tiny.time.time()
    from acl import common
    monkeypatch.setattr(common.time, "time", lambda: 110.0)
    assert common.eta(t0, 25, 75) == "10s elapsed, ETA 30s" and common.eta(t0, 25, 75, at_most=True).endswith("<=30s")


def test_the_corpus_is_plain_text_and_the_protocol_stays_compact():
    """No pre-training document holds the agent protocol (PROTOCOL_MARKERS), and every domain's by-the-book episode
    (the scripted expert's, which the cold start trains on) fits the tiny limits with room to spare under the
    tokenizer, which has read the protocol's text: a by-the-book e-commerce episode is ~1,000-1,230 tokens; the old
    limit of 1,024 truncated most of them (a perfect policy scored 0 on every exchange task)."""
    from envs import DOMAINS, make_env
    from envs.base import PROTOCOL_MARKERS
    from envs.rollout import MAX_TOKENS, MAX_TURN_TOKENS, expert_episodes
    from pretrain import build_corpus, corpus_tokenizer
    docs = build_corpus(60, 0)
    assert {d for d, _ in docs} == set(DOMAINS)
    assert not [t for _, t in docs if any(m in t for m in PROTOCOL_MARKERS)]
    tok = corpus_tokenizer(docs, 1024)
    assert len(tok("\\boxed{")["input_ids"]) <= 3
    for d in DOMAINS:
        env = make_env(d)
        for e in expert_episodes(tok, env, env.tasks("train", n=60, seed=3)):
            assert e.reward == 1.0 and len(e.token_ids) <= 0.9 * MAX_TOKENS, (d, len(e.token_ids))
            for m in e.messages:
                if m["role"] == "assistant":
                    assert len(tok(m["content"])["input_ids"]) < MAX_TURN_TOKENS, (d, m["content"])


def test_the_committed_reference_base_is_current():
    """assets/tiny-base, the reference base arena.sh starts from, was built by the code here: its recorded
    fingerprint (pretrain.build_fingerprint: the corpus, the settings and the building code) is today's.
    When this fails, the code that builds the base has changed: rebuild it with
        python pretrain.py --out assets/tiny-base --overwrite
    and redo the README's tiny tables from the new base."""
    from acl.common import read_meta
    from pretrain import build_corpus, build_fingerprint
    meta = read_meta(os.path.join(ROOT, "assets", "tiny-base"))
    assert meta.get("method") == "base" and meta.get("fingerprint"), "assets/tiny-base is missing or has no fingerprint"
    cfg = meta["config"]
    docs = build_corpus(cfg["n_docs"], meta["seed"], cfg["domains"] or None)
    assert build_fingerprint(docs, dict(cfg, seed=meta["seed"])) == meta["fingerprint"], \
        "assets/tiny-base is stale: python pretrain.py --out assets/tiny-base --overwrite"


def test_the_fingerprint_sees_the_corpus_the_settings_and_the_code(monkeypatch):
    import pretrain as tiny
    docs = tiny.build_corpus(5, 0, ["math"])
    cfg = dict(steps=3000, seed=0)
    ref = tiny.build_fingerprint(docs, cfg)
    assert tiny.build_fingerprint(docs, cfg) == ref
    assert tiny.build_fingerprint(docs, dict(cfg, steps=2999)) != ref
    other = [(g, x.replace("2", "3")) for g, x in docs]
    assert tiny.build_fingerprint(other, cfg) != ref
    monkeypatch.setattr(tiny, "DRILL_DONE", 0.4)
    assert tiny.build_fingerprint(docs, cfg) != ref
