"""The e-commerce environment: golden and wrong transcripts, tool validation, the safe calculator,
fuzzing, the tiny generator, knowledge (the base's pre-training text), the real tau-bench v1 / tau2
loaders and the LLM user."""
import json
import os
import re
from collections import Counter

import pytest
from fake_http import JSONServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import make_env
from envs.base import PROTOCOL_MARKERS, UsageError, tool_call_text
from envs.ecommerce import (
    KNOWLEDGE_KINDS,
    RESIDUES,
    RETAIL_KINDS,
    TELECOM_KINDS,
    EcommerceEnv,
    _knowledge,
    expert_turns,
    play,
)
from envs.tau_store import SCHEMAS, TOOLS, db_hash, run_tool

ENV = EcommerceEnv()
TEST = ENV.tasks("test", n=60)
OOD = ENV.tasks("ood", n=60)


def first(tasks, kind):
    return next(t for t in tasks if t.gold["kind"] == kind)


def run(env, task, texts):
    state = play(env, task, texts)
    return env.score(state), state


# --- golden transcripts ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["cancel", "address", "return", "exchange", "amount"])
def test_golden_retail_episode_scores_one(kind):
    task = first(TEST, kind)
    (reward, m), state = run(ENV, task, expert_turns(task))
    assert reward == 1.0 and m["db_match"] == m["outputs_ok"] == 1.0
    assert state.done and state.messages[-1] == {"role": "user", "content": "###STOP###"}
    assert m["tool_errors"] == 0 and m["tool_calls"] >= 2


@pytest.mark.parametrize("kind", ["suspend", "resume", "plan", "data", "bill"])
def test_golden_telecom_episode_scores_one(kind):
    task = first(OOD, kind)
    (reward, _), _ = run(ENV, task, expert_turns(task))
    assert reward == 1.0


def test_golden_cancel_transcript_exactly():
    task = first(TEST, "cancel")
    state = play(ENV, task, expert_turns(task))
    roles = [m["role"] for m in state.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "tool", "assistant", "tool",
                     "assistant", "user", "assistant", "tool", "assistant", "user"]
    order_id = task.gold["actions"][-1]["arguments"]["order_id"]
    assert order_id in task.messages[1]["content"]
    assert state.info["db"]["orders"][order_id]["status"] == "cancelled"
    assert state.messages[9]["content"] == "yes"


@pytest.mark.parametrize("mistake", ["wrong_arg", "wrong_order", "no_confirm", "no_action"])
@pytest.mark.parametrize("kind", ["cancel", "address", "return", "exchange"])
def test_mistaken_retail_episodes_score_zero(kind, mistake):
    task = first(TEST, kind)
    (reward, m), state = run(ENV, task, expert_turns(task, mistake))
    assert reward == 0.0 and m["db_match"] == 0.0
    assert state.done  # the user still ends the conversation


def test_wrong_order_cancelled_scores_zero():
    task = next(t for t in TEST if t.gold["kind"] == "cancel"
                and sum(o["status"] == "pending" for o in t.gold["db"]["orders"].values()) >= 2)
    right = task.gold["actions"][-1]["arguments"]
    other = next(o for o, v in task.gold["db"]["orders"].items() if v["status"] == "pending" and o != right["order_id"])
    texts = expert_turns(task)
    texts[-2] = tool_call_text("cancel_pending_order", dict(right, order_id=other))
    (reward, m), state = run(ENV, task, texts)
    assert state.info["db"]["orders"][other]["status"] == "cancelled"  # the change happened, to the wrong order
    assert reward == 0.0 and m["db_match"] == 0.0 and m["tool_errors"] == 0


def test_extra_database_change_scores_zero():
    task = first(TEST, "cancel")
    user_id = next(iter(task.gold["db"]["users"]))
    extra = tool_call_text("modify_user_address", {"user_id": user_id, "address1": "1 Oak St", "address2": "",
                                                   "city": "Ely", "state": "NV", "country": "USA", "zip": "11111"})
    texts = expert_turns(task)
    texts[-1:] = ["Please confirm (yes/no): new address?", extra, "Done."]
    (reward, m), state = run(ENV, task, texts)
    assert state.info["writes"] == 2 and m["outputs_ok"] == 1.0
    assert reward == 0.0 and m["db_match"] == 0.0


def test_missing_required_output_scores_zero():
    task = first(TEST, "amount")
    texts = expert_turns(task)
    texts[-1] = "You paid some dollars."
    (reward, m), _ = run(ENV, task, texts)
    assert m["db_match"] == 1.0 and m["outputs_ok"] == 0.0 and reward == 0.0
    texts[-1] = expert_turns(task, "wrong_arg")[-1]  # a wrong amount
    assert run(ENV, task, texts)[0][0] == 0.0


def test_an_amount_is_said_as_a_whole_number_not_inside_other_digits():
    """The tiny policy once won order-count tasks with "Sure. address6, zip 236": the count (2) as a substring
    of a zip. In the tiny world a numeric output must stand as a number of its own; real tasks keep tau-bench's
    substring rule."""
    from envs.ecommerce import said_output
    task = first(TEST, "amount")
    n = task.gold["outputs"][0]
    texts = expert_turns(task)
    texts[-1] = f"Sure. address6, zip 9{n}7{n}."        # the digit only inside other numbers
    (reward, m), _ = run(ENV, task, texts)
    assert m["db_match"] == 1.0 and m["outputs_ok"] == 0.0 and reward == 0.0
    texts[-1] = f"You have {n}."                          # a sentence's full stop is not a decimal point
    assert run(ENV, task, texts)[0][0] == 1.0
    assert said_output("2", "you have 2 orders", tiny=True) and not said_output("2", "zip 236", tiny=True)
    assert not said_output("3", "3.5 orders", tiny=True) and not said_output("12", "112", tiny=True)
    assert said_output("2", "zip 236", tiny=False)       # tau-bench's substring rule for real tasks
    assert said_output("Blue Kettle", "the blue kettle is back", tiny=True)   # non-numeric: substring


class Says:
    """A generation backend that writes say(prompt ids) and ends its turn."""
    def __init__(self, cm, say):
        self.cm, self.say = cm, say

    def generate(self, prompts, max_new_tokens, temperature, stop_ids, adapters=None):
        from envs.rollout import Generation
        out = []
        for p in prompts:
            ids = self.cm.encode(self.say(p)) + [self.cm.eos]
            out.append(Generation(ids, [0.0] * len(ids), True))
        return out


def expert_tokenizer(tasks):
    from envs.rollout import ChatML
    from pretrain import train_tokenizer
    tok = train_tokenizer([m["content"] for t in tasks for m in play(ENV, t, expert_turns(t)).messages] * 3, 600)
    return tok, ChatML(tok)


def test_turn_accuracy_counts_exact_expert_turns():
    """turn_accuracy teacher-forces expert episodes: a backend that writes the expert's turn scores 1 on
    every kind, one that writes something else scores 0."""
    from bench.ecommerce_turns import expert_turn_prompts, turn_accuracy
    tasks = TEST[:12]
    tok, cm = expert_tokenizer(tasks)
    want = {tuple(p): text for _, p, text in expert_turn_prompts(ENV, cm, tasks)}   # prompt -> the expert's turn
    right = turn_accuracy(Says(cm, lambda p: want[tuple(p)]), tok, ENV, tasks)
    assert sum(n for n, _ in right.values()) == len(want) and all(n == k for n, k in right.values())
    assert {"ask_identity", "confirm", "answer", "call:get_order_details"} <= set(right)
    assert all(k == 0 for _, k in turn_accuracy(Says(cm, lambda p: "Done?"), tok, ENV, tasks).values())


