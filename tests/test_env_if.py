"""Instruction following (envs/instruct.py): IFEval/IFBench checkers, the tiny writing world, real loaders."""
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import make_env
from envs.base import PROTOCOL_MARKERS, UsageError, tool_call_text
from envs.instruct import (
    ARENA,
    IFBENCH,
    IFEVAL,
    OOD_TYPES,
    PLACES,
    TRAIN_TYPES,
    IFEnv,
    _describe,
    _knowledge,
    check_instructions,
)

IFEVAL_IDS = {  # the 25 ids of google-research's INSTRUCTION_DICT
    "keywords:existence", "keywords:frequency", "keywords:forbidden_words", "keywords:letter_frequency",
    "language:response_language", "length_constraints:number_sentences", "length_constraints:number_paragraphs",
    "length_constraints:number_words", "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders", "detectable_content:postscript", "detectable_format:number_bullet_lists",
    "detectable_format:constrained_response", "detectable_format:number_highlighted_sections",
    "detectable_format:multiple_sections", "detectable_format:json_format", "detectable_format:title",
    "combination:two_responses", "combination:repeat_prompt", "startend:end_checker",
    "change_case:capital_word_frequency", "change_case:english_capital", "change_case:english_lowercase",
    "punctuation:no_comma", "startend:quotation"}

EN = "The cat sleeps on the warm table all day and the dog eats in the kitchen."
# (id, kwargs, a response that follows it, a response that does not): hand-made, one per IFEval type
CASES = [
    ("keywords:existence", {"keywords": ["moss", "rain"]}, "Moss grows in the RAIN.", "Moss grows here."),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "at least"}, "A cat and a Cat.", "One cat."),
    ("keywords:forbidden_words", {"forbidden_words": ["red"]}, "A reddish sky.", "A Red sky."),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "less than"},
     "A lazy dog.", "Zany zebras."),
    ("language:response_language", {"language": "fr"},
     "Le chat dort sur la table et le chien mange dans la cuisine.", EN),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"}, "One. Two.",
     "One. Two! Three?"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First part.\n***\nSecond part.",
     "First.\n***\n\n***\nSecond."),
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "one two three four five",
     "one two three four"),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
     "First we go.\n\n\"Then, we rest.", "First we go.\n\nNow we rest."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name], at [address].",
     "Dear [name], at address]."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. bye", "Hi. PS bye"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two", "* one\n* two\n- three"),
    ("detectable_format:constrained_response", {}, "I think so. My answer is yes.", "Yes."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", "*one* and * *"),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nA\nSection 2\nB", "Section 1\nA and B"),
    ("detectable_format:json_format", {}, '```json\n{"a": [1, 2]}\n```', '{"a": [1, 2]'),
    ("detectable_format:title", {}, "<<Poem of Joy>>\nLa la.", "<<  >> La la."),
    ("combination:two_responses", {}, "A cat.\n******\nA dog.", "A cat.\n******\nA cat."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, "write a poem. Roses are red.",
     "Sure! Write a poem."),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, 'Done. any other questions?"',
     "Any other questions? Done."),
    ("startend:quotation", {}, '  "Hello there."  ', '"Hello there.'),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "at least"},
     "THE BIG dog.", "The BIG dog."),
    ("change_case:english_capital", {}, EN.upper(), EN),
    ("change_case:english_lowercase", {}, EN.lower(), EN),
    ("punctuation:no_comma", {}, "No commas here.", "Yes, one comma."),
]

IFBENCH_CASES = [  # the most frequent IFBench ids, plus the tiny arena's own held-out types
    ("sentence:keyword", {"word": "moss", "N": 2}, "First one. Then moss grows.", "Moss first. Then none."),
    ("words:consonants", {}, "strong black crypts", "strong black cat"),
    ("format:sub-bullets", {}, "* a\n - b\n* c\n - d", "* a\n - b\n* c"),
    ("ratio:stop_words", {"percentage": 40}, "Cats chase mice quickly.", "The cat is in the house."),
    ("count:word_count_range", {"min_words": 3, "max_words": 5}, "one two three", "one two"),
    ("count:keywords_multiple", {"keyword1": "a1", "keyword2": "b2", "keyword3": "c3", "keyword4": "d4",
                                 "keyword5": "e5"}, "a1 " + "b2 " * 2 + "c3 " * 3 + "d4 " * 5 + "e5 " * 7,
     "a1 b2 c3 d4 e5"),
    ("format:line_indent", {}, "a\n b\n  c", "a\n b\nc"),
    ("words:no_consecutive", {}, "A big cat.", "A big bad cat."),
    ("arena:exclamation", {}, "It is big! It is old!", "It is big! It is old."),
    ("arena:letter_words", {"letter": "b", "N": 2}, "A bold blue kite.", "A bold bold kite."),
]

