"""evaluate.py: the accuracy matrix by hand, evaluate_model on the micro model and scripted backends, the CLI end to
end on a fake runs/ layout, bad input, and the full suite on local fixtures in the real formats (no network)."""
import copy
import json
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch
from fake_http import JSONServer
from test_env_ecommerce import MOCK_TASKS, write_mock, write_tau2

import evaluate
from acl import forgetting
from acl.common import save_checkpoint
from envs.base import UsageError
from envs.rollout import Generation

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- the accuracy matrix


def test_save_results_is_atomic(tmp_path):
    path = str(tmp_path / "eval" / "base.json")
    evaluate.save_results(path, {"math/test": {"mean": 0.5}})
    assert forgetting.load_results(path) == {"math/test": {"mean": 0.5}} and os.listdir(tmp_path / "eval") == ["base.json"]


# ----------------------------------------------------------------------------- evaluate_model

class TokBackend:
    """A rollout backend that answers each prompt with reply(prompt_text) -> str, ending the turn with <|im_end|>."""

    def __init__(self, tok, reply):
        self.tok, self.reply = tok, reply
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, max_new_tokens, temperature, stop_ids):
        self.temperatures = getattr(self, "temperatures", set()) | {temperature}
        out = []
        for p in prompts:
            ids = self.tok(self.reply(self.tok.decode(p)), add_special_tokens=False)["input_ids"] + [self.eos]
            out.append(Generation(ids, [0.0] * len(ids), True))
        return out


def coin_math(text):
    """Right with probability 1/2 (torch's RNG, so the rollout seed decides), else a wrong answer."""
    a, op, b = re.findall(r"What is (\d+)([-+*])(\d+)\?", text)[-1]
    value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    return f"\\boxed{{{value if torch.rand(1).item() < 0.5 else -1}}}"


def test_evaluate_model_on_the_micro_model(micro):
    model, tok = micro
    model.train()  # evaluation must not leave a training model in eval mode
    try:
        res = evaluate.evaluate_model(model, tok, domains=("math", "if"), splits=("test", "ood"), n=3,
                                      max_turn_tokens=12, batch=8)
        assert model.training
    finally:
        model.eval()
    assert list(res) == ["math/test", "math/ood", "if/test", "if/ood"]
    for r in res.values():
        assert {"mean", "std", "n", "k", "seeds", "per_seed", "metrics"} <= set(r)
        assert (r["n"], r["k"], r["seeds"], r["std"]) == (3, 1, 1, 0.0) and 0.0 <= r["mean"] <= 1.0
    assert {"acc", "boxed"} <= set(res["math/test"]["metrics"])
    assert {"prompt_strict", "inst_strict"} <= set(res["if/ood"]["metrics"])


def test_seeds_std_reproducibility_and_rng(micro):
    _, tok = micro
    backend = TokBackend(tok, coin_math)
    tasks = evaluate.load_benchmarks("tiny", ["math"], ["test"], n=40)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    res = evaluate.evaluate_model(None, tok, seeds=2, tasks=tasks, backend=backend)["math/test"]
    assert torch.equal(torch.rand(3), want)  # the caller's random stream is untouched
    a, b = res["per_seed"]
    assert a != b and 0.2 < a < 0.8 and res["seeds"] == 2
    assert res["mean"] == pytest.approx((a + b) / 2) and res["std"] == pytest.approx(statistics.stdev([a, b]))
    again = evaluate.evaluate_model(None, tok, seeds=[1], tasks=tasks, backend=backend)["math/test"]
    assert again["per_seed"] == [b] and again["std"] == 0.0
    assert evaluate.evaluate_model(None, tok, seeds=2, k=3, tasks=tasks, backend=backend)["math/test"]["k"] == 3


# ----------------------------------------------------------------------------- the command line

def run_cli(*args):
    return subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))


FAST = ["--suite", "tiny", "--n", "4", "--domains", "math,if", "--max-turn-tokens", "12", "--max-tokens", "200",
        "--threads", "1"]