def test_kind_success_per_task_kind():
    """kind_success rolls out one episode per task and sums by kind: a backend that plays the expert's turns
    finishes every kind, one that only says "Done?" finishes none and calls no tool."""
    from bench.ecommerce_turns import kind_success
    tasks = TEST[:15]
    turns = {t.messages[-1]["content"]: expert_turns(t) for t in tasks}    # the goal -> the expert's turns
    assert len(turns) == len(tasks)
    tok, cm = expert_tokenizer(tasks)

    def expert(p):    # the expert's next turn: which task (its goal) and how many assistant turns so far
        text = tok.decode(p, skip_special_tokens=False)
        return turns[next(g for g in turns if g in text)][text.count("<|im_start|>assistant") - 1]

    right = kind_success(Says(cm, expert), tok, ENV, tasks)
    assert sum(n for n, _, _ in right.values()) == len(tasks) and all(n == ok for n, ok, _ in right.values())
    assert len(right) >= 3 and all(calls >= 2 * n for n, _, calls in right.values())
    assert all(ok == 0 and calls == 0 for _, ok, calls in kind_success(Says(cm, lambda p: "Done?"), tok, ENV, tasks).values())


def probe_cli(*args):
    """python bench/ecommerce_turns.py ARGS, from the repo root."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, os.path.join(root, "bench", "ecommerce_turns.py"), *args], cwd=root,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))


def test_turns_cli_needs_a_checkpoint(tmp_path):
    r = probe_cli(str(tmp_path / "none"))
    assert r.returncode != 0 and r.stderr.strip() == f"error: no checkpoint at {tmp_path / 'none'}"


def test_turns_cli_end_to_end_on_a_micro_checkpoint(tmp_path):
    """The probe runs on a checkpoint saved like the tiny base (untrained micro model) and prints its two tables:
    one row per expert turn kind (turns counted from the expert episodes), one per task kind (one episode each)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from acl.common import save_checkpoint
    from bench.ecommerce_turns import expert_turn_prompts
    from envs.rollout import ChatML
    from pretrain import model_config
    tasks = ENV.tasks("test", n=2)
    tok, _ = expert_tokenizer(tasks)
    torch.manual_seed(0)
    ckpt = str(tmp_path / "base")
    save_checkpoint(ckpt, Qwen3ForCausalLM(model_config(tok, "micro", 2048)), tok, dict(method="base", stage="base"))
    r = probe_cli(ckpt, "--n", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    turns_table, kinds_table = r.stdout.strip().split("\n\n")
    head, sep, *rows = turns_table.splitlines()
    assert head == "| expert turn | turns | greedy exact | sampled (T=1) exact |" and sep == "|---|---|---|---|"
    want = {}
    for kind, _, _ in expert_turn_prompts(ENV, ChatML(tok), tasks):
        want[kind] = want.get(kind, 0) + 1
    got = {}
    for row in rows:
        kind, n, greedy, sampled = (c.strip() for c in row.strip("|").split("|"))
        got[kind] = int(n)
        assert 0.0 <= float(greedy) <= 1.0 and 0.0 <= float(sampled) <= 1.0
    assert got == want and [row.split("|")[1].strip() for row in rows] == sorted(want)
    head, sep, *rows = kinds_table.splitlines()
    assert head == "| task kind | episodes | success (T=1) | tool calls per episode |" and sep == "|---|---|---|---|"
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert sum(int(n) for _, n, _, _ in cells) == 2
    assert {k for k, *_ in cells} == {t.gold["kind"] for t in tasks}
    assert all(0.0 <= float(ok) <= 1.0 and float(calls) >= 0 for _, _, ok, calls in cells)


def test_environment_file_loads_no_model():
    """The probe lives in bench/: the environment's files import neither the rollout loop nor a model library."""
    for f in ("ecommerce.py", "tau_store.py", "tau_telecom.py"):
        src = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "envs", f)).read()
        for name in ("envs.rollout", "import torch", "transformers", "__main__"):
            assert name not in src, (f, name)


def test_write_without_confirmation_is_refused():
    task = first(TEST, "cancel")
    state = ENV.reset(task)
    obs = ENV.step(state, tool_call_text(task.gold["actions"][-1]["name"], task.gold["actions"][-1]["arguments"]))
    assert obs[0]["content"].startswith("Error: ask the user to confirm")
    assert db_hash(state.info["db"]) == db_hash(task.gold["db"])


def test_truncated_or_unfinished_episode_scores_zero():
    task = first(TEST, "cancel")
    texts = expert_turns(task)
    state = play(ENV, task, texts[:-1])  # acted, but never told the user: the user has not stopped
    reward, m = ENV.score(state)
    assert m["db_match"] == 1.0 and not state.done and reward == 0.0
    state = play(ENV, task, texts)
    state.truncated = True
    assert ENV.score(state)[0] == 0.0


def test_transfer_ends_the_episode():
    task = first(TEST, "return")
    state = ENV.reset(task)
    obs = ENV.step(state, tool_call_text("transfer_to_human_agents", {"summary": "user wants a human"}))
    assert obs[0]["content"] == "Transfer successful" and state.done
    assert ENV.score(state)[0] == 0.0  # the return was never made


def test_max_turns_ends_the_episode():
    env = EcommerceEnv(max_turns=3)
    task = first(TEST, "cancel")
    state = env.reset(task)
    for _ in range(3):
        env.step(state, "<tool_call>{\"name\": \"think\", \"arguments\": {\"thought\": \"hm\"}}</tool_call>")
    assert state.done and state.turns == 3 and env.score(state)[0] == 0.0


# --- tools -------------------------------------------------------------------------------------------

def test_at_least_fifteen_retail_tools_with_schemas():
    names = {s["function"]["name"] for s in SCHEMAS["retail"]}
    assert len(names) >= 15 and {"find_user_id_by_email", "exchange_delivered_order_items", "calculate",
                                 "transfer_to_human_agents", "think", "list_all_product_types"} <= names
    assert not names & {s["function"]["name"] for s in SCHEMAS["telecom"]} - {"calculate", "think",
                                                                            "transfer_to_human_agents"}


@pytest.mark.parametrize("expr,want", [("2 + 3*4", "14.0"), ("(1.5 + 2.5) / 3", "1.33"), ("-(2-5)", "3.0")])
def test_calculate_does_arithmetic(expr, want):
    assert run_tool("retail", {}, "calculate", {"expression": expr}) == (want, True)


@pytest.mark.parametrize("expr", ["__import__('os')", "2**10", "9**9**9", "1/0", "os.system('ls')", "(" * 300 + "1",
                                  "", "1 +", "[1]", "2 // 3"])
def test_calculate_refuses_anything_else(expr):
    text, ok = run_tool("retail", {}, "calculate", {"expression": expr})
    assert not ok and text.startswith("Error:")


