"""The search environment: golden episodes, fuzzing, the tiny world, real loaders and retrievers."""
import json
import os
import re
import socket
import sys

import pytest
from fake_http import JSONServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import make_env
from envs.base import UsageError, tool_call_text
from envs.search import (
    BENCHMARKS,
    PARAPHRASE_QS,
    SINGLE_HOP_QS,
    TWO_HOP_QS,
    SearchEnv,
    build_world,
    exact_match,
    f1_score,
    normalize_answer,
    world_questions,
)

ENV = SearchEnv()  # the tiny world; built once (about 0.3 s)


def run(env, task, turns):
    """Drive an episode like the rollout loop; returns (reward, metrics, state, observations)."""
    state, observations = env.reset(task), []
    for text in turns:
        if state.done:
            break
        observations.append(env.step(state, text))
    reward, metrics = env.score(state)
    return reward, metrics, state, observations


def search(query):
    return tool_call_text("search", {"query": query})


# ---------------------------------------------------------------- metrics

def test_normalisation_em_f1():
    assert normalize_answer("  The Beatles!! ") == "beatles"
    assert exact_match("the beatles", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("Beatle", "Beatles") == 0.0
    assert f1_score("Podras", ["Podras Labs"]) == pytest.approx(2 / 3)
    assert f1_score("Podras Labs", ["x", "podras labs."]) == 1.0
    assert f1_score("yes", ["no"]) == 0.0 and f1_score("no", ["no"]) == 1.0
    assert f1_score("", ["a b"]) == 0.0


# ---------------------------------------------------------------- golden transcripts (tiny world)

def test_golden_single_hop_episode_scores_one():
    task = ENV.tasks("test", 1)[0]
    subject, answer = task.gold["path"][0], task.gold["answers"][0]
    reward, metrics, state, obs = run(ENV, task, [search(subject), f"<answer>{answer}</answer>"])
    assert obs[0][0]["role"] == "tool" and obs[0][0]["content"].startswith(f"[1] {subject}: ")
    assert answer in obs[0][0]["content"]
    assert state.done and state.turns == 2 and obs[1] == []
    assert reward == 1.0 and metrics == {"em": 1.0, "f1": 1.0, "searches": 1.0, "answered": 1.0}
    assert [m["role"] for m in state.messages] == ["system", "user", "assistant", "tool", "assistant"]


def test_golden_two_hop_ood_episode_scores_one():
    task = next(t for t in ENV.tasks("ood", 50) if t.gold["attrs"] == ["born", "country"])
    person, city = task.gold["path"]
    reward, metrics, _, obs = run(ENV, task, [search(person), search(city), f"<answer>{task.gold['answers'][0]}</answer>"])
    assert city in obs[0][0]["content"] and task.gold["answers"][0] in obs[1][0]["content"]
    assert reward == 1.0 and metrics["searches"] == 2.0


def test_wrong_answer_scores_zero():
    task = next(t for t in ENV.tasks("test", 50) if t.gold["attrs"] == ["employer"])
    org = task.gold["answers"][0]  # e.g. "Podras Labs": answering only "Podras" is partly right
    reward, metrics, _, _ = run(ENV, task, [search(task.gold["path"][0]), f"<answer>{org.split()[0]}</answer>"])
    assert reward == 0.0 and metrics["em"] == 0.0 and 0 < metrics["f1"] < 1 and metrics["answered"] == 1.0


def test_wrong_tool_arguments_score_zero():
    task = next(t for t in ENV.tasks("test", 50) if t.gold["attrs"] == ["born"])
    other = next(t for t in ENV.tasks("test", 50) if t.gold["attrs"] == ["born"]
                 and t.gold["answers"] != task.gold["answers"])
    # Searching the wrong person and copying that passage's birthplace is wrong.
    _, _, _, obs = run(ENV, task, [search(other.gold["path"][0])])
    copied = other.gold["answers"][0]
    assert copied in obs[0][0]["content"]
    reward, metrics, _, _ = run(ENV, task, [search(other.gold["path"][0]), f"<answer>{copied}</answer>"])
    assert reward == 0.0 and metrics["searches"] == 1.0
    # A misnamed argument is an error observation, not a search.
    bad = tool_call_text("search", {"q": task.gold["path"][0]})
    reward, metrics, state, obs = run(ENV, task, [bad, "<answer>Nowhere</answer>"])
    assert obs[0][0]["content"].startswith("error:") and metrics["searches"] == 0.0 and reward == 0.0


def test_answer_without_search_is_still_graded():
    task = ENV.tasks("test", 1)[0]
    reward, metrics, _, _ = run(ENV, task, [f"I know. <answer>{task.gold['answers'][0]}</answer>"])
    assert reward == 1.0 and metrics["searches"] == 0.0 and metrics["answered"] == 1.0


def test_no_tool_call_and_no_answer_ends_with_zero():
    task = ENV.tasks("test", 1)[0]
    reward, metrics, state, obs = run(ENV, task, [f"It is {task.gold['answers'][0]}.", "never read"])
    assert state.done and state.turns == 1 and obs == [[]]
    assert reward == 0.0 and metrics["answered"] == 0.0


def test_turn_limit_and_truncation():
    task = ENV.tasks("test", 1)[0]
    reward, metrics, state, _ = run(ENV, task, [search("x y")] * 10)
    assert state.done and state.turns == ENV.max_turns == 4 and metrics["searches"] == 4.0 and reward == 0.0
    state = ENV.reset(task)
    ENV.step(state, search(task.gold["path"][0]))
    state.truncated = True  # the rollout loop cut it before an answer
    assert ENV.score(state) == (0.0, {"em": 0.0, "f1": 0.0, "searches": 1.0, "answered": 0.0})


def test_tool_call_turn_is_not_final_and_unknown_tools_are_observations():
    task = ENV.tasks("test", 1)[0]
    text = (tool_call_text("lookup", {"query": "a"}) + "<tool_call>{broken</tool_call>"
            + tool_call_text("search", {"query": 7}) + f"<answer>{task.gold['answers'][0]}</answer>")
    _, metrics, state, obs = run(ENV, task, [text])
    assert not state.done and metrics["answered"] == 0.0 and metrics["searches"] == 0.0
    assert len(obs[0]) == 3 and all(m["role"] == "tool" and m["content"].startswith("error:") for m in obs[0])
    _, _, _, obs = run(ENV, task, [search("a") * 5])
    assert obs[0][-1]["content"].startswith("error: at most")


# ---------------------------------------------------------------- fuzzing

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
TURN = st.one_of(
    st.text(max_size=300),
    st.builds(lambda s: f"<tool_call>{s}</tool_call>", st.text(max_size=80)),
    st.builds(lambda name, args: tool_call_text(name, args), st.sampled_from(["search", "Search", "", "rm -rf"]),
              st.dictionaries(st.sampled_from(["query", "q", "topk"]), JSON, max_size=2)),
    st.builds(lambda a: f"<answer>{a}</answer>", st.text(max_size=60)),
    st.builds(lambda v: '<tool_call>{"name": "search", "arguments": ' + json.dumps(v) + "}</tool_call>", JSON),
    st.just("<tool_call>" * 3), st.just("x" * 5000), st.just("<answer></answer>"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(TURN, min_size=0, max_size=6), split=st.sampled_from(["test", "ood"]))
def test_fuzz_never_raises_and_rewards_stay_in_range(turns, split):
    reward, metrics, state, obs = run(ENV, ENV.tasks(split, 3)[0], turns)
    assert 0.0 <= reward <= 1.0 and set(metrics) == {"em", "f1", "searches", "answered"}
    assert all(isinstance(v, float) for v in metrics.values()) and 0 <= metrics["f1"] <= 1
    assert state.turns <= ENV.max_turns and all(isinstance(m["content"], str) for o in obs for m in o)


@settings(max_examples=60, deadline=None)
@given(query=st.text(max_size=400))
def test_fuzz_search_tool(query):
    out = ENV.search(query)
    assert isinstance(out, str) and (out.startswith("[1] ") or out in ("no results", "error: empty query"))


# ---------------------------------------------------------------- the tiny world

def test_generator_is_deterministic():
    other = SearchEnv()
    for split in ("train", "test", "ood"):
        assert [t.gold for t in ENV.tasks(split, 40, seed=3)] == [t.gold for t in other.tasks(split, 40, seed=3)]
    assert [t.gold for t in ENV.tasks("test", 40, seed=0)] != [t.gold for t in ENV.tasks("test", 40, seed=1)]
    assert ENV.knowledge(20, seed=5) == other.knowledge(20, seed=5) != ENV.knowledge(20, seed=6)
    assert SearchEnv(seed=1).world.keys() != ENV.world.keys()
    assert len(ENV.tasks("train")) == 5000 and len(ENV.tasks("test")) == len(ENV.tasks("ood")) == 300
    assert len({t.id for t in ENV.tasks("test")}) == 300
    assert len({t.gold["question"] for t in ENV.tasks("test")}) == 300  # distinct questions, no repeats


def test_splits_are_disjoint_and_ood_is_two_hop_or_reworded():
    names = {s: {n for t in ENV.tasks(s, 300) for n in t.gold["path"]} for s in ("train", "val", "test", "ood")}
    # Answers are names from the split's own sub-world too (founding years are shared, they are numbers).
    answers = {s: {t.gold["answers"][0] for t in ENV.tasks(s, 300)} - {str(y) for y in range(1850, 2020)}
               for s in ("train", "val", "test", "ood")}
    for a in names:
        for b in names:
            if a < b:
                assert not names[a] & names[b] and not answers[a] & answers[b], (a, b)
    assert {len(t.gold["path"]) for t in ENV.tasks("test")} == {1}
    ood = ENV.tasks("ood")
    two_hop = [t for t in ood if len(t.gold["path"]) == 2]
    assert 0.35 < len(two_hop) / len(ood) < 0.65           # about half two-hop, half single-hop in other words
    reworded = {q.format(t.gold["path"][0]) for t in ood for q, _, _ in PARAPHRASE_QS}
    assert all(t.gold["question"] in reworded for t in ood if len(t.gold["path"]) == 1)
    assert not {q for q, _, _ in SINGLE_HOP_QS} & {q for q, _, _ in PARAPHRASE_QS}


def test_every_subject_passage_ranks_first():
    for split in ("train", "val", "test", "ood"):
        for _, _, path, _ in world_questions(ENV.world, split):
            for name in path:
                assert ENV.search(name).startswith(f"[1] {name}: "), name


def test_knowledge_reads_like_the_tool_and_names_no_held_out_entity():
    from envs.base import PROTOCOL_MARKERS
    held_out = frozenset(e["name"] for e in ENV.world.values() if e["pool"] != "train")
    docs = ENV.knowledge(300, seed=4)
    assert not [d for d in docs if any(m in d for m in PROTOCOL_MARKERS)]
    text = "\n".join(docs)
    assert not [n for n in held_out if re.search(rf"\b{re.escape(n)}\b", text)]
    # a reading document's answer is what its world says: rebuild each document's world and check
    n_read = n_two = 0
    for w in range(0, 300, 100):
        world = build_world(f"{ENV.seed}:knowledge:4:{w}", held_out)
        golds = {}
        for e in world.values():
            if e["pool"] == "train":
                golds.update({q.format(e["name"]): e[a] for q, k, a in SINGLE_HOP_QS + PARAPHRASE_QS if k == e["kind"]})
                golds.update({q.format(e["name"]): world[e[a1]][a2] for q, k, a1, a2 in TWO_HOP_QS if k == e["kind"]})
        for d in docs[w:w + 100]:
            for part in d.split("\n\n"):
                if part.startswith("Question: "):
                    question, answer = part.split("\n")[0][len("Question: "):], part.rsplit("\nAnswer: ", 1)[1]
                    assert golds[question] == answer, (question, answer)
                    assert part.split("\n")[1].startswith("[1] ")      # the passages as the tool shows them
                    n_read += 1
                    n_two += part.count("[1] ") == 2
    assert n_read > 150 and n_two > 20
    # fresh worlds: the same name parts recombined with other facts, so neither can be memorised
    a, b = (build_world(f"{ENV.seed}:knowledge:4:{w}", held_out) for w in (0, 100))
    shared = set(a) & set(b)
    assert len(shared) < len(a) // 2 and sum(a[k] != b[k] for k in shared) > 0.8 * len(shared)


# ---------------------------------------------------------------- real data: loaders and retrievers

def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


WIKI = [{"id": "0", "contents": '"Ada Lovelace"\nAda Lovelace was an English mathematician born in London.'},
        {"id": "1", "contents": '"London"\nLondon is the capital city of England and the United Kingdom.'},
        {"id": "2", "contents": '"Charles Babbage"\nCharles Babbage designed the Analytical Engine.'},
        {"id": "3", "contents": '"Paris"\nParis is the capital of France.'}]


@pytest.fixture
def flashrag(tmp_path):
    qa = lambda i, q, a: {"id": f"{i}", "question": q, "golden_answers": a}
    write_jsonl(tmp_path / "qa/nq/train.jsonl", [qa("train_0", "where was ada lovelace born?", ["London"])])
    write_jsonl(tmp_path / "qa/nq/test.jsonl", [qa("test_0", "capital of france?", ["Paris", "Paris, France"])])
    write_jsonl(tmp_path / "qa/hotpotqa/train.jsonl", [qa("h0", "who designed the analytical engine?", ["Babbage"])])
    write_jsonl(tmp_path / "qa/hotpotqa/dev.jsonl", [qa("h1", "what country's capital was ada born in?", ["England"])])
    write_jsonl(tmp_path / "qa/bamboogle/test.jsonl", [qa(i, f"q{i}", [f"a{i}"]) for i in range(5)])
    return tmp_path


def test_wiki18_corpus_and_flashrag_data(flashrag):
    corpus = write_jsonl(flashrag / "wiki-18.jsonl", WIKI)
    env = make_env("search", data=str(flashrag / "qa"), corpus=str(corpus))
    assert env.max_turns == 5 and env.topk == 3
    train = env.tasks("train")
    assert sorted(t.gold["dataset"] for t in train) == ["hotpotqa", "nq"] and all(t.split == "train" for t in train)
    assert {t.gold["dataset"] for t in env.tasks("test")} == {"nq", "hotpotqa"}  # hotpotqa: dev.jsonl
    assert len(env.tasks("ood")) == 5 and len(env.tasks("ood", n=2, seed=1)) == 2
    bamboo = env.benchmark("bamboogle", n=3)
    assert [t.gold["answers"] for t in bamboo] == [["a0"], ["a1"], ["a2"]] and bamboo[0].split == "bamboogle"
    assert bamboo[0].gold["multi_hop"] and not env.benchmark("nq")[0].gold["multi_hop"]
    [task] = env.benchmark("nq")
    assert task.id == "search-nq-nq-test_0" and task.tools[0]["function"]["name"] == "search"
    reward, metrics, _, obs = run(env, task, [search("capital of France"), "<answer>paris, france</answer>"])
    assert obs[0][0]["content"].startswith("[1] Paris: Paris is the capital of France.")
    assert len(obs[0][0]["content"].splitlines()) <= 3 and reward == 1.0 and metrics["searches"] == 1.0
    assert env.search("zzzz qqqq") == "no results"
    single = SearchEnv(data=str(flashrag / "qa/bamboogle/test.jsonl"), corpus=str(corpus), topk=1)
    assert len(single.tasks("test")) == 5 and len(single.benchmark("popqa")) == 5  # a file is used as given
    assert single.search("Babbage").count("\n") == 0


@pytest.mark.slow
def test_a_corpus_index_is_built_once_per_node(flashrag, monkeypatch):
    """BM25Index.for_corpus: local ranks 0 and 1 of one node start together; rank 0 builds and saves the index, rank
    1 waits for it, and both load the same memory-mapped index and retrieve the same passages; a later start loads
    the saved index without building; a changed corpus file gets a new index."""
    import subprocess
    corpus = write_jsonl(flashrag / "wiki-18.jsonl", WIKI)
    code = ("import sys; from envs.search import BM25Index; i = BM25Index.for_corpus(sys.argv[1]); "
            "print(len(i), repr(i.search('capital of France', 2)))")
    env = dict(os.environ, ACLARENA_CACHE=str(flashrag / "cache"), OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(corpus)], cwd=root, env=dict(env, LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (1, 0)]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), [o[1][-800:] for o in outs]
    assert "built in" not in outs[0][0] and "built in" in outs[1][0]           # rank 1 waited, rank 0 built
    assert outs[0][0].splitlines()[-1] == outs[1][0].splitlines()[-1]
    assert outs[0][0].splitlines()[-1].startswith(f"{len(WIKI)} ['\"Paris\"")
    assert len(os.listdir(flashrag / "cache" / "bm25")) == 1
    again = subprocess.run([sys.executable, "-c", code, str(corpus)], cwd=root, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "built in" not in again.stdout
    write_jsonl(flashrag / "wiki-18.jsonl", WIKI[:3])
    changed = subprocess.run([sys.executable, "-c", code, str(corpus)], cwd=root, env=env, capture_output=True, text=True)
    assert "built in" in changed.stdout and changed.stdout.splitlines()[-1].startswith("3 ")
    assert len(os.listdir(flashrag / "cache" / "bm25")) == 2


RETRIEVER_REQUESTS = []


def fake_retriever(path, headers, body):
    """A Search-R1 retrieval server: POST {"queries", "topk", "return_scores"} -> {"result": [[...]]}."""
    RETRIEVER_REQUESTS.append(body)
    if body["queries"][0] == "boom":
        return 500, None
    return 200, {"result": [[{"document": WIKI[i], "score": 1.0 / (i + 1)} for i in range(body["topk"])]]}


@pytest.fixture
def retriever():
    with JSONServer(fake_retriever) as server:
        yield server.url + "/retrieve"


def test_http_retriever(flashrag, retriever):
    env = SearchEnv(data=str(flashrag / "qa"), retriever_url=retriever, topk=2, timeout=5)
    task = env.tasks("train", n=1, seed=0)[0]
    _, metrics, _, obs = run(env, task, [search("ada lovelace")])
    assert RETRIEVER_REQUESTS[-1] == {"queries": ["ada lovelace"], "topk": 2, "return_scores": True}
    assert obs[0][0]["content"] == ("[1] Ada Lovelace: Ada Lovelace was an English mathematician born in London.\n"
                                    "[2] London: London is the capital city of England and the United Kingdom.")
    assert metrics["searches"] == 1.0
    assert env.search("boom").startswith("error: retriever failed: HTTPError")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/retrieve"
    down = SearchEnv(data=str(flashrag / "qa"), retriever_url=dead, timeout=2)
    reward, metrics, state, obs = run(down, task, [search("ada"), "<answer>London</answer>"])
    assert obs[0][0]["content"].startswith("error: retriever failed") and reward == 1.0


# ---------------------------------------------------------------- bad user input

def test_bad_user_input_raises_one_clear_line(flashrag, tmp_path):
    corpus = str(write_jsonl(flashrag / "wiki-18.jsonl", WIKI))
    qa = str(flashrag / "qa")
    cases = [
        (lambda: ENV.tasks("dev"), "unknown split 'dev'"),
        (lambda: SearchEnv(data=qa, corpus=corpus).benchmark("squad"), "unknown search benchmark 'squad'"),
        (lambda: ENV.benchmark("nq"), "need real data"),
        (lambda: SearchEnv(data=str(tmp_path / "nope"), corpus=corpus), "search data not found"),
        (lambda: SearchEnv(data=qa, corpus=str(tmp_path / "nope.jsonl")), "corpus file not found"),
        (lambda: SearchEnv(data=qa), "needs a retriever"),
        (lambda: SearchEnv(corpus=corpus, retriever_url="http://127.0.0.1:1"), "not both"),
        (lambda: SearchEnv(topk=0), "topk must be >= 1"),
        (lambda: SearchEnv(corpus=str(write_jsonl(tmp_path / "c.jsonl", [{"id": "0", "text": "x"}]))), "no string 'contents'"),
        (lambda: SearchEnv(corpus=str(write_jsonl(tmp_path / "e.jsonl", []))), "is empty"),
        (lambda: SearchEnv(corpus=corpus).tasks("test"), "need data="),
        (lambda: SearchEnv(data=qa, corpus=corpus).tasks("val"), "no data for search split 'val'"),
        (lambda: SearchEnv(data=qa, corpus=corpus).benchmark("musique"), "no musique/test.jsonl or musique/dev.jsonl"),
        (lambda: SearchEnv(data=qa, corpus=corpus).knowledge(3), "only for the tiny world"),
    ]
    bad_rows = write_jsonl(tmp_path / "bad/nq/train.jsonl", [{"id": 1, "question": "q?", "answers": ["x"]}])
    cases.append((lambda: SearchEnv(data=str(bad_rows), corpus=corpus).tasks("train"), "golden_answers"))
    (tmp_path / "broken.jsonl").write_text('{"id": "0", "contents": "x"}\n{not json\n')
    cases.append((lambda: SearchEnv(corpus=str(tmp_path / "broken.jsonl")), "malformed JSON on line 2"))
    for make, message in cases:
        with pytest.raises(UsageError, match=message) as e:
            make()
        assert "\n" not in str(e.value)
    assert len(BENCHMARKS) == 7


def test_the_retriever_is_probed_before_work(flashrag, retriever):
    """A retrieval server that does not answer stops load_envs (every script's data check) in one line,
    instead of turning every search of a run into an error observation."""
    from envs import load_envs
    SearchEnv(data=str(flashrag / "qa"), retriever_url=retriever, timeout=5).check_services()
    assert RETRIEVER_REQUESTS[-1] == {"queries": ["probe"], "topk": 1, "return_scores": True}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/retrieve"
    with pytest.raises(UsageError, match=r"^search: the retriever at .* does not answer a probe query"):
        load_envs(["search"], {"search": dict(data=str(flashrag / "qa"), retriever_url=dead, timeout=2)})
    SearchEnv().check_services()   # the tiny world's own index: nothing to probe