SAMPLE_KWARGS = {**{i: kw for i, kw, _, _ in CASES + IFBENCH_CASES}, **{  # kwargs for every checker with kwargs
    "count:unique_word_count": {"N": 3}, "count:conjunctions": {"small_n": 2}, "count:person_names": {"N": 1},
    "ratio:overlap": {"reference_text": "the cat and the dog", "percentage": 50}, "count:numbers": {"N": 1},
    "format:options": {"options": "yes/no/maybe"}, "count:words_japanese": {"N": 2}, "words:repeats": {"small_n": 1},
    "count:pronouns": {"N": 2}, "sentence:increment": {"small_n": 1}, "format:list": {"sep": "..."},
    "words:keywords_specific_position": {"keyword": "cat", "n": 1, "m": 2}, "words:words_position": {"keyword": "cat"},
    "repeat:repeat_change": {"prompt_to_repeat": "Tell me a story"},
    "repeat:repeat_span": {"prompt_to_repeat": "Tell me a story", "n_start": 5, "n_end": 8}}}
ALL_IDS = sorted({**IFEVAL, **IFBENCH, **ARENA})


def run_episode(env, task, text, truncated=False):
    state = env.reset(task)
    while not state.done:
        assert env.step(state, text) == []
    state.truncated = truncated
    return env.score(state)


# ----------------------------------------------------------------------------- checkers

def test_all_25_ifeval_types_are_implemented_and_tested():
    assert set(IFEVAL) == IFEVAL_IDS and len(IFEVAL) == 25
    assert {c[0] for c in CASES} == IFEVAL_IDS


@pytest.mark.parametrize("iid,kwargs,good,bad", CASES + IFBENCH_CASES, ids=[c[0] for c in CASES + IFBENCH_CASES])
def test_checker_pass_and_fail(iid, kwargs, good, bad):
    assert check_instructions(good, [iid], [kwargs])["strict"] == [True]
    result = check_instructions(bad, [iid], [kwargs])
    assert result["strict"] == [False] and result["prompt_strict"] is False


def test_loose_differs_from_strict():
    # a chatty first line breaks the quotation; loose drops it
    r = check_instructions('Sure, here it is:\n"The answer."', ["startend:quotation"], [{}])
    assert r["strict"] == [False] and r["loose"] == [True] and r["prompt_loose"] and not r["prompt_strict"]
    # markdown bold around the end phrase: loose deletes every '*'
    r = check_instructions("Done. **Any other questions?**", ["startend:end_checker"],
                           [{"end_phrase": "Any other questions?"}])
    assert r["strict"] == [False] and r["loose"] == [True]
    # a real violation stays a violation under loose
    assert check_instructions("Yes, no.", ["punctuation:no_comma"], [{}])["loose"] == [False]


def test_prompt_level_needs_every_instruction():
    ids, kws = ["punctuation:no_comma", "startend:end_checker"], [{}, {"end_phrase": "Bye."}]
    assert check_instructions("Hello there. Bye.", ids, kws)["prompt_strict"] is True
    r = check_instructions("Hello, there. Bye.", ids, kws)
    assert r["strict"] == [False, True] and r["prompt_strict"] is False


def test_none_kwargs_dropped_think_stripped_empty_fails():
    kw = {"num_words": 3, "relation": "less than", "keyword": None, "language": None}  # HF rows carry every key
    assert check_instructions("<think>many many many words</think>Two words", ["length_constraints:number_words"],
                              [kw])["strict"] == [True]
    assert check_instructions("   ", ["punctuation:no_comma"], [{}])["strict"] == [False]  # empty follows nothing
    prompt = "Say hi."  # repeat_prompt without its kwarg falls back to the prompt
    assert check_instructions("Say hi. Hi!", ["combination:repeat_prompt"], [{}], prompt=prompt)["strict"] == [True]