def test_tools_validate_arguments():
    task = first(TEST, "return")
    db = task.gold["db"]
    order_id = task.gold["actions"][-1]["arguments"]["order_id"]
    for args, problem in [({"order_id": 5}, "must be a string"), ({}, "missing argument"),
                          ({"order_id": order_id, "x": 1}, "unexpected argument"), ({"order_id": "#W0"}, "not found")]:
        text, ok = run_tool("retail", db, "get_order_details", args)
        assert not ok and problem in text
    text, ok = run_tool("retail", db, "return_delivered_order_items",
                        {"order_id": order_id, "item_ids": "123", "payment_method_id": "x"})
    assert not ok and "array of strings" in text
    text, ok = run_tool("retail", db, "cancel_pending_order", {"order_id": order_id, "reason": "no longer needed"})
    assert not ok and "non-pending" in text  # the order is delivered
    assert run_tool("telecom", {}, "get_order_details", {"order_id": order_id})[0].startswith("Error: unknown tool")
    assert "must be a integer" in run_tool("telecom", {"lines": {}}, "add_data", {"line_id": "L1", "gb": "2"})[0]


def test_cancel_refunds_a_gift_card_at_once():
    def paid_by(t):
        order = t.gold["db"]["orders"][t.gold["actions"][-1]["arguments"]["order_id"]]
        return order["payment_history"][0]["payment_method_id"]
    task = next(t for t in ENV.tasks("test", n=300) if t.gold["kind"] == "cancel" and "gift" in paid_by(t))
    order_id = task.gold["actions"][-1]["arguments"]["order_id"]
    state = play(ENV, task, expert_turns(task))
    order, method = state.info["db"]["orders"][order_id], paid_by(task)
    before = task.gold["db"]["users"][order["user_id"]]["payment_methods"][method]["balance"]
    after = state.info["db"]["users"][order["user_id"]]["payment_methods"][method]["balance"]
    assert after == before + order["payment_history"][0]["amount"]
    assert order["payment_history"][-1] == {"transaction_type": "refund", "amount": order["payment_history"][0]["amount"],
                                            "payment_method_id": method}


# --- fuzzing: nothing the model writes raises, rewards stay in [0, 1] --------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                           max_leaves=8)
tool_names = st.sampled_from(sorted(TOOLS["retail"]) + sorted(TOOLS["telecom"]) + ["rm_rf", ""])
arg_names = st.sampled_from(["order_id", "user_id", "item_ids", "new_item_ids", "payment_method_id", "reason", "email",
                             "zip", "expression", "line_id", "gb", "plan_id", "phone", "address1", "junk"])
calls = st.builds(lambda n, a: tool_call_text(n, a), tool_names, st.dictionaries(arg_names, json_values, max_size=5))
broken = st.sampled_from(["<tool_call>{\"name\": \"get_order_details\", \"arguments\": {", "<tool_call>[1, 2]</tool_call>",
                          "<tool_call>{\"arguments\": {}}</tool_call>", "<tool_call>", "</tool_call>",
                          "<tool_call>{\"name\": \"calculate\", \"arguments\": \"1+1\"}</tool_call>",
                          "<tool_call>{\"name\": \"think\", \"arguments\": [1]}</tool_call>"])
turns = st.lists(st.one_of(st.text(max_size=60), calls, broken, st.sampled_from(
    ["Please confirm (yes/no)?", "What is your email?", "yes", "Done.", "\ud800 caf\u00e9 \u2603"])), max_size=12)


def _check_episode(task, texts):
    state = ENV.reset(task)
    for text in texts:
        for m in ENV.step(state, text):
            m["content"].encode("utf-8")  # every observation can be tokenized
        if state.done:
            break
    reward, metrics = ENV.score(state)
    assert 0.0 <= reward <= 1.0 and all(isinstance(v, float) for v in metrics.values())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 59), turns)
def test_fuzz_retail_never_raises(i, texts):
    _check_episode(TEST[i], texts)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 59), turns)
def test_fuzz_telecom_never_raises(i, texts):
    _check_episode(OOD[i], texts)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_calculate_never_raises(expr):
    text, ok = run_tool("retail", {}, "calculate", {"expression": expr})
    assert ok or text.startswith("Error:")


def test_endless_and_odd_text_never_raises():
    task = TEST[0]
    _check_episode(task, ["x" * 200_000, "<tool_call>" * 50, tool_call_text("think", {"thought": "t"}) * 20, None, "",
                          tool_call_text("\ud800", {}), tool_call_text("find_user_id_by_email", {"email": "\ud800"})])


# --- the tiny generator -------------------------------------------------------------------------------

def test_generator_is_deterministic():
    a, b = ENV.tasks("test", n=20, seed=3), ENV.tasks("test", n=20, seed=3)
    assert [(t.id, t.messages, t.gold) for t in a] == [(t.id, t.messages, t.gold) for t in b]
    c = ENV.tasks("test", n=20, seed=4)
    assert [t.gold["db"] for t in a] != [t.gold["db"] for t in c]


def test_splits_are_disjoint():
    users = {s: {u for t in ENV.tasks(s, n=300) for u in t.gold["db"]["users"]} for s in ("train", "val", "test")}
    assert not users["train"] & users["test"] and not users["train"] & users["val"] and not users["val"] & users["test"]
    openings = {s: {t.messages[1]["content"] + t.gold["user"]["identity"] for t in ENV.tasks(s, n=300)}
                for s in ("train", "test")}
    assert not openings["train"] & openings["test"]


def test_default_sizes_and_ood_is_another_domain():
    assert len(ENV.tasks("test")) == 300 and len(ENV.tasks("ood")) == 300 and len(ENV.tasks("val", n=7)) == 7
    assert {t.gold["world"] for t in OOD} == {"telecom"} and {t.gold["world"] for t in TEST} == {"retail"}
    assert OOD[0].messages[0]["content"] != TEST[0].messages[0]["content"]
    assert {t.gold["kind"] for t in TEST} == {"cancel", "address", "return", "exchange", "amount"}


def test_unknown_split_is_a_clear_error():
    with pytest.raises(UsageError, match="unknown split 'dev'"):
        ENV.tasks("dev")
    with pytest.raises(UsageError, match="unknown domain"):
        make_env("shop")
    assert isinstance(make_env("ecommerce"), EcommerceEnv)


# --- knowledge: the base's pre-training text --------------------------------------------------------------

KNOWLEDGE = _knowledge(600, seed=0)


def test_knowledge_is_deterministic_and_seeded():
    assert ENV.knowledge(30, seed=1) == EcommerceEnv().knowledge(30, seed=1) != ENV.knowledge(30, seed=2)
    assert ENV.knowledge(10, seed=1) == ENV.knowledge(30, seed=1)[:10]