@pytest.mark.slow
def test_cli_end_to_end_with_the_accuracy_matrix(micro, tmp_path):
    model, tok = micro
    runs = tmp_path / "runs" / "tiny"
    for k, sub in enumerate(("base", "seq/1-math", "seq/2-if")):   # different weights (same ones are evaluated once)
        m = copy.deepcopy(model)
        with torch.no_grad():
            next(m.parameters()).view(-1)[0] += 0.01 * k
        save_checkpoint(str(runs / sub), m, tok, {"method": "test"})
    r = run_cli("--ckpt", str(runs / "base"), str(runs / "seq/1-math"), *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = runs / "eval"
    assert sorted(os.listdir(ev)) == ["base.json", "seq-1-math.json", "seq_matrix.json", "seq_matrix.png",
                                      "seq_matrix_gold.png"]
    rec = json.loads((ev / "seq-1-math.json").read_text())
    b = rec["benchmarks"]["math/test"]   # per-task scores for paired differences, the gold log-likelihood
    assert len(b["per_task"]) == len(b["task_ids"]) == 4 and b["mean"] == pytest.approx(sum(b["per_task"]) / 4)
    assert b["gold"]["n"] == 4 and b["gold"]["expert_reward"] == 1.0 and b["gold"]["task_ids"] == b["task_ids"]
    assert rec["ckpt"] == str(runs / "seq/1-math") and rec["suite"] == "tiny" and rec["wall_s"] > 0
    assert rec["settings"]["n"] == 4 and rec["settings"]["domains"] == ["math", "if"]
    assert list(rec["benchmarks"]) == ["math/test", "math/ood", "if/test", "if/ood"]
    assert all((b["n"], b["k"], b["seeds"]) == (4, 1, 1) for b in rec["benchmarks"].values())
    assert "| checkpoint | math/test | math/ood | if/test | if/ood |" in r.stdout
    assert re.search(r"\| seq-1-math \| \d\.\d{3} ± 0\.000 \|", r.stdout) and "BWT" in r.stdout
    m = json.loads((ev / "seq_matrix.json").read_text())
    assert m["rows"] == ["base", "seq-1-math"] and m["domains"] == ["math", "if"]
    assert m["matrix"][1][0] == rec["benchmarks"]["math/test"]["mean"]
    assert m["gold"]["matrix"][1][0] == rec["benchmarks"]["math/test"]["gold"]["loglik"] and m["se"][1][0] is not None
    assert "gold log-likelihood per agent token:" in r.stdout
    # A later stage alone: the matrix takes the base and stage 1 from the saved results.
    r = run_cli("--ckpt", str(runs / "seq/2-if"), *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rows from saved results: base <- base.json (n=4), seq-1-math <- seq-1-math.json (n=4)" in r.stdout
    assert json.loads((ev / "seq_matrix.json").read_text())["rows"] == ["base", "seq-1-math", "seq-2-if"]
    # A stage that only a training run evaluated (eval/inrun/, fewer tasks): used, and said so
    os.makedirs(ev / "inrun")
    os.replace(ev / "seq-1-math.json", ev / "inrun" / "seq-1-math.json")
    r = run_cli("--ckpt", str(runs / "seq/2-if"), *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "seq-1-math <- inrun/seq-1-math.json (n=4)" in r.stdout
    m = json.loads((ev / "seq_matrix.json").read_text())
    assert m["rows"] == ["base", "seq-1-math", "seq-2-if"] and m["sources"]["seq-2-if"] == "this run"
    # rows made with other settings are named with the difference, never mixed silently
    r = run_cli("--ckpt", str(runs / "seq/2-if"), *FAST, "--seeds", "2")
    assert r.returncode == 0 and "seq-1-math <- inrun/seq-1-math.json (n=4, other settings: seeds 1 here 2)" in r.stdout
    # --out-dir overrides runs/<preset>/eval
    r = run_cli("--ckpt", str(runs / "base"), *FAST, "--out-dir", str(tmp_path / "elsewhere"))
    assert r.returncode == 0 and os.listdir(tmp_path / "elsewhere") == ["base.json"]


@pytest.mark.slow
def test_resume_keeps_a_record_only_of_this_checkpoint_with_the_same_settings_and_scoring_code(micro, tmp_path):
    """arena.sh restarted after a kill: a finished evaluation is kept; one of a checkpoint since replaced under the
    same path (lineage by identity), made with other settings or by other scoring code (a `git pull`) is redone."""
    model, tok = micro
    ck = tmp_path / "runs" / "tiny" / "seq" / "1-math"
    save_checkpoint(str(ck), model, tok, {"method": "test"})
    fast = [*FAST, "--domains", "math", "--no-gold"]
    rec = tmp_path / "runs" / "tiny" / "eval" / "seq-1-math.json"
    assert run_cli("--ckpt", str(ck), *fast).returncode == 0
    first = json.loads(rec.read_text())["evaluated_at"], rec.stat().st_mtime_ns
    r = run_cli("--ckpt", str(ck), *fast, "--resume")
    assert r.returncode == 0 and "evaluated before with these settings" in r.stdout, r.stderr[-2000:]
    assert (json.loads(rec.read_text())["evaluated_at"], rec.stat().st_mtime_ns) == first
    assert "| seq-1-math |" in r.stdout   # the kept record is still in the table
    kept = json.loads(rec.read_text())
    assert kept["numerics"]["threads"] >= 1 and kept["numerics"]["torch"] == torch.__version__
    rec.write_text(json.dumps(dict(kept, numerics=dict(kept["numerics"], threads=99))))   # recorded, not identity:
    assert "evaluated before" in run_cli("--ckpt", str(ck), *fast, "--resume").stdout     # another thread count kept
    r = run_cli("--ckpt", str(ck), *fast[:-1], "--resume")   # other settings (the gold metric): evaluated again
    assert r.returncode == 0 and "evaluated before" not in r.stdout
    r = run_cli("--ckpt", str(ck), *fast[:-1], "--resume")
    assert r.returncode == 0 and "evaluated before" in r.stdout
    os.utime(ck / "model.safetensors")                        # a file touched is the same checkpoint: kept
    assert "evaluated before" in run_cli("--ckpt", str(ck), *fast[:-1], "--resume").stdout
    saved = json.loads(rec.read_text())
    rec.write_text(json.dumps(dict(saved, scoring_code="0" * 16)))   # a record made by other scoring code: again
    r = run_cli("--ckpt", str(ck), *fast[:-1], "--resume")
    assert r.returncode == 0 and "evaluated before" not in r.stdout
    assert json.loads(rec.read_text())["scoring_code"] == saved["scoring_code"]
    save_checkpoint(str(ck), model, tok, {"method": "test"})  # the checkpoint replaced in place: again
    r = run_cli("--ckpt", str(ck), *fast[:-1], "--resume")
    assert r.returncode == 0 and "evaluated before" not in r.stdout


def test_a_checkpoint_with_the_same_files_as_an_earlier_one_reuses_its_scores(micro, tmp_path):
    """oracle/math trained like seq/1-math (same start, data and seed) has the same weights: evaluated once; a
    checkpoint that differs in one weight is evaluated on its own."""
    model, tok = micro
    runs = tmp_path / "runs" / "tiny"
    save_checkpoint(str(runs / "seq" / "1-math"), model, tok, {"method": "seq"})
    save_checkpoint(str(runs / "oracle" / "math"), model, tok, {"method": "oracle"})   # acl_meta.json differs
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1.0
    save_checkpoint(str(runs / "oracle" / "if"), other, tok, {"method": "oracle"})
    fast = [*FAST, "--domains", "math", "--no-gold"]
    r = run_cli("--ckpt", str(runs / "seq" / "1-math"), str(runs / "oracle" / "math"), str(runs / "oracle" / "if"), *fast)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[oracle-math] the same files as" in r.stdout and "[oracle-if] the same files" not in r.stdout
    seq, orc = (json.loads((runs / "eval" / f"{n}.json").read_text()) for n in ("seq-1-math", "oracle-math"))
    assert orc["benchmarks"] == seq["benchmarks"] and orc["ckpt"] == str(runs / "oracle" / "math")
    assert orc["same_weights_as"] == str(runs / "seq" / "1-math") and "same_weights_as" not in seq
    assert "[oracle-if] math/test seed 0" in r.stdout
    # a restart with --resume keeps all three, the reused one too (its record names its own checkpoint's identity)
    r = run_cli("--ckpt", str(runs / "seq" / "1-math"), str(runs / "oracle" / "math"), str(runs / "oracle" / "if"), *fast,
                "--resume")
    assert r.returncode == 0 and r.stdout.count("evaluated before") == 3, r.stdout[-2000:]


def test_cli_save_episodes(micro, tmp_path):
    """--save-episodes writes every scored episode, one JSONL per benchmark, in a directory marked as episodes;
    a directory this project did not write is refused before any work."""
    model, tok = micro
    runs = tmp_path / "runs" / "tiny"
    save_checkpoint(str(runs / "base"), model, tok, {"method": "test"})
    r = run_cli("--ckpt", str(runs / "base"), *FAST, "--splits", "train", "--no-gold", "--save-episodes",
                str(tmp_path / "eps"))
    assert r.returncode == 0, r.stderr[-3000:]
    d = tmp_path / "eps" / "base"
    assert sorted(os.listdir(d)) == ["acl_meta.json", "if-train.jsonl", "math-train.jsonl"]
    rows = [json.loads(line) for line in (d / "math-train.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {"messages", "tools", "reward", "env", "task_id"} <= set(rows[0])
    assert rows[0]["messages"][-1]["role"] == "assistant" and rows[0]["env"] == "math"
    assert "gold" not in json.loads((runs / "eval" / "base.json").read_text())["benchmarks"]["math/train"]
    os.makedirs(tmp_path / "mine" / "base")
    (tmp_path / "mine" / "base" / "notes.txt").write_text("keep")
    r = run_cli("--ckpt", str(runs / "base"), *FAST, "--save-episodes", str(tmp_path / "mine"))
    assert r.returncode == 2 and "did not write" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert os.listdir(tmp_path / "mine" / "base") == ["notes.txt"]


def test_cli_missing_checkpoint_is_one_line_and_writes_nothing(tmp_path, call):
    r = call(evaluate.main, ["--ckpt", str(tmp_path / "runs/tiny/seq/1-math"), "--suite", "tiny"])
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("error: checkpoint directory not found") and os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, message", [
    (["--suite", "huge"], "unknown suite"),
    (["--domains", "math,maths"], "unknown domain"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--k", "0"], "--k must be >= 1"),
    (["--splits", "test,tset"], "unknown split"),
    (["--source", "aime26=x.jsonl"], "--source is for the full suite"),
    (["--suite", "full", "--benchmarks", "aime25"], "unknown full-suite benchmark"),
    (["--suite", "full", "--benchmarks", "tau_mock"], "tau_mock needs"),
    (["--suite", "full", "--benchmarks", "tau_telecom"], "tau_telecom needs"),
    (["--suite", "full", "--source", "aime26"], "NAME=PATH_OR_ID"),
    (["--matrix"], "--matrix needs sequential stages"),
    (["--temperature", "math=hot"], "--temperature takes X or domain=X"),
    (["--temperature", "maths=0.6"], "unknown domain 'maths'"),
    (["--temperature", "-1"], "--temperature must be in [0, 10)"),
    (["--n", "0"], "--n must be >= 1"),
    (["--n", "tset=3"], "--n: unknown split 'tset'"),
    (["--suite", "full", "--benchmarks", "aime26", "--n", "test=3"], "is for the tiny suite"),
    (["--devices", "cpu,gpu1"], "--devices takes GPU indices or cpu"),
    (["--harness", "lm-eval"], "--harness lm-eval scores the full suite's non-agentic benchmarks"),
])
def test_bad_input_stops_before_anything_is_written(micro, tmp_path, monkeypatch, capsys, args, message):
    model, tok = micro
    ckpt = tmp_path / "runs" / "tiny" / "base"
    save_checkpoint(str(ckpt), model, tok, {"method": "test"})
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "--ckpt", str(ckpt), *args])
    with pytest.raises(SystemExit) as e:
        evaluate.main()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("error: ") and message in err
    assert os.listdir(tmp_path / "runs" / "tiny") == ["base"]


def test_an_8b_checkpoint_with_the_hf_backend_on_the_cpu_is_refused(micro, tmp_path, monkeypatch, capsys):
    model, tok = micro
    ckpt = tmp_path / "runs" / "qwen3-8b" / "base"
    save_checkpoint(str(ckpt), model, tok, {"method": "test"})
    monkeypatch.setattr(evaluate, "HF_CPU_MAX_GB", 0.0)   # the micro model stands for 16 GB of weights
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "--ckpt", str(ckpt), "--backend", "hf"])
    with pytest.raises(SystemExit) as e:
        evaluate.main()
    assert e.value.code == 2 and "run --backend vllm on a GPU" in capsys.readouterr().err
    assert os.listdir(tmp_path / "runs" / "qwen3-8b") == ["base"]


