"""The mixed-domain tasks (envs/mixed.py): answers from the world's facts, the scripted expert scores 1 through the
real rollout loop, wrong or garbage turns score 0 without a crash, evaluation splits only, and evaluate.py --mixed."""
import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from envs.base import UsageError, tool_call_text
from envs.mixed import REFERENCE_YEAR, MixedEnv
from envs.rollout import MAX_TOKENS, expert_episodes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny-base")
ENV = MixedEnv()


def test_answers_follow_from_the_searched_facts_and_splits_are_disjoint():
    test, ood = ENV.tasks("test", n=40), ENV.tasks("ood", n=40)
    assert [t.id for t in test] == [t.id for t in ENV.tasks("test", n=40)]          # deterministic
    for t in test + ood:
        years = [int(ENV.world[o]["founded"]) for o in t.gold["path"]]
        want = REFERENCE_YEAR - years[0] if t.gold["kind"] == "years-before" else sum(years)
        assert t.gold["answers"] == [str(want)] and all(ENV.world[o]["pool"] == t.split for o in t.gold["path"])
        assert all(o in t.messages[-1]["content"] for o in t.gold["path"])
    assert {t.gold["kind"] for t in test} == {"years-before", "sum"}
    for split in ("train", "val"):
        with pytest.raises(UsageError, match="for evaluation"):
            ENV.tasks(split)


def test_the_expert_scores_one_through_the_rollout_loop():
    tok = AutoTokenizer.from_pretrained(TINY)
    tasks = ENV.tasks("test", n=20) + ENV.tasks("ood", n=20)
    eps = expert_episodes(tok, ENV, tasks)
    assert len(eps) == 40 and all(e.reward == 1.0 and not e.truncated and len(e.token_ids) < MAX_TOKENS for e in eps)
    assert all(e.metrics["searches"] == len(t.gold["path"]) for e, t in zip(eps, tasks))


@pytest.mark.parametrize("turns", [["<answer>1</answer>"], ["\x00" * 50, "<tool_call>{bad"],
                                   [tool_call_text("search", {"query": 7})] * 5, [""], ["<answer></answer>"]])
def test_wrong_or_garbage_turns_score_zero_without_a_crash(turns):
    task = ENV.tasks("test", n=1)[0]
    state = ENV.reset(task)
    for text in turns:
        if not state.done:
            ENV.step(state, text)
    reward, metrics = ENV.score(state)
    assert reward == 0.0 and set(metrics) == {"em", "searches", "answered"}


def test_evaluate_scores_the_mixed_tasks_with_the_gold_log_likelihood(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--ckpt", TINY, "--mixed", "--domains",
                        "math", "--splits", "test", "--n", "4", "--threads", "1", "--out-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert r.returncode == 0, r.stderr[-3000:]
    b = json.load(open(tmp_path / "tiny-base.json"))["benchmarks"]
    assert set(b) == {"math/test", "mixed/test"} and b["mixed/test"]["n"] == 4 and b["mixed/test"]["gold"]["n"] == 4
    r = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--ckpt", TINY, "--mixed", "--splits", "val",
                        "--out-dir", str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--mixed" in r.stderr and not os.path.exists(tmp_path / "x")
