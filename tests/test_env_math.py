"""The math environment: golden transcripts, fuzzing, the tiny generator, real loaders on local fixtures."""
import ast
import json
import re

import datasets
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import make_env
from envs.base import Task, UsageError
from envs.math import (
    BENCHMARKS,
    TABLE_NAMES,
    MathEnv,
    grade,
    last_boxed,
    ood_split_of,
    problem_key,
    split_of,
    worked_lines,
    working,
)


def run(env, task, text, truncated=False):
    """Drive one episode the way the rollout loop does."""
    state = env.reset(task)
    while not state.done:
        obs = env.step(state, text)
        assert obs == []
    state.truncated = truncated
    return state, env.score(state)


def value_of(expr: str) -> int:
    """An independent check of the generator's arithmetic (Python's own precedence, via the AST)."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}

    def walk(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        return node.value
    return walk(ast.parse(expr, mode="eval").body)


def operands(expr: str) -> list:
    return [int(x) for x in re.findall(r"\d+", expr)]


def key(expr: str) -> str:
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", expr).groups()
    return problem_key(int(a), op, int(b))


@pytest.fixture(scope="module")
def env():
    return MathEnv()


# ----------------------------------------------------------------------------- golden transcripts (tiny)

def test_golden_tiny_episode(env):
    task = env.tasks("test", n=5, seed=3)[0]
    answer = task.gold["answer"]
    assert task.env == "math" and task.tools is None and task.gold["kind"] == "exact"
    assert [m["role"] for m in task.messages] == ["system", "user"]
    state, (reward, metrics) = run(env, task, f"{task.gold['expr']}={answer}. \\boxed{{{answer}}}")
    assert (reward, metrics) == (1.0, {"acc": 1.0, "boxed": 1.0})
    assert state.turns == 1 and state.messages[-1]["role"] == "assistant" and len(state.messages) == 3
    # spaces inside the box do not matter; the last box is the answer
    assert run(env, task, f"\\boxed{{ {' '.join(answer)} }}")[1][0] == 1.0
    assert run(env, task, f"\\boxed{{{int(answer) + 1}}} no, \\boxed{{{answer}}}")[1][0] == 1.0


def test_golden_tiny_wrong_answers_score_zero(env):
    task = env.tasks("test", n=1, seed=4)[0]
    answer = int(task.gold["answer"])
    assert run(env, task, f"\\boxed{{{answer + 1}}}")[1] == (0.0, {"acc": 0.0, "boxed": 1.0})
    assert run(env, task, f"\\boxed{{{answer}}} or \\boxed{{{answer + 1}}}")[1][0] == 0.0  # last box counts
    assert run(env, task, f"The answer is {answer}.")[1] == (0.0, {"acc": 0.0, "boxed": 0.0})  # no box
    assert run(env, task, f"\\boxed{{{answer}")[1] == (0.0, {"acc": 0.0, "boxed": 0.0})  # unclosed
    assert run(env, task, f"\\boxed{{{answer}.0}}")[1][0] == 0.0  # tiny grading is exact
    # a correct answer in an episode the rollout loop cut off is unfinished: 0
    assert run(env, task, f"\\boxed{{{answer}}}", truncated=True)[1] == (0.0, {"acc": 0.0, "boxed": 1.0})


def test_unfinished_episode_scores_zero(env):
    task = env.tasks("test", n=1)[0]
    state = env.reset(task)
    assert env.score(state) == (0.0, {"acc": 0.0, "boxed": 0.0})
    state.truncated = True
    assert env.score(state)[0] == 0.0


def test_make_env_and_max_turns():
    env = make_env("math")
    assert isinstance(env, MathEnv) and env.domain == "math" and env.max_turns == 1


# ----------------------------------------------------------------------------- grading at full scale

def test_grade_math_verify():
    gold = {"kind": "math_verify", "answer": "\\frac{1}{2}"}
    assert grade("so \\boxed{\\frac{1}{2}}", gold) == 1.0
    assert grade("so \\boxed{0.5}", gold) == 1.0
    assert grade("so \\boxed{\\frac{1}{3}}", gold) == 0.0
    assert grade("the answer is one half", gold) == 0.0
    int_gold = {"kind": "math_verify", "answer": "34"}
    assert grade("Work.\nAnswer: 34", int_gold) == 1.0  # DAPO's own answer format
    assert grade("Work.\nAnswer: 35", int_gold) == 0.0
    assert grade("\\boxed{34} was wrong, \\boxed{35}", int_gold) == 0.0
    assert grade("\\boxed{" + "9" * 5000 + "}", int_gold) == 0.0


def test_grade_choice():
    gold = {"kind": "choice", "answer": "B"}
    assert grade("\\boxed{B}", gold) == 1.0
    assert grade("\\boxed{(B)}", gold) == 1.0
    assert grade("\\boxed{ B }", gold) == 1.0
    assert grade("\\boxed{C}", gold) == 0.0
    assert grade("\\boxed{BC}", gold) == 0.0
    assert grade("B", gold) == 0.0


def test_grade_unknown_kind_is_a_user_error():
    with pytest.raises(UsageError, match="unknown grading kind"):
        grade("\\boxed{1}", {"kind": "fuzzy", "answer": "1"})


def test_last_boxed():
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} \\boxed{2}") == "2"
    assert last_boxed("\\boxed{1} \\boxed{2") is None
    assert last_boxed(None) is None


# ----------------------------------------------------------------------------- fuzz

model_text = st.one_of(
    st.text(max_size=300),
    st.builds(lambda a, b, c: a + "\\boxed{" + b + c, st.text(max_size=40), st.text(max_size=40),
              st.sampled_from(["}", "", "}}", "{", "} \\boxed{"])),
    st.builds(lambda a: "Answer: " + a, st.text(max_size=60)),
    st.sampled_from(["", "\\boxed{}", "\\boxed{{{{", "}}}}", "\\boxed{\\frac{1}{0}}", "\\boxed{x^(}", "\x00\ud7ff",
                     "\\boxed{1" + "0" * 400 + "}", "\\boxed{\\sqrt{-1}}", "Answer:", "\\boxed{(Z)}"]),
)
GOLDS = [{"kind": "exact", "answer": "82"}, {"kind": "math_verify", "answer": "\\frac{3}{4}"},
         {"kind": "math_verify", "answer": "34"}, {"kind": "choice", "answer": "A"}]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=model_text, gold=st.sampled_from(GOLDS), truncated=st.booleans())
def test_fuzz_never_raises_and_reward_in_range(env, text, gold, truncated):
    task = Task(id="fuzz", env="math", split="test", messages=[{"role": "user", "content": "q"}], gold=gold)
    state, (reward, metrics) = run(env, task, text, truncated)
    assert 0.0 <= reward <= 1.0 and set(metrics) == {"acc", "boxed"}
    assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in metrics.values())
    assert state.done and state.messages[-1] == {"role": "assistant", "content": text}
    assert grade(text, gold) in (0.0, 1.0)


def test_non_string_reply_does_not_raise(env):
    task = env.tasks("test", n=1)[0]
    state = env.reset(task)
    env.step(state, None)
    assert env.score(state) == (0.0, {"acc": 0.0, "boxed": 0.0})
    assert grade(12345, task.gold) == 0.0


# ----------------------------------------------------------------------------- tiny generator

def test_generator_is_deterministic_and_seeded(env):
    a, b = env.tasks("test", n=50, seed=7), MathEnv().tasks("test", n=50, seed=7)
    assert [(t.id, t.messages, t.gold) for t in a] == [(t.id, t.messages, t.gold) for t in b]
    assert [t.gold for t in env.tasks("test", n=50, seed=8)] != [t.gold for t in a]
    assert env.knowledge(20, seed=1) == MathEnv().knowledge(20, seed=1)
    assert env.knowledge(20, seed=1) != env.knowledge(20, seed=2)


def test_default_sizes_and_unique_ids(env):
    for split, n in (("train", 5000), ("val", 300), ("test", 300), ("ood", 300)):
        tasks = env.tasks(split)
        assert len(tasks) == n and len({t.id for t in tasks}) == n
        assert all(t.split == split for t in tasks)
    assert len(env.tasks("test", n=0)) == 0


def test_answers_are_correct(env):
    for split in ("train", "test", "ood"):
        for t in env.tasks(split, n=300, seed=2):
            assert int(t.gold["answer"]) == value_of(t.gold["expr"]) >= 0
            assert t.messages[1]["content"] == f"What is {t.gold['expr']}?"


def test_in_domain_and_ood_shapes(env):
    in_domain = [t.gold["expr"] for s in ("train", "val", "test") for t in env.tasks(s, n=400, seed=5)]
    assert all(len(operands(e)) == 2 and max(operands(e)) < 1000 for e in in_domain)
    assert {op for e in in_domain for op in "+-*" if op in e} == {"+", "-", "*"}
    small = sum(max(operands(e)) < 10 for e in in_domain) / len(in_domain)
    assert small > 0.25  # small operands are common, so a tiny base is sometimes right
    ood = [t.gold["expr"] for t in env.tasks("ood", n=400, seed=5)]
    assert all(len(operands(e)) == 3 or max(operands(e)) >= 1000 for e in ood)
    assert any("(" in e for e in ood) and any(len(operands(e)) == 2 for e in ood)


def test_splits_are_disjoint(env):
    keys = {s: {key(t.gold["expr"]) for t in env.tasks(s, seed=s_seed)}
            for s, s_seed in (("train", 0), ("val", 1), ("test", 2))}
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["val"] and not keys["val"] & keys["test"]
    for s, ks in keys.items():  # every problem is owned by the split that holds it
        assert all(split_of(*_parts(k)) == s for k in ks)
    ood = {t.gold["expr"] for t in env.tasks("ood")}
    assert not ood & {t.gold["expr"] for t in env.tasks("train")}


def _parts(k: str) -> tuple:
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", k).groups()
    return int(a), op, int(b)


def test_knowledge_is_plain_worked_arithmetic_of_no_held_out_problem(env):
    from envs.base import PROTOCOL_MARKERS
    docs = env.knowledge(600, seed=0)
    assert not [d for d in docs if any(m in d for m in PROTOCOL_MARKERS)]
    held_out = {key(t.gold["expr"]) for s in ("test", "val") for t in env.tasks(s, n=2000)}
    ood = {t.gold["expr"] for t in env.tasks("ood", n=2000)}
    shown, tables, forms = [], 0, 0
    for d in docs:
        if d.startswith(tuple(TABLE_NAMES.values())):
            tables += 1
            for fact in re.findall(r"(\d+[-+*]\d+)=(\d+)", d):
                assert value_of(fact[0]) == int(fact[1])
            continue
        for problem in d.split("\n\n"):
            expr = re.match(r"(?:Question: What is |Compute |What is )?([-+*()\d]+)", problem).group(1)
            value = int(re.search(r"(?:Answer: |The answer is |= )(\d+)", problem).group(1))
            assert value == value_of(expr)                          # every stated result is right
            assert ". ".join(worked_lines(expr)[0]) in problem      # worked as the expert works it
            shown.append(expr)
            forms += len(operands(expr)) == 3 or max(operands(expr)) >= 1000
    assert 0.1 < tables / len(docs) < 0.3 and 0.2 < forms / len(shown) < 0.5
    assert not [e for e in shown if len(operands(e)) == 2 and max(operands(e)) < 1000 and key(e) in held_out]
    assert not set(shown) & ood and all(ood_split_of(e) == "knowledge" for e in shown if e not in ood and (
        len(operands(e)) == 3 or max(operands(e)) >= 1000))
    assert all(ood_split_of(t.gold["expr"]) == "ood" for t in env.tasks("ood", n=300))


def test_tiny_prompts_are_short(env):
    t = env.tasks("test", n=1)[0]
    assert sum(len(m["content"]) for m in t.messages) < 80


# ----------------------------------------------------------------------------- real loaders on local fixtures

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")


def dapo_row(problem, answer, i):
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_PROMPT.format(problem)}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{i}"}}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dapo_jsonl_loader(tmp_path):
    rows = [dapo_row("What is $1+1$?", "2", 0), dapo_row("Find $x$ if $2x=6$.", "3", 1), dapo_row("What is $1+1$?", "2", 2)]
    env = MathEnv(data=write_jsonl(tmp_path / "dapo.jsonl", rows))
    tasks = env.tasks("train")
    assert len(tasks) == 2  # DAPO-Math-17k repeats prompts; duplicates are dropped
    task = {t.gold["answer"]: t for t in tasks}["3"]
    assert task.messages == rows[1]["prompt"] and task.gold["kind"] == "math_verify" and task.split == "train"
    assert run(env, task, "2x=6 so x=3.\nAnswer: 3")[1][0] == 1.0
    assert run(env, task, "\\boxed{3}")[1] == (1.0, {"acc": 1.0, "boxed": 1.0})
    assert run(env, task, "\\boxed{6}")[1][0] == 0.0
    assert [t.id for t in env.tasks("train", n=1, seed=0)] == [t.id for t in env.tasks("train", n=1, seed=0)]
    with pytest.raises(UsageError, match="only a 'train' split"):
        env.tasks("test")


def test_problem_answer_parquet_and_directory(tmp_path):
    rows = [{"problem": "Compute $\\frac{6}{8}$.", "answer": "\\frac{3}{4}"}, {"problem": "2+2?", "answer": "4"}]
    path = tmp_path / "math.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    env = MathEnv(data=str(path))
    task = env.tasks("train", seed=0)
    task = {t.gold["answer"]: t for t in task}["\\frac{3}{4}"]
    assert task.messages[0]["role"] == "user" and "\\boxed{}" in task.messages[0]["content"]
    assert run(env, task, "\\boxed{0.75}")[1][0] == 1.0
    assert run(env, task, "\\boxed{3/5}")[1][0] == 0.0
    folder = tmp_path / "dir"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows)
    assert len(MathEnv(data=str(folder)).tasks("train")) == 2


def test_aime_parquet(tmp_path):
    rows = [{"problem_idx": 1, "problem": "Find the remainder when $2^{10}$ is divided by $1000$.", "answer": 24},
            {"problem_idx": 2, "problem": "Compute $7 \\cdot 11 \\cdot 13$.", "answer": 1001}]
    path = tmp_path / "aime.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    env = MathEnv()
    tasks = env.benchmark("aime26", source=str(path))
    assert [t.id for t in tasks] == ["aime26-1", "aime26-2"] and all(t.split == "aime26" for t in tasks)
    assert tasks[1].gold == {"kind": "math_verify", "answer": "1001"}
    assert run(env, tasks[0], "so \\boxed{024}")[1][0] == 1.0
    assert run(env, tasks[0], "so \\boxed{1024}")[1][0] == 0.0
    assert len(env.benchmark("aime26", source=str(path), n=1)) == 1


def test_gpqa_diamond_csv(tmp_path):
    rows = [{"Pre-Revision Question": "old", "Question": f"Which is option {i}?", "Correct Answer": f"right {i}",
             "Incorrect Answer 1": f"wrong a{i}", "Incorrect Answer 2": f"wrong b{i}",
             "Incorrect Answer 3": f"wrong c{i}", "Subdomain": "Physics", "Record ID": f"rec{i}"} for i in range(8)]
    path = tmp_path / "gpqa_diamond.csv"
    datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    env = MathEnv(seed=0)
    tasks = env.benchmark("gpqa_diamond", source=str(path))
    assert len(tasks) == 8
    letters = []
    for i, t in enumerate(tasks):
        text = t.messages[0]["content"]
        letter = t.gold["answer"]
        assert t.gold["kind"] == "choice" and f"{letter}) right {i}" in text
        assert all(f"{c}) " in text for c in "ABCD") and f"wrong a{i}" in text
        assert run(env, t, f"\\boxed{{({letter})}}")[1][0] == 1.0
        assert run(env, t, "\\boxed{" + ("A" if letter != "A" else "B") + "}")[1][0] == 0.0
        letters.append(letter)
    assert len(set(letters)) > 1  # shuffled, not always the first option
    assert [t.gold for t in MathEnv(seed=0).benchmark("gpqa_diamond", source=str(path))] == [t.gold for t in tasks]


def test_mmlu_redux_parquet_drops_flagged_rows(tmp_path):
    rows = [{"question": "2+2?", "choices": ["3", "4", "5", "6"], "answer": 1, "error_type": "ok",
             "source": "x", "correct_answer": None, "potential_reason": None},
            {"question": "Bad one?", "choices": ["a", "b", "c", "d"], "answer": 0,
             "error_type": "wrong_groundtruth", "source": "x", "correct_answer": "2", "potential_reason": "r"},
            {"question": "Capital of France?", "choices": ["Paris", "Rome", "Oslo", "Bern"], "answer": 0,
             "error_type": "ok", "source": "x", "correct_answer": None, "potential_reason": None}]
    path = tmp_path / "mmlu_redux.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    env = MathEnv()
    tasks = env.benchmark("mmlu_redux", source=str(path))
    assert [t.gold["answer"] for t in tasks] == ["B", "A"]
    assert "B) 4" in tasks[0].messages[0]["content"]
    assert run(env, tasks[0], "\\boxed{B}")[1][0] == 1.0 and run(env, tasks[0], "\\boxed{A}")[1][0] == 0.0


# ----------------------------------------------------------------------------- bad user input

def one_line(e):
    assert "\n" not in str(e.value) and str(e.value)


def test_bad_user_input(tmp_path, env):
    for call, pattern in [
        (lambda: MathEnv(data=str(tmp_path / "missing.jsonl")), "data not found"),
        (lambda: MathEnv(data=str(tmp_path / "nope" / "dir")), "data not found"),
        (lambda: env.tasks("dev"), "unknown split"),
        (lambda: env.tasks("test", n=-1), "non-negative"),
        (lambda: env.benchmark("aime24"), "unknown math benchmark"),
        (lambda: env.benchmark("aime26", source=str(tmp_path / "aime.parquet")), "data not found"),
    ]:
        with pytest.raises(UsageError, match=pattern) as e:
            call()
        one_line(e)


def test_malformed_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": \n')
    no_answer = write_jsonl(tmp_path / "no_answer.jsonl", [{"problem": "1+1"}])
    no_problem = write_jsonl(tmp_path / "no_problem.jsonl", [{"answer": "2"}])
    txt = tmp_path / "data.txt"
    txt.write_text("1+1=2")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    gpqa = write_jsonl(tmp_path / "gpqa.jsonl", [{"Question": "q", "Correct Answer": "a"}])
    mmlu = write_jsonl(tmp_path / "mmlu.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": 5}])
    for call, pattern in [
        (lambda: MathEnv(data=str(bad)), "malformed JSON on line 2 of"),
        (lambda: MathEnv(data=no_answer), "no answer"),
        (lambda: MathEnv(data=no_problem), "no problem"),
        (lambda: MathEnv(data=str(txt)), "unsupported data file"),
        (lambda: MathEnv(data=str(empty)), "cannot load|no rows"),
        (lambda: MathEnv().benchmark("gpqa_diamond", source=gpqa), "Incorrect Answer 1"),
        (lambda: MathEnv().benchmark("mmlu_redux", source=mmlu), "int answer index"),
    ]:
        with pytest.raises(UsageError, match=pattern) as e:
            call()
        one_line(e)


def test_benchmark_names():
    assert BENCHMARKS == ("aime26", "gpqa_diamond", "mmlu_redux")


def test_math_verify_grading_works_off_the_main_thread():
    # math-verify's timeout uses signal.alarm, which fails outside the main thread; grade must still work
    from concurrent.futures import ThreadPoolExecutor
    gold = {"kind": "math_verify", "answer": "\\frac{1}{2}"}
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda t: grade(t, gold), ["\\boxed{0.5}", "\\boxed{2}"])) == [1.0, 0.0]


def test_working_is_right_column_by_column():
    import random
    assert working(37, "+", 45) == ("7+5=12 so 2; 3+4+1=8 so 82", 82)
    assert working(105, "-", 98) == ("15-8=7 so 7; 10-9-1=0 so 07; 1-0-1=0 so 007", 7)
    assert working(47, "*", 6) == ("7*6=42 so 2; 4*6+4=28 so 282", 282)
    rng = random.Random(0)
    for _ in range(3000):
        op = rng.choice("+-*")
        a, b = rng.randint(0, 999), rng.randint(0, 9 if op == "*" else 999)
        a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
        want = a + b if op == "+" else a - b if op == "-" else a * b
        assert working(a, op, b)[1] == want