def test_cli_checkpoint_outside_runs_needs_out_dir(micro, tmp_path, monkeypatch, capsys):
    model, tok = micro
    save_checkpoint(str(tmp_path / "ck"), model, tok, {"method": "test"})
    (tmp_path / "notackpt").mkdir()
    for args, message in (([str(tmp_path / "ck")], "pass --out-dir"), ([str(tmp_path / "notackpt")], "no config.json")):
        monkeypatch.setattr(sys, "argv", ["evaluate.py", "--ckpt", *args])
        with pytest.raises(SystemExit) as e:
            evaluate.main()
        assert e.value.code == 2 and message in capsys.readouterr().err


# ----------------------------------------------------------------------------- the full suite on local fixtures

def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def fake_user(path, headers, body):
    """The simulated customer: states a need first, then ends the conversation."""
    reply = "Hi, I need help with an order." if len(body["messages"]) <= 2 else "###STOP###"
    return 200, {"choices": [{"message": {"role": "assistant", "content": reply}}]}


def test_full_suite_on_local_fixtures(micro, tmp_path):
    _, tok = micro
    sources = {"aime26": write_jsonl(tmp_path / "aime.jsonl", [
        {"problem_idx": 1, "problem": "Find $2^{10} \\bmod 1000$.", "answer": "24"},
        {"problem_idx": 2, "problem": "Compute $7 \\cdot 11 \\cdot 13$.", "answer": "1001"}])}
    qa = lambda i, q, a: {"id": str(i), "question": q, "golden_answers": a}
    write_jsonl(tmp_path / "qa/bamboogle/test.jsonl", [qa(0, "How many hours are in a day?", ["24"]),
                                                        qa(1, "Capital of France?", ["Paris"])])
    corpus = write_jsonl(tmp_path / "wiki.jsonl", [{"id": "0", "contents": '"Day"\nA day has 24 hours.'}])
    sources["ifeval"] = write_jsonl(tmp_path / "ifeval.jsonl", [
        {"key": 1, "prompt": "Answer without commas.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
        {"key": 2, "prompt": "Give a title.", "instruction_id_list": ["detectable_format:title"], "kwargs": [{}]}])
    tau = tmp_path / "tau2"
    write_tau2(tau)  # the tau2 retail fixture of test_env_ecommerce, with two test tasks of our own
    (tau / "tasks.json").write_text(json.dumps([
        {"id": "a", "user_scenario": {"instructions": "Ask about your order, then stop."},
         "evaluation_criteria": {"actions": [], "communicate_info": []}},
        {"id": "b", "user_scenario": {"instructions": "Cancel #W4776164."},
         "evaluation_criteria": {"actions": [{"name": "cancel_pending_order",
                                              "arguments": {"order_id": "#W4776164", "reason": "no longer needed"}}]}}]))
    (tau / "split_tasks.json").write_text(json.dumps({"test": ["a", "b"]}))
    # tau3's mock domain (its `base` split): a task with nothing to change, and one that needs a create_task call
    sources["tau_mock"] = write_mock(tmp_path / "mock", [
        {"id": "hi", "user_scenario": {"instructions": "Say hello."}, "evaluation_criteria": {"reward_basis": ["DB"]}},
        MOCK_TASKS[0]])
    with JSONServer(fake_user) as user:
        env_opts = {"search": {"data": str(tmp_path / "qa"), "corpus": corpus},
                    "ecommerce": {"data": str(tau), "user_url": user.url + "/v1"}}
        names = ["aime26", "bamboogle", "tau_retail", "tau_mock", "ifeval"]
        tasks = evaluate.load_benchmarks("full", n=None, env_opts=env_opts, sources=sources, benchmarks=names)
        assert list(tasks) == names and [len(t) for _, t in tasks.values()] == [2, 2, 2, 2, 2]
        assert tasks["tau_mock"][0].world == "mock" and tasks["tau_mock"][1][0].id == "ecommerce-base-hi"
        # One fixed reply is right on exactly one task of each benchmark: AIME's 24 (math-verify), Bamboogle's
        # "24" (EM), the tau task that needs no database change (the user stops), IFEval's no-comma rule.
        backend = TokBackend(tok, lambda text: "So \\boxed{24} <answer>24</answer>")
        res = evaluate.evaluate_model(None, tok, suite="full", seeds=2, tasks=tasks, backend=backend,
                                      temperature=evaluate.eval_temperatures(None, "full"))
    for name in names:
        assert res[name]["mean"] == pytest.approx(0.5) and res[name]["std"] == 0.0 and res[name]["n"] == 2, name
    # each benchmark sampled at its domain's temperature: the released evaluation's math 0.6 and tau 0.7
    assert [res[b]["temperature"] for b in names] == [0.6, 1.0, 0.7, 0.7, 1.0] and backend.temperatures == {0.6, 1.0, 0.7}
    assert res["aime26"]["k"] == 16 and res["ifeval"]["k"] == 1  # AIME is avg@16
    assert res["bamboogle"]["metrics"]["answered"] == 1.0 and "f1" in res["bamboogle"]["metrics"]
    assert res["tau_retail"]["metrics"]["user_error"] == 0.0 and res["tau_retail"]["metrics"]["db_match"] == 0.5
    assert forgetting.domain_cell(res, "math")[0] == 0.5 and forgetting.domain_cell(res, "search")[0] is None  # nq: absent
    with pytest.raises(UsageError, match="tau_mock needs"):
        evaluate.load_benchmarks("full", benchmarks=["tau_mock"], env_opts=env_opts)
    with pytest.raises(UsageError, match="unknown full-suite benchmark 'aime25'"):
        evaluate.load_benchmarks("full", sources={"aime25": "x"})


@pytest.mark.parametrize("text, suite, want", [
    (None, "tiny", 1.0), (None, "full", {"math": 0.6, "search": 1.0, "ecommerce": 0.7, "if": 1.0}), ("0", "full", 0.0),
    ("math=0.3", "tiny", {"math": 0.3, "search": 1.0, "ecommerce": 1.0, "if": 1.0})])
def test_temperature_per_domain(text, suite, want):
    assert evaluate.eval_temperatures(text, suite) == want


def test_tasks_per_split_and_the_mixed_tasks_alone():
    """--n test=5,ood=2: each split its own count (an unnamed split keeps 300), the same first tasks as a plain --n;
    --mixed only: the mixed-domain tasks and no domain's."""
    t = evaluate.load_benchmarks("tiny", ["math", "search"], ["test", "ood"], {"test": 5, "ood": 2}, mixed=True)
    assert {k: len(v[1]) for k, v in t.items()} == {"math/test": 5, "math/ood": 2, "search/test": 5, "search/ood": 2,
                                                     "mixed/test": 5, "mixed/ood": 2}
    plain = evaluate.load_benchmarks("tiny", ["math"], ["ood"], 5)
    assert [x.id for x in t["math/ood"][1]] == [x.id for x in plain["math/ood"][1]][:2]
    assert evaluate.parse_n("test=300,ood=100") == {"test": 300, "ood": 100} and evaluate.parse_n("7") == 7
    only = evaluate.load_benchmarks("tiny", [], ["test", "ood"], {"ood": 2}, mixed=True)
    assert {k: len(v[1]) for k, v in only.items()} == {"mixed/test": 300, "mixed/ood": 2}


def test_an_rft_checkpoint_is_not_a_stage_of_the_matrix():
    """runs/<preset>/seq/[0-9]-* matches the RFT checkpoints too (seq/2-search-rft): evaluated, but not matrix rows."""
    stages = evaluate._stages(["base", "seq-1-math", "seq-2-search-rft", "seq-2-search"], "--ckpt")
    assert [s[1] for s in stages] == ["seq-1-math", "seq-2-search"]
    with pytest.raises(UsageError, match="maths"):
        evaluate._stages(["seq-1-maths"], "--ckpt")


def test_gold_likelihood_of_an_expert_copier_beats_a_random_model(micro):
    """A micro model trained on the expert's episodes scores a higher gold log-likelihood and top-1 than the same
    model untrained (random), on the same expert episodes; the values are deterministic."""
    import copy

    from acl.step import sft_epochs
    from envs import make_env
    from envs.rollout import expert_episodes
    LIMITS = dict(max_tokens=20000, max_turn_tokens=4000)   # the micro tokenizer spends more tokens than the tiny one
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


def test_gold_n_scores_the_first_tasks_of_a_split_and_the_sampled_score_all_of_them(micro):
    """--gold-n: the gold log-likelihood on a split's first N tasks at this --n, every task sampled;
    True: all of them; the first N's values equal a run on those N alone."""
    model, tok = micro
    kw = dict(suite="tiny", domains=["math"], splits=("test",), n=6, max_tokens=200, max_turn_tokens=12)
    few = evaluate.evaluate_model(model, tok, gold=2, **kw)["math/test"]
    assert few["n"] == 6 and len(few["per_task"]) == 6
    assert few["gold"]["n"] == 2 and few["gold"]["task_ids"] == few["task_ids"][:2]
    every = evaluate.evaluate_model(model, tok, gold=True, **kw)["math/test"]["gold"]
    assert every["n"] == 6 and every["per_task_loglik"][:2] == pytest.approx(few["gold"]["per_task_loglik"], abs=1e-5)
    assert "gold" not in evaluate.evaluate_model(model, tok, gold=False, **kw)["math/test"]


def test_the_gold_setting_is_one_value_per_computation():
    """The record's gold setting names what was computed: --gold-n at or above every split's size computes what
    True does and records True (so --resume keeps a --n 200 record under any --gold-n >= 200); below it, N."""
    tasks = {"math/test": (None, list(range(800))), "math/ood": (None, list(range(200)))}
    small = {"math/test": (None, list(range(200))), "math/ood": (None, list(range(50)))}
    assert evaluate.gold_setting(True, 300, tasks) == 300
    assert evaluate.gold_setting(True, 300, small) is True and evaluate.gold_setting(True, 200, small) is True
    assert evaluate.gold_setting(True, 199, small) == 199
    assert evaluate.gold_setting(True, 0, tasks) is True
    assert evaluate.gold_setting(False, 300, tasks) is False and evaluate.gold_setting(False, 0, small) is False


def test_a_negative_gold_n_is_refused_in_one_line(call):
    r = call(evaluate.main, ["--ckpt", "x", "--gold-n", "-1"])
    assert r.returncode == 2 and "--gold-n must be >= 0" in r.stderr