def test_bad_instruction_data_raises_enverror():
    with pytest.raises(UsageError, match="unknown instruction id 'nope:x'"):
        check_instructions("text", ["nope:x"], [{}])
    with pytest.raises(UsageError, match="relation"):
        check_instructions("text", ["length_constraints:number_words"], [{"num_words": 3, "relation": "about"}])
    with pytest.raises(UsageError, match="num_bullets"):
        check_instructions("text", ["detectable_format:number_bullet_lists"], [{}])
    with pytest.raises(UsageError, match="2 instruction ids but 1 kwargs"):
        check_instructions("text", ["punctuation:no_comma", "startend:quotation"], [{}])


PIECES = st.sampled_from(["{", "}", '"', "*", "**", "***", "******", "\n", "\n\n", "<<", ">>", "[", "]", "<think>",
                          "</think>", "P.S.", "Section 1", "```json", tool_call_text("search", {"q": 1}),
                          "<tool_call>{bad", "é", "日本", "\U0001F600", "?!", "(", "<i>", "</i>", " ", "-", "."])
TEXTS = st.one_of(st.text(max_size=200), st.lists(st.one_of(PIECES, st.text(max_size=5)), max_size=30).map("".join))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS)
def test_fuzz_every_checker_is_total(text):
    for iid in ALL_IDS:
        r = check_instructions(text, [iid], [SAMPLE_KWARGS.get(iid, {})])
        assert set(r) == {"strict", "loose", "prompt_strict", "prompt_loose"}
        assert isinstance(r["strict"][0], bool) and isinstance(r["loose"][0], bool)
        assert r["loose"][0] or not r["strict"][0]  # loose is never stricter than strict


def test_endless_and_odd_text_is_fast_and_safe():
    import time
    for text in ["[" * 50000, "<<" * 30000, "\n" * 50000, "a" * 100000, "*" * 50000, "[" * 10000 + "]",
                 "{" * 5000, b"\xff\xfe".decode("latin-1") * 1000]:
        start = time.time()
        for iid in ALL_IDS:
            check_instructions(text, [iid], [SAMPLE_KWARGS.get(iid, {})])
        assert time.time() - start < 5, repr(text[:10])


# ----------------------------------------------------------------------------- the environment, tiny arena

def test_make_env_and_golden_transcripts():
    env = make_env("if")
    assert isinstance(env, IFEnv) and env.domain == "if" and env.max_turns == 1
    task = next(t for t in env.tasks("test", n=50) if len(t.gold["instruction_id_list"]) >= 2)
    assert task.tools is None and task.messages[-1]["role"] == "user"
    reward, m = run_episode(env, task, task.gold["reference"])  # correct answer
    n = len(task.gold["instruction_id_list"])
    assert reward == 1.0 and m["prompt_strict"] == m["prompt_loose"] == m["inst_strict"] == 1.0
    assert m["inst_total"] == m["inst_followed_strict"] == m["inst_followed_loose"] == float(n)
    assert all(isinstance(v, float) for v in m.values())
    reward, m = run_episode(env, task, "")  # no answer
    assert reward == 0.0 and m["inst_followed_strict"] == 0.0 and m["inst_total"] == float(n)
    reward, m = run_episode(env, task, task.gold["reference"], truncated=True)  # cut by the token limit
    assert reward == 0.0 and m["truncated"] == 1.0


def test_wrong_answers_score_zero():
    env = IFEnv()
    # one specific, hand-checkable task: a title and a keyword
    task = env.reset(env.tasks("test", n=1)[0]).task
    task.gold.update(instruction_id_list=["detectable_format:title", "keywords:existence"],
                     kwargs=[{}, {"keywords": ["moss"]}])
    assert run_episode(env, task, "<<Fair>>\nThe fair has moss.")[0] == 1.0
    reward, m = run_episode(env, task, "<<Fair>>\nThe fair has rain.")  # wrong keyword
    assert reward == 0.0 and m["inst_followed_strict"] == 1.0 and m["inst_strict"] == 0.5
    assert run_episode(env, task, "The fair has moss.")[0] == 0.0  # rule ignored


def test_every_generated_task_is_solvable():
    env = IFEnv()
    for split in ("train", "val", "test", "ood"):
        for task in env.tasks(split, n=40, seed=3):
            assert run_episode(env, task, task.gold["reference"])[0] == 1.0, task.gold