def test_knowledge_is_plain_text_of_every_kind_in_both_worlds():
    docs = [d["doc"] for d in KNOWLEDGE]
    assert docs[:500] == ENV.knowledge(500, seed=0) and all(isinstance(d, str) and d for d in docs)
    assert not [d for d in docs if any(m in d for m in PROTOCOL_MARKERS)]
    assert not [d for d in docs if '"arguments"' in d or "###STOP###" in d]   # never a tool call or a chat's end
    shares = Counter((d["kind"], d["world"]) for d in KNOWLEDGE)
    assert all(0.1 < shares[(k, w)] / len(docs) < 0.25 for k in KNOWLEDGE_KINDS for w in ("retail", "telecom"))
    cases = {d["task"].gold["kind"] for d in KNOWLEDGE if d["kind"] == "case"}
    assert cases == set(RETAIL_KINDS) | set(TELECOM_KINDS)
    # every JSON record is exactly what a tool returns (compact, keys sorted)
    records = [line for d in docs for line in d.split("\n") if line.startswith("{")]
    assert len(records) > 300
    assert all(json.dumps(json.loads(r), sort_keys=True, separators=(",", ":")) == r for r in records)
    sizes = sorted(len(d) for d in docs)
    assert sum(sizes) / len(sizes) < 1000 and sizes[int(0.9 * len(sizes))] < 1200 and sizes[-1] < 2000


def test_knowledge_never_shows_a_val_or_test_user():
    held = {x for s in ("val", "test") for t in ENV.tasks(s) for u in t.gold["db"]["users"].values()
            for x in (u["user_id"], u["email"])}
    assert len(held) > 2000
    text = "\n".join(ENV.knowledge(2000, seed=0))
    ids = {x for x in re.findall(r"\b[a-z]+_[a-z]+_\d+\b", text) if "_card_" not in x}   # users' and customers' ids
    emails = set(re.findall(r"\b[a-z]+\.[a-z]+\d+@x\.com\b", text))
    assert len(ids) > 1000 and len(emails) > 200   # the patterns do find the documents' users and customers
    assert not (ids | emails) & held
    assert all(int(re.search(r"\d+", x).group()) % 4 in RESIDUES["train"] for x in ids | emails)


def _one(pattern, doc):
    """The single value `pattern` finds in `doc`, however many times it is stated."""
    found = set(re.findall(pattern, doc))
    assert len(found) == 1, (pattern, found, doc)
    return found.pop()


def test_case_notes_state_what_the_store_records_say():
    # Each fact is worked out from the request as the note states it and the store's records: a note that took its
    # amount, item, line or plan from another order, product or line of the same store fails here.
    checked = Counter()
    for d in KNOWLEDGE:
        if d["kind"] != "case":
            continue
        doc, db, kind = d["doc"], d["task"].gold["db"], d["task"].gold["kind"]
        goal = re.search(r'"(.+?)"', doc).group(1)
        if d["world"] == "retail":
            order = db["orders"][re.search(r"#W\d+", goal).group()]
            if kind == "amount":
                paid = int(_one(r"You paid (\d+) dollars", doc))
                assert paid == order["payment_history"][0]["amount"] == sum(it["price"] for it in order["items"])
            if kind in ("return", "exchange"):
                item = next(it for it in order["items"] if f"the {it['name']} in" in goal)
                assert _one(r"\bitem_ids (\d+)", doc) == item["item_id"]
                assert _one(r"payment_method_id (\w+)", doc) == order["payment_history"][0]["payment_method_id"]
            if kind == "exchange":
                key, value = re.search(r"for (\w+) (\w+)\.$", goal).groups()
                new = [i for i, v in db["products"][item["product_id"]]["variants"].items() if v["options"] == {key: value}]
                assert [_one(r"new_item_ids (\d+)", doc)] == new
            if kind == "address":
                assert _one(r"country USA and zip (\d+)", doc) == re.search(r"(\d{5})\.$", goal).group(1)
        else:
            phone = _one(r"find_customer_by_phone with phone (555-\d+)", doc)
            line = next(x for x in db["lines"].values() if x["phone"] == phone)
            if kind == "bill":
                assert int(_one(r"You owe (\d+) dollars", doc)) == db["customers"][line["customer_id"]]["balance"]
            else:
                assert _one(r"line_id (L\d+)", doc) == line["line_id"]
            if kind == "plan":
                name = re.search(r"the (\w+) plan", goal).group(1)
                assert _one(r"plan_id (\d+)", doc) == next(p for p, x in db["plans"].items() if x["name"] == name)
            if kind == "data":
                assert _one(r"\bgb (\d+)", doc) == re.search(r"Add (\d+) GB", goal).group(1)
        checked[kind] += 1
    assert min(checked[k] for k in RETAIL_KINDS + TELECOM_KINDS) >= 3, checked


# --- real data: tau-bench v1 and tau2 formats, LLM user ------------------------------------------------

USERS = {"yusuf_rossi_9620": {"name": {"first_name": "Yusuf", "last_name": "Rossi"},
                              "address": {"address1": "763 Broadway", "address2": "Suite 135", "city": "Philadelphia",
                                          "country": "USA", "state": "PA", "zip": "19122"},
                              "email": "yusuf.rossi7301@example.com",
                              "payment_methods": {"credit_card_9513926": {"source": "credit_card", "brand": "mastercard",
                                                                          "last_four": "2478",
                                                                          "id": "credit_card_9513926"},
                                                  "gift_card_1111111": {"source": "gift_card", "balance": 50.0,
                                                                        "id": "gift_card_1111111"}},
                              "orders": ["#W2378156", "#W4776164"]}}
PRODUCTS = {"1656367028": {"name": "Mechanical Keyboard", "product_id": "1656367028", "variants": {
    "1151293680": {"item_id": "1151293680", "options": {"switch type": "linear", "backlight": "RGB", "size": "full size"},
                   "available": True, "price": 272.33},
    "7706410293": {"item_id": "7706410293", "options": {"switch type": "clicky", "backlight": "none", "size": "full size"},
                   "available": True, "price": 269.16}}}}
ORDERS = {"#W2378156": {"order_id": "#W2378156", "user_id": "yusuf_rossi_9620",
                        "address": USERS["yusuf_rossi_9620"]["address"],
                        "items": [{"name": "Mechanical Keyboard", "product_id": "1656367028", "item_id": "1151293680",
                                   "price": 272.33, "options": {"switch type": "linear", "backlight": "RGB",
                                                                "size": "full size"}}],
                        "fulfillments": [{"tracking_id": ["843053632392"], "item_ids": ["1151293680"]}],
                        "status": "delivered", "payment_history": [{"transaction_type": "payment", "amount": 272.33,
                                                                    "payment_method_id": "credit_card_9513926"}]},
          "#W4776164": {"order_id": "#W4776164", "user_id": "yusuf_rossi_9620",
                        "address": USERS["yusuf_rossi_9620"]["address"],
                        "items": [{"name": "Mechanical Keyboard", "product_id": "1656367028", "item_id": "7706410293",
                                   "price": 269.16, "options": {"switch type": "clicky", "backlight": "none",
                                                                "size": "full size"}}],
                        "fulfillments": [], "status": "pending",
                        "payment_history": [{"transaction_type": "payment", "amount": 269.16,
                                             "payment_method_id": "credit_card_9513926"}]}}
EXCHANGE = {"order_id": "#W2378156", "item_ids": ["1151293680"], "new_item_ids": ["7706410293"],
            "payment_method_id": "credit_card_9513926"}
V1_TASKS = '''from tau_bench.types import Task, Action

TASKS_TEST = [
    Task(
        annotator="0",
        user_id="yusuf_rossi_9620",
        instruction="You are Yusuf Rossi in 19122. You received your order #W2378156 and wish to exchange the "
        "mechanical keyboard for a clicky one.",
        actions=[
            Action(name="find_user_id_by_name_zip", kwargs={"first_name": "Yusuf", "last_name": "Rossi", "zip": "19122"}),
            Action(name="get_order_details", kwargs={"order_id": "#W2378156"}),
            Action(name="exchange_delivered_order_items", kwargs=%s),
        ],
        outputs=[],
    ),
    Task(
        annotator="0",
        user_id="yusuf_rossi_9620",
        instruction="You are Yusuf Rossi in 19122. You want to know how many orders you have, then cancel #W4776164.",
        actions=[
            Action(name="get_user_details", kwargs={"user_id": "yusuf_rossi_9620"}),
            Action(name="cancel_pending_order", kwargs={"order_id": "#W4776164", "reason": "no longer needed"}),
        ],
        outputs=["2"],
    ),
]
''' % json.dumps(EXCHANGE)
TAU2_TASKS = [
    {"id": "0", "description": {"purpose": None}, "initial_state": None,
     "user_scenario": {"persona": None, "instructions": {
         "domain": "retail", "reason_for_call": "You want to exchange your keyboard for a clicky one.",
         "known_info": "You are Yusuf Rossi in zip code 19122.", "unknown_info": None,
         "task_instructions": "You are polite."}},
     "evaluation_criteria": {"actions": [
         {"action_id": "0_0", "name": "find_user_id_by_name_zip", "arguments":
          {"first_name": "Yusuf", "last_name": "Rossi", "zip": "19122"}, "info": None},
         {"action_id": "0_1", "name": "exchange_delivered_order_items", "arguments": EXCHANGE, "info": None}],
         "communicate_info": ["269.16"], "nl_assertions": None, "reward_basis": ["DB", "COMMUNICATE"]}},
    {"id": "1", "user_scenario": {"instructions": "You are Yusuf Rossi. Cancel #W4776164, you no longer need it."},
     "evaluation_criteria": {"actions": [{"action_id": "1_0", "name": "cancel_pending_order",
                                          "arguments": {"order_id": "#W4776164", "reason": "no longer needed"}}],
                             "communicate_info": [], "reward_basis": ["DB"]}},
]


def write_v1(root):
    root.mkdir(exist_ok=True)
    for name, table in (("users", USERS), ("orders", ORDERS), ("products", PRODUCTS)):
        (root / f"{name}.json").write_text(json.dumps(table, indent=2))
    (root / "tasks_test.py").write_text(V1_TASKS)
    (root / "wiki.md").write_text("# Retail agent policy\nAs a retail agent, you can help users cancel orders.")
    return str(root)


def write_tau2(root):
    root.mkdir(exist_ok=True)
    (root / "db.json").write_text(json.dumps({"users": {k: dict(v, user_id=k) for k, v in USERS.items()},
                                              "orders": ORDERS, "products": PRODUCTS}))
    (root / "tasks.json").write_text(json.dumps(TAU2_TASKS, indent=4))
    (root / "split_tasks.json").write_text(json.dumps({"train": ["1"], "test": ["0"], "base": ["0", "1"]}))
    (root / "policy.md").write_text("# Retail agent policy (tau2)")
    return str(root)


class FakeUser(JSONServer):
    """An OpenAI-compatible chat completions server on 127.0.0.1 that replies from a script."""

    def __init__(self, replies, status=200):
        self.replies, self.requests = list(replies), []

        def respond(path, headers, body):
            self.requests.append({"path": path, "auth": headers.get("Authorization"), "body": body})
            reply = self.replies.pop(0) if self.replies else "###STOP###"   # a dict: the whole message (tool calls)
            message = dict(role="assistant", **reply) if isinstance(reply, dict) else {"role": "assistant", "content": reply}
            return status, {"choices": [{"message": message}]}
        super().__init__(respond)
        self.url += "/v1"


@pytest.fixture
def fake_user():
    servers = []

    def make(replies, status=200):
        servers.append(FakeUser(replies, status))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


def _agent_turns(task, say):
    return [tool_call_text(a["name"], a["arguments"]) for a in task.gold["actions"]] + [say]


def test_tau_bench_v1_directory_loads_and_replays(tmp_path, fake_user, monkeypatch):
    user = fake_user(["Hi, I want to exchange my keyboard. I am Yusuf Rossi, 19122.", "Great, thanks.", "###STOP###"])
    monkeypatch.setenv("FAKE_KEY", "sk-test")
    env = EcommerceEnv(data=write_v1(tmp_path / "v1"), user_url=user.url, user_model="sim", user_api_key_env="FAKE_KEY")
    tasks = env.tasks("test")
    assert len(tasks) == 2 and tasks[0].messages == [{"role": "system", "content": env.policy}]
    assert "As a retail agent" in env.policy and tasks[1].gold["outputs"] == ["2"]
    state = env.reset(tasks[0])
    assert state.messages[-1] == {"role": "user", "content": "Hi, I want to exchange my keyboard. I am Yusuf Rossi, 19122."}
    for text in _agent_turns(tasks[0], "Your exchange is requested.") + ["Anything else?"]:
        env.step(state, text)
    assert state.done and state.info["db"]["orders"]["#W2378156"]["status"] == "exchange requested"
    assert env.score(state)[0] == 1.0
    req = user.requests[-1]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test" and req["body"]["model"] == "sim"
    chat = req["body"]["messages"]  # the simulated user sees the agent as "user" and itself as "assistant"
    assert chat[0]["role"] == "system" and "exchange the mechanical keyboard" in chat[0]["content"]
    assert [m["role"] for m in chat[1:]] == ["user", "assistant", "user", "assistant", "user"]
    assert chat[-1]["content"] == "Anything else?"

    # Same task, a wrong new item: the database differs from the gold replay.
    state = env.reset(tasks[0])
    wrong = dict(EXCHANGE, new_item_ids=["1151293680"])
    for text in [tool_call_text("exchange_delivered_order_items", wrong),
                 tool_call_text("exchange_delivered_order_items", dict(EXCHANGE, payment_method_id="gift_card_1111111")),
                 "Done."]:
        env.step(state, text)
    assert state.done and env.score(state)[1]["db_match"] == 0.0


def test_tau_bench_v1_required_output(tmp_path, fake_user):
    user = fake_user(["How many orders do I have? And cancel #W4776164."] + ["ok"] * 5)
    env = EcommerceEnv(data=write_v1(tmp_path / "v1"), user_url=user.url)
    task = env.tasks("test")[1]
    for say, want in (("You have 2 orders; #W4776164 is cancelled.", 1.0), ("Your order is cancelled.", 0.0)):
        user.replies[:] = ["hello", "###STOP###"]
        state = env.reset(task)
        for text in _agent_turns(task, say):
            env.step(state, text)
        assert state.done and env.score(state)[0] == want