def test_generator_is_deterministic_and_sized():
    env = IFEnv()
    a, b = env.tasks("test", n=20, seed=7), env.tasks("test", n=20, seed=7)
    assert [(t.id, t.messages, t.gold) for t in a] == [(t.id, t.messages, t.gold) for t in b]
    assert [t.messages for t in env.tasks("test", n=20, seed=8)] != [t.messages for t in a]
    assert len(env.tasks("ood")) == 300 and len({t.id for t in env.tasks("ood")}) == 300


def test_splits_are_disjoint_and_ood_types_held_out():
    env = IFEnv()
    assert not set(TRAIN_TYPES) & set(OOD_TYPES)
    pools = [set(PLACES[s]) for s in ("train", "val", "test", "ood")]
    assert sum(map(len, pools)) == len(set().union(*pools))
    by_split = {s: env.tasks(s, n=150) for s in ("train", "val", "test", "ood")}
    topics = {s: {tuple(t.gold["topic"]) for t in ts} for s, ts in by_split.items()}
    prompts = {s: {t.messages[-1]["content"] for t in ts} for s, ts in by_split.items()}
    for s1 in by_split:
        for s2 in by_split:
            if s1 < s2:
                assert not topics[s1] & topics[s2] and not prompts[s1] & prompts[s2]
    assert all(set(t.gold["instruction_id_list"]) <= set(OOD_TYPES) for t in by_split["ood"])
    assert all(set(t.gold["instruction_id_list"]) <= set(TRAIN_TYPES) for t in by_split["test"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(TEXTS, st.just(None), st.integers()), idx=st.integers(0, 19))
def test_fuzz_env_never_raises_and_reward_in_range(text, idx):
    env = IFEnv()
    task = (env.tasks("test", n=10) + env.tasks("ood", n=10))[idx]
    reward, m = run_episode(env, task, text)
    assert 0.0 <= reward <= 1.0 and 0.0 <= m["inst_strict"] <= m["inst_loose"] <= 1.0
    assert reward == m["prompt_strict"]


def test_bad_user_input():
    env = IFEnv()
    with pytest.raises(UsageError, match="unknown split 'dev'"):
        env.tasks("dev")
    with pytest.raises(UsageError, match="unknown benchmark 'mmlu'"):
        env.benchmark("mmlu")
    with pytest.raises(UsageError, match="not found"):
        env.benchmark("ifeval", source="/no/such/ifeval.jsonl")
    with pytest.raises(UsageError, match="not found"):
        IFEnv(data="./missing_dir/train.parquet").tasks("train")
    with pytest.raises(UsageError, match="unknown domain"):
        make_env("iff")



# ----------------------------------------------------------------------------- the base's reading (knowledge)

@pytest.fixture(scope="module")
def knowledge_2000():
    return _knowledge(2000, seed=0)


def test_knowledge_is_deterministic_and_sized():
    docs = IFEnv().knowledge(50, seed=3)
    assert len(docs) == 50 and all(isinstance(d, str) and d.strip() for d in docs)
    assert docs == IFEnv().knowledge(50, seed=3) != IFEnv().knowledge(50, seed=4)


def test_knowledge_never_holds_the_protocol(knowledge_2000):
    docs = [r["doc"] for r in knowledge_2000[:500]]
    assert not [d for d in docs if any(m in d for m in PROTOCOL_MARKERS)]
    assert not [d for d in docs if "Writing task" in d]  # the stage's system prompt is no document either


def test_knowledge_topics_are_train_places_only(knowledge_2000):
    import re
    held_out = re.compile(r"\b(" + "|".join(PLACES["val"] + PLACES["test"] + PLACES["ood"]) + r")\b", re.I)
    docs = [r["doc"] for r in knowledge_2000]
    assert not [d for d in docs if held_out.search(d)]
    assert sum(any(p in d for p in PLACES["train"]) for d in docs) == len(docs)  # every document is about one


def test_knowledge_kinds_and_every_type_in_the_pairs(knowledge_2000):
    kinds = [r["kind"] for r in knowledge_2000]
    assert all(500 <= kinds.count(k) <= 850 for k in ("pair", "sample", "prose"))
    pairs = [r for r in knowledge_2000 if r["kind"] == "pair"]
    for r in pairs:  # the instruction is worded as the stage words it
        assert all(_describe(i, k) in r["doc"] for i, k in zip(r["ids"], r["kwargs"]))
    assert {i for r in pairs for i in r["ids"]} == set(TRAIN_TYPES) | set(OOD_TYPES)
    assert {i for r in knowledge_2000 if r["kind"] == "sample" for i in r["ids"]} == set(TRAIN_TYPES) | set(OOD_TYPES)
    assert max(len(r["ids"]) for r in pairs) == 3


def test_knowledge_answers_follow_their_instructions(knowledge_2000):
    shown = [r for r in knowledge_2000 if r["kind"] != "prose"]
    for r in shown:
        assert r["doc"].endswith("\n" + r["text"]) or r["doc"].endswith(" " + r["text"])
        assert check_instructions(r["text"], r["ids"], r["kwargs"])["prompt_strict"], r["doc"]
    lengths = [len(r["doc"]) for r in knowledge_2000]
    assert sum(n < 600 for n in lengths) >= 0.95 * len(lengths)

# ----------------------------------------------------------------------------- real loaders on local fixtures

KWARG_KEYS = ["num_words", "relation", "end_phrase", "keywords", "language", "prompt_to_repeat", "N", "word",
              "keyword1", "keyword2", "keyword3", "keyword4", "keyword5"]


def _row(key, prompt, ids, kwargs):
    """A row as google/IFEval and allenai/IFBench_test store it: every kwarg name, unused ones null."""
    return {"key": key, "prompt": prompt, "instruction_id_list": ids,
            "kwargs": [{k: kw.get(k) for k in KWARG_KEYS} for kw in kwargs]}


IFEVAL_ROWS = [
    _row(1000, "Write a short note. Answer with less than 8 words. End with the phrase Bye now.",
         ["length_constraints:number_words", "startend:end_checker"],
         [{"num_words": 8, "relation": "less than"}, {"end_phrase": "Bye now."}]),
    _row(1001, "Repeat this request, then answer.", ["combination:repeat_prompt", "keywords:existence"],
         [{"prompt_to_repeat": "Repeat this request"}, {"keywords": ["owl", "moon"]}]),
    _row(1002, "Reply in French.", ["language:response_language"], [{"language": "fr"}]),
]
ANSWERS = {"1000": ("Short note. Bye now.", "This note is much too long for the limit. Bye now."),
           "1001": ("Repeat this request. An owl saw the moon.", "An owl saw the moon."),
           "1002": ("Le chat dort sur la table et le chien mange dans la cuisine.", EN)}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_ifeval_loader_real_format(tmp_path, fmt):
    if fmt == "jsonl":
        source = _write_jsonl(tmp_path / "ifeval_input_data.jsonl", IFEVAL_ROWS)
    else:
        import pandas as pd
        source = str(tmp_path / "train-00000-of-00001.parquet")
        pd.DataFrame(IFEVAL_ROWS).to_parquet(source)
    env = IFEnv()
    tasks = env.benchmark("ifeval", source=source)
    assert [t.id for t in tasks] == ["if-ifeval-1000", "if-ifeval-1001", "if-ifeval-1002"]
    assert all(t.split == "ifeval" and t.env == "if" and t.messages[0]["role"] == "user" for t in tasks)
    for t in tasks:
        good, bad = ANSWERS[t.id.split("-")[-1]]
        assert run_episode(env, t, good)[0] == 1.0
        reward, m = run_episode(env, t, bad)
        assert reward == 0.0 and m["inst_total"] == float(len(t.gold["instruction_id_list"]))
    assert len(env.benchmark("ifeval", source=str(tmp_path), n=2)) == 2  # a folder of files works too
    train = IFEnv(data=source).tasks("train", n=2, seed=1)  # the same rows as training prompts
    assert len(train) == 2 and {t.split for t in train} == {"train"} and train[0].id.startswith("if-train-")


def test_ifbench_loader_unknown_ids(tmp_path, capsys):
    rows = [_row("0", "Write about owls.", ["sentence:keyword"], [{"word": "owl", "N": 2}]),
            _row("1", "Keywords.", ["count:keywords_multiple"],
                 [{"keyword1": "a1", "keyword2": "b2", "keyword3": "c3", "keyword4": "d4", "keyword5": "e5"}]),
            _row("2", "Start with a verb.", ["words:start_verb"], [{}])]
    source = _write_jsonl(tmp_path / "IFBench_test.jsonl", rows)
    with pytest.raises(UsageError, match="words:start_verb"):
        IFEnv().benchmark("ifbench", source=source)
    env = IFEnv(skip_unknown=True)
    tasks = env.benchmark("ifbench", source=source)
    assert "dropped 1 rows" in capsys.readouterr().out
    assert [t.id for t in tasks] == ["if-ifbench-0", "if-ifbench-1"]
    assert run_episode(env, tasks[0], "Night falls. The owl wakes.")[0] == 1.0
    assert run_episode(env, tasks[0], "The owl wakes. Night falls.")[0] == 0.0


def test_malformed_task_files(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"key": 1, "prompt": "x"\n')
    with pytest.raises(UsageError, match="malformed JSON on line 1 of"):
        IFEnv().benchmark("ifeval", source=str(bad_json))
    no_cols = _write_jsonl(tmp_path / "nocols.jsonl", [{"key": 1, "text": "x"}])
    with pytest.raises(UsageError, match="lacks prompt/instruction_id_list/kwargs"):
        IFEnv().benchmark("ifeval", source=no_cols)
    bad_kw = _write_jsonl(tmp_path / "badkw.jsonl", [_row(7, "x", ["length_constraints:number_words"],
                                                          [{"num_words": 5, "relation": "roughly"}])])
    with pytest.raises(UsageError, match="row 7"):
        IFEnv().benchmark("ifeval", source=bad_kw)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no .jsonl/.json/.parquet/.csv files"):
        IFEnv().benchmark("ifeval", source=str(tmp_path / "empty"))


def test_tiny_tasks_are_cached_on_disk_and_equal_to_a_fresh_generation(tmp_path, monkeypatch):
    """The tiny train split (5,000 tasks, ~50 s of langdetect) is built once per (split, n, seed, source) and read back
    by every later process; a corrupt cache file is rebuilt, an unwritable cache directory only costs the time."""
    import random

    import envs.instruct as instruct
    monkeypatch.setenv("ACLARENA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(instruct, "_TASKS", {})
    fresh = instruct._generate("train", 40, random.Random("if:train:7"))
    for i, t in enumerate(fresh):
        t.id = f"if-train-7-{i}"
    assert IFEnv().tasks("train", n=40, seed=7) == fresh
    (path,) = (tmp_path / "cache").iterdir()
    monkeypatch.setattr(instruct, "_TASKS", {})                       # a new process: read back, never regenerated
    monkeypatch.setattr(instruct, "_generate", lambda *a: pytest.fail("regenerated despite the cache"))
    assert IFEnv().tasks("train", n=40, seed=7) == fresh
    monkeypatch.undo()
    monkeypatch.setenv("ACLARENA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(instruct, "_TASKS", {})
    path.write_text("{not json")
    assert IFEnv().tasks("train", n=40, seed=7) == fresh and len(json.load(open(path))) == 40
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("ACLARENA_CACHE", str(blocker))               # a file where the directory should be
    monkeypatch.setattr(instruct, "_TASKS", {})
    assert IFEnv().tasks("train", n=40, seed=7) == fresh


def test_a_failed_cache_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A write that fails half-way (a full disk: json.dump raising OSError; a kill: KeyboardInterrupt) leaves the cache
    directory as it was: no `.tmp-` file; the full disk only costs the time, the kill still stops the process."""
    import envs.instruct as instruct
    monkeypatch.setenv("ACLARENA_CACHE", str(tmp_path / "cache"))
    for err in (OSError("No space left on device"), KeyboardInterrupt()):
        monkeypatch.setattr(instruct, "_TASKS", {})
        real_dump = json.dump

        def dump(obj, f, *a, err=err, **kw):
            f.write("[")   # half a file on disk, then the failure
            raise err
        monkeypatch.setattr(json, "dump", dump)
        if isinstance(err, OSError):
            assert len(IFEnv().tasks("train", n=10, seed=3)) == 10
        else:
            with pytest.raises(KeyboardInterrupt):
                IFEnv().tasks("train", n=10, seed=3)
        monkeypatch.setattr(json, "dump", real_dump)
        assert os.listdir(tmp_path / "cache") == []