def test_tau2_directory_loads_splits_and_communicate_info(tmp_path, fake_user):
    user = fake_user([])
    env = EcommerceEnv(data=write_tau2(tmp_path / "t2"), user_url=user.url)
    assert env.policy == "# Retail agent policy (tau2)"
    test, train = env.tasks("test"), env.tasks("train")
    assert [t.id for t in test] == ["ecommerce-test-0"] and [t.id for t in train] == ["ecommerce-train-1"]
    assert "clicky" in test[0].gold["instruction"] and "zip code 19122" in test[0].gold["instruction"]
    assert len(env.tasks("base", n=1)) == 1
    task = test[0]
    for say, want in (("Done: the price difference is 269.16 minus 272.33.", 1.0), ("Done.", 0.0)):
        user.replies[:] = ["I want to exchange my keyboard.", "###STOP###"]
        state = env.reset(task)
        for text in _agent_turns(task, say):
            env.step(state, text)
        assert env.score(state)[0] == want


def test_llm_user_failures_end_the_episode_without_raising(tmp_path, fake_user):
    bad = fake_user(["x"], status=500)
    env = EcommerceEnv(data=write_tau2(tmp_path / "t2"), user_url=bad.url, user_timeout=5)
    state = env.reset(env.tasks("train")[0])
    assert state.done and state.info["user_error"] == 1.0
    reward, m = env.score(state)
    assert reward == 0.0 and m["user_error"] == 1.0
    closed = FakeUser([])
    closed.close()  # nothing listens on this port any more
    env = EcommerceEnv(data=write_tau2(tmp_path / "t2"), user_url=closed.url, user_timeout=2)
    assert env.reset(env.tasks("train")[0]).done
    # The tiny arena can use an LLM user too; a failure mid-episode is a stop, not a crash.
    tiny = EcommerceEnv(user_url=closed.url, user_timeout=2)
    state = tiny.reset(TEST[0])
    assert not state.done and tiny.step(state, "What is your email?")[0]["content"] == "###STOP###" and state.done


def test_full_scale_tools_on_the_tau_bench_store():
    db = json.loads(json.dumps({"users": USERS, "orders": ORDERS, "products": PRODUCTS}))
    address = {"address1": "1 Main St", "address2": "", "city": "Ely", "state": "NV", "country": "USA", "zip": "89301"}
    text, ok = run_tool("retail", db, "modify_pending_order_address", {"order_id": "#W2378156", **address})
    assert not ok and "non-pending" in text
    text, ok = run_tool("retail", db, "modify_pending_order_payment",
                        {"order_id": "#W4776164", "payment_method_id": "gift_card_1111111"})
    assert not ok and "insufficient gift card balance" in text  # 50 < 269.16
    swap = {"order_id": "#W4776164", "item_ids": ["7706410293"], "new_item_ids": ["1151293680"],
            "payment_method_id": "credit_card_9513926"}
    assert run_tool("retail", db, "modify_pending_order_items", dict(swap, new_item_ids=["7706410293"]))[1] is False
    text, ok = run_tool("retail", db, "modify_pending_order_items", swap)
    order = json.loads(text)
    assert ok and order["status"] == "pending (item modified)" and order["items"][0]["price"] == 272.33
    assert order["payment_history"][-1] == {"transaction_type": "payment", "amount": 3.17,
                                            "payment_method_id": "credit_card_9513926"}
    assert run_tool("retail", db, "modify_pending_order_items", swap)[0].startswith("Error: non-pending")
    assert run_tool("retail", db, "modify_pending_order_address", {"order_id": "#W4776164", **address})[1]
    text, ok = run_tool("retail", db, "modify_user_address", {"user_id": "yusuf_rossi_9620", **address})
    assert ok and db["users"]["yusuf_rossi_9620"]["address"] == address
    assert json.loads(run_tool("retail", db, "get_item_details", {"item_id": "7706410293"})[0])["price"] == 269.16
    assert json.loads(run_tool("retail", db, "list_all_product_types", {})[0]) == {"Mechanical Keyboard": "1656367028"}
    text, ok = run_tool("retail", db, "return_delivered_order_items",
                        {"order_id": "#W2378156", "item_ids": ["1151293680", "1151293680"],
                         "payment_method_id": "credit_card_9513926"})
    assert not ok and "not found" in text  # only one such item was bought


def test_bad_data_is_a_clear_error(tmp_path):
    url = "http://127.0.0.1:9/v1"
    with pytest.raises(UsageError, match="data directory not found"):
        EcommerceEnv(data=str(tmp_path / "nope"), user_url=url)
    with pytest.raises(UsageError, match="needs an LLM user"):
        EcommerceEnv(data=write_v1(tmp_path / "v1"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no retail database"):
        EcommerceEnv(data=str(tmp_path / "empty"), user_url=url)
    root = tmp_path / "broken"
    write_tau2(root)
    (root / "db.json").write_text("{not json")
    with pytest.raises(UsageError, match="malformed JSON"):
        EcommerceEnv(data=str(root), user_url=url)
    root = tmp_path / "t2"
    env = EcommerceEnv(data=write_tau2(root), user_url=url)
    with pytest.raises(UsageError, match="unknown split 'ood'"):
        env.tasks("ood")
    (root / "tasks.json").write_text("[{\"id\": \"0\", \"evaluation_criteria\": {\"actions\": [{\"name\": \"rm\"}]}}]")
    (root / "split_tasks.json").write_text(json.dumps({"test": ["0"]}))
    with pytest.raises(UsageError, match="unknown gold action 'rm'"):
        env.tasks("test")
    (root / "tasks.json").write_text("[1, 2")
    with pytest.raises(UsageError, match="malformed JSON"):
        env.tasks("test")
    v1 = tmp_path / "v1"
    env = EcommerceEnv(data=str(v1), user_url=url)
    with pytest.raises(UsageError, match="no tasks for split 'train'"):
        env.tasks("train")


def test_v1_task_files_are_read_as_data_never_run(tmp_path):
    root = tmp_path / "v1"
    write_v1(root)
    marker = tmp_path / "ran"
    (root / "tasks_test.py").write_text(f"import os\nTASKS = [os.system('touch {marker}')]\n")
    env = EcommerceEnv(data=str(root), user_url="http://127.0.0.1:9/v1")
    with pytest.raises(UsageError, match="unsupported task"):
        env.tasks("test")
    assert not marker.exists()
    (root / "tasks_test.py").write_text("TASKS = [\n")
    with pytest.raises(UsageError, match="cannot parse"):
        env.tasks("test")
    # The older v1 layout: a plain list of dicts, in a .py or a .json file.
    (root / "tasks_test.py").unlink()
    (root / "tasks_dev.json").write_text(json.dumps([{"user_id": "yusuf_rossi_9620", "instruction": "hi",
                                                      "actions": [{"name": "get_order_details",
                                                                   "kwargs": {"order_id": "#W2378156"}}],
                                                      "outputs": []}]))
    (task,) = env.tasks("dev")
    assert task.gold["actions"] == [{"name": "get_order_details", "arguments": {"order_id": "#W2378156"}}]


def test_no_eval_or_exec_in_the_environment():
    for f in ("ecommerce.py", "tau_store.py", "tau_telecom.py"):
        src = open(os.path.join(os.path.dirname(__file__), "..", "envs", f)).read()
        assert "eval(" not in src and "exec(" not in src and "import_module" not in src, f


def test_the_user_key_goes_only_where_it_is_named(tmp_path, fake_user, monkeypatch, capsys):
    """No key variable named: no Authorization header, even with OPENAI_API_KEY set; a named variable that is not
    set is refused; a key over plain http to another machine is refused; a redirect is never followed (urllib would
    resend the key to wherever it points)."""
    user = fake_user(["Hi, I want to exchange my keyboard. I am Yusuf Rossi, 19122.", "###STOP###"])
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    env = EcommerceEnv(data=write_v1(tmp_path / "v1"), user_url=user.url, user_model="sim")
    env.reset(env.tasks("test")[0])
    assert user.requests and all(not req["auth"] for req in user.requests)
    with pytest.raises(UsageError, match="NOT_SET_KEY is not set"):
        EcommerceEnv(data=write_v1(tmp_path / "v2"), user_url=user.url, user_api_key_env="NOT_SET_KEY")
    with pytest.raises(UsageError, match="would go to 10.1.2.3 over plain http"):
        EcommerceEnv(data=write_v1(tmp_path / "v3"), user_url="http://10.1.2.3:8000/v1", user_api_key_env="OPENAI_API_KEY")
    EcommerceEnv(data=write_v1(tmp_path / "v4"), user_url=user.url, user_api_key_env="OPENAI_API_KEY")   # loopback
    import urllib.error
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    seen = []

    class Redirect(BaseHTTPRequestHandler):   # 302 to a second server that records what reaches it
        def do_POST(self):
            seen.append((self.server.server_address[1], self.headers.get("Authorization")))
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{other.server_address[1]}/v1/chat/completions")
            self.send_header("Content-Length", "0")
            self.end_headers()
        do_GET = do_POST

        def log_message(self, *args):
            pass
    first, other = ThreadingHTTPServer(("127.0.0.1", 0), Redirect), ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    import threading
    for srv in (first, other):
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = EcommerceEnv(user_url=f"http://127.0.0.1:{first.server_address[1]}/v1", user_api_key_env="OPENAI_API_KEY")
        with pytest.raises(urllib.error.HTTPError, match="302"):
            env._chat([{"role": "user", "content": "hi"}])
        assert seen == [(first.server_address[1], "Bearer sk-secret")]   # the other host never saw the key
    finally:
        for srv in (first, other):
            srv.shutdown()
            srv.server_close()


def test_the_user_model_is_probed_before_work_thinks_not_and_its_reasoning_is_dropped(tmp_path, fake_user):
    """A Qwen3 user is asked not to think (chat_template_kwargs; other servers are not sent the field), its
    <think> text never reaches the agent, and a user endpoint that does not answer stops load_envs in one line."""
    from envs import load_envs
    user = fake_user(["<think>I should ask about the keyboard.</think> I want to exchange my keyboard.",
                      "the template opened it</think>Yes, please."])
    env = EcommerceEnv(data=write_tau2(tmp_path / "t2"), user_url=user.url, user_model="Qwen/Qwen3-32B")
    state = env.reset(env.tasks("test")[0])
    assert state.messages[-1]["content"] == "I want to exchange my keyboard."
    assert user.requests[-1]["body"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert env.step(state, "Shall I go ahead?")[0]["content"] == "Yes, please."
    other = EcommerceEnv(data=write_tau2(tmp_path / "t2"), user_url=user.url, user_model="gpt-4o")
    other.check_services()
    assert "chat_template_kwargs" not in user.requests[-1]["body"] and user.requests[-1]["body"]["max_tokens"] == 16
    for status in (404, 500):
        bad = fake_user(["x"], status=status)
        with pytest.raises(UsageError, match=r"the user model 'nobody' at .* does not answer a probe .*HTTPError"):
            EcommerceEnv(data=write_tau2(tmp_path / "t2"), user_url=bad.url, user_model="nobody").check_services()
    closed = FakeUser([])
    closed.close()
    opts = {"ecommerce": dict(data=write_tau2(tmp_path / "t2"), user_url=closed.url, user_model="m", user_timeout=2)}
    with pytest.raises(UsageError, match=r"^ecommerce: the user model 'm' .* does not answer a probe"):
        load_envs(["ecommerce"], opts)
    EcommerceEnv().check_services()   # the tiny world's scripted user: nothing to probe


# tau3's mock domain at full scale: users and their to-do tasks, the user's own inbox tools, tau2's initial states
# and reward bases. The fixture is written here (not tau3's files): a store of one user and task, six tasks.
MOCK_DB = {"tasks": {"task_1": {"task_id": "task_1", "title": "Test task", "description": "A test task",
                                "status": "pending"}},
           "users": {"user_1": {"user_id": "user_1", "name": "Test User", "tasks": ["task_1"]}}}
MOCK_USER_DB = {"notifications": {}}
CREATE = {"name": "create_task", "arguments": {"user_id": "user_1", "title": "Team Sync"}}
HISTORY = [{"role": "user", "content": "Please add a task 'Budget' for user_1."},
           {"role": "assistant", "tool_calls": [{"id": "c1", "name": "create_task",
                                                 "arguments": {"user_id": "user_1", "title": "Budget"}}]},
           {"role": "tool", "id": "c1", "content": "{\"task_id\": \"task_2\"}"},
           {"role": "assistant", "content": "Created task_2 for you."}]
MOCK_TASKS = [
    {"id": "create", "user_scenario": {"instructions": "Create a task 'Team Sync' for user_1."},
     "evaluation_criteria": {"actions": [CREATE], "communicate_info": ["task_2"]}},
    {"id": "history", "user_scenario": {"instructions": "Now mark task_2 completed."},
     "initial_state": {"message_history": HISTORY},
     "evaluation_criteria": {"env_assertions": [{"env_type": "assistant", "func_name": "assert_task_status",
                                                 "arguments": {"task_id": "task_2", "expected_status": "completed"}}],
                             "reward_basis": ["ENV_ASSERTION"]}},
    {"id": "inbox", "user_scenario": {"instructions": "Check your inbox, have task_1 completed, dismiss n1."},
     "initial_state": {"initialization_actions": [{"env_type": "user", "func_name": "add_notification",
                                                   "arguments": {"notification_id": "n1", "message": "task_1 is yours",
                                                                 "task_id": "task_1"}}]},
     "evaluation_criteria": {"actions": [{"name": "update_task_status",
                                          "arguments": {"task_id": "task_1", "status": "completed"}}],
                             "env_assertions": [{"env_type": "user", "func_name": "assert_notification_status",
                                                 "arguments": {"notification_id": "n1", "expected_status": "read"}}],
                             "reward_basis": ["ACTION", "ENV_ASSERTION"]}},
    {"id": "seeded", "user_scenario": {"instructions": "Complete task_2."},
     "initial_state": {"initialization_data": {"agent_data": {
         "tasks": {"task_2": {"task_id": "task_2", "title": "Review", "description": None, "status": "pending"}},
         "users": {"user_1": {"tasks": ["task_1", "task_2"]}}}}},
     "evaluation_criteria": {"actions": [{"name": "update_task_status",
                                          "arguments": {"task_id": "task_2", "status": "completed"}}]}},
    {"id": "impossible", "user_scenario": {"instructions": "Delete all your tasks."},
     "evaluation_criteria": {"actions": [{"name": "transfer_to_human_agents", "arguments": {"summary": "delete"},
                                          "compare_args": []}], "reward_basis": ["DB", "ACTION"]}},
    {"id": "judged", "user_scenario": {"instructions": "Ask for a compliment."},
     "evaluation_criteria": {"nl_assertions": ["The agent complimented the user", "The agent was polite"],
                             "reward_basis": ["NL_ASSERTION"]}},
]


def write_mock(root, tasks=MOCK_TASKS):
    root.mkdir(exist_ok=True)
    (root / "db.json").write_text(json.dumps(MOCK_DB))
    (root / "user_db.json").write_text(json.dumps(MOCK_USER_DB))
    (root / "tasks.json").write_text(json.dumps(tasks))
    (root / "split_tasks.json").write_text(json.dumps({"base": [t["id"] for t in tasks]}))
    (root / "policy.md").write_text("# Mock policy: tasks have titles; never delete a task, transfer instead.")
    return str(root)


def _play(env, task, turns, replies, user):
    user.replies[:], user.requests[:] = list(replies), []
    state = env.reset(task)
    for text in turns:
        if state.done:
            break
        env.step(state, text)
    return state, env.score(state)[0]


def test_tau3_mock_domain_tools_initial_states_and_reward_bases(tmp_path, fake_user):
    """tau3's mock domain: its own tools and policy, the user's inbox tools called by the LLM user, a message
    history whose tool calls are replayed into the initial database, initialization data and actions, and the
    reward as the product of the checks in each task's reward_basis (DB, COMMUNICATE, ACTION, ENV_ASSERTION,
    NL_ASSERTION by the LLM judge), each one able to fail."""
    user = fake_user([])
    env = EcommerceEnv(data=write_mock(tmp_path / "mock"), user_url=user.url)
    tasks = {t.gold["id"]: t for t in env.tasks("base")}
    assert env.world == "mock" and env.policy.startswith("# Mock policy") and len(tasks) == 6
    assert {s["function"]["name"] for s in tasks["create"].tools} == {"create_task", "get_users", "update_task_status",
                                                                      "transfer_to_human_agents"}
    done = "###STOP###"
    create = tool_call_text("create_task", CREATE["arguments"])
    # DB and COMMUNICATE (the default basis): the gold creation, and task_2 said
    assert _play(env, tasks["create"], [create, "Created task_2."], ["Add 'Team Sync' for user_1.", done], user)[1] == 1
    assert _play(env, tasks["create"], [create, "Created it."], ["Add it.", done], user)[1] == 0          # not said
    wrong = tool_call_text("create_task", {"user_id": "user_1", "title": "Team sync"})
    assert _play(env, tasks["create"], [wrong, "Created task_2."], ["Add it.", done], user)[1] == 0       # DB differs
    # a message history: shown to the agent, its create_task replayed (task_2 exists), told to the user model
    h = tasks["history"]
    assert h.messages[1:] == [{"role": "user", "content": HISTORY[0]["content"]},
                              {"role": "assistant", "content": tool_call_text("create_task", HISTORY[1]["tool_calls"][0]
                                                                              ["arguments"])},
                              {"role": "tool", "name": "create_task", "content": '{"task_id": "task_2"}'},
                              {"role": "assistant", "content": "Created task_2 for you."}]
    state, r = _play(env, h, [tool_call_text("update_task_status", {"task_id": "task_2", "status": "completed"}),
                              "Done."], ["Now complete task_2.", done], user)
    assert r == 1 and state.info["db"]["tasks"]["task_2"]["title"] == "Budget"
    told = user.requests[0]["body"]["messages"]   # the user model's opening request
    assert [m["content"] for m in told[2:4]] == [HISTORY[0]["content"], "Created task_2 for you."]
    assert _play(env, h, ["Done."], ["Now complete task_2.", done], user)[1] == 0                       # assertion fails
    # the user's own tools: offered to the user model, run on its inbox (seeded by initialization_actions)
    check = {"content": None, "tool_calls": [{"id": "u1", "type": "function", "function": {
        "name": "check_notifications", "arguments": "{}"}}]}
    dismiss = {"content": None, "tool_calls": [{"id": "u2", "type": "function", "function": {
        "name": "dismiss_notification", "arguments": '{"notification_id": "n1"}'}}]}
    update = tool_call_text("update_task_status", {"task_id": "task_1", "status": "completed"})
    state, r = _play(env, tasks["inbox"], [update, "Task_1 is completed."],
                     [check, "Please complete task_1.", dismiss, done], user)
    assert r == 1 and state.info["user_db"]["notifications"]["n1"]["status"] == "read"
    assert [t["function"]["name"] for t in user.requests[0]["body"]["tools"]] == ["check_notifications",
                                                                                 "dismiss_notification"]
    assert "task_1 is yours" in user.requests[1]["body"]["messages"][-1]["content"]   # the tool result it saw
    assert _play(env, tasks["inbox"], [update, "Done."], ["Please complete task_1.", done], user)[1] == 0  # not read
    # initialization data merged into the store; ACTION with every argument compared
    assert _play(env, tasks["seeded"], [tool_call_text("update_task_status", {"task_id": "task_2", "status":
                                                                              "completed"}), "Done."],
                 ["Complete task_2.", done], user)[1] == 1
    # ACTION with compare_args []: any transfer; DB: nothing changed
    transfer = tool_call_text("transfer_to_human_agents", {"summary": "wants deletion"})
    assert _play(env, tasks["impossible"], [transfer], ["Delete my tasks."], user)[1] == 1
    assert _play(env, tasks["impossible"], [create, transfer], ["Delete my tasks."], user)[1] == 0      # DB changed
    # NL_ASSERTION: the LLM at user_url judges; out of format is a no
    for verdict, want in (("[true, true]", 1), ("[true, false]", 0), ("I think so", 0)):
        assert _play(env, tasks["judged"], ["You are great, thank you!"], ["Compliment me.", done, verdict],
                     user)[1] == want, verdict


def test_tau3_mock_bad_data_is_a_clear_error(tmp_path, fake_user):
    user = fake_user([])
    bad = [dict(MOCK_TASKS[0], evaluation_criteria={"actions": [{"name": "delete_task", "arguments": {}}]})]
    with pytest.raises(UsageError, match="unknown gold action 'delete_task'"):
        EcommerceEnv(data=write_mock(tmp_path / "a", bad), user_url=user.url).tasks("base")
    bad = [dict(MOCK_TASKS[0], evaluation_criteria={"reward_basis": ["VIBES"]})]
    with pytest.raises(UsageError, match="reward_basis"):
        EcommerceEnv(data=write_mock(tmp_path / "b", bad), user_url=user.url).tasks("base")
    bad = [dict(MOCK_TASKS[0], initial_state={"initialization_actions": [
        {"env_type": "assistant", "func_name": "update_task_status", "arguments": {"task_id": "task_9",
                                                                                   "status": "completed"}}]})]
    env = EcommerceEnv(data=write_mock(tmp_path / "c", bad), user_url=user.url)
    with pytest.raises(UsageError, match="initial state .* fails at update_task_status"):
        env.reset(env.tasks("base")[0])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "db.json").write_text(json.dumps(MOCK_DB))
    with pytest.raises(UsageError, match="no policy.md"):
        EcommerceEnv(data=str(tmp_path / "d"), user_url=user.url)
