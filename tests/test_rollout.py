"""envs/rollout.py, the rollout loop: masks, log-probs, limits, on a micro model and on a scripted backend; the
environment calls of a turn at once; the scripted expert's episodes and saved episodes replayed exactly as sampled
ones (ReplayBackend, TranscriptEnv). The engines are tests/test_engine.py's."""
import json
import os

import pytest

from acl.engine import HFBackend
from envs import make_env
from envs.base import Env, Task, UsageError, function_schema, parse_tool_calls, tool_call_text, tool_message
from envs.rollout import (
    Generation,
    ReplayBackend,
    episode_record,
    expert_episodes,
    expert_records,
    rollout,
    saved_episodes,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class EchoEnv(Env):
    """A toy multi-turn env: every tool call gets a tool message back; a turn without one ends it."""
    domain, max_turns = "echo", 3

    def step(self, state, text):
        state.messages.append({"role": "assistant", "content": text})
        state.turns += 1
        calls, errors = parse_tool_calls(text)
        obs = [tool_message(n, f"result for {a}") for n, a in calls] + [tool_message("error", e) for e in errors]
        if not calls and not errors:
            state.done = True
        elif state.turns >= self.max_turns:
            state.done = True
            obs = []
        state.messages += obs
        return obs

    def score(self, state):
        last = state.messages[-1]["content"] if state.messages[-1]["role"] == "assistant" else ""
        return float("ok" in last), {"turns": float(state.turns)}


TASK = Task("t0", "echo", "test", [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}],
            tools=[function_schema("search", "s", {"query": {"type": "string"}})])


class ScriptedBackend:
    """Returns fixed turns (as text) in order, encoded with the tokenizer, ending with a stop token."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.i = tok, turns, 0

    def generate(self, prompts, max_new_tokens, temperature, stop_ids):
        out = []
        for _ in prompts:
            text = self.turns[min(self.i, len(self.turns) - 1)]
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            ids = ids[:max_new_tokens]
            out.append(Generation(ids, [-0.5] * len(ids), ids[-1] in stop_ids))
        self.i += 1
        return out


def masked_text(tok, ep):
    return tok.decode([t for t, m in zip(ep.token_ids, ep.loss_mask) if m], skip_special_tokens=False)


def test_masks_cover_exactly_the_policy_turns(micro):
    _, tok = micro
    call = tool_call_text("search", {"query": "x"})
    turns = [call, "<answer>ok</answer><|im_end|>"]
    ep = rollout(ScriptedBackend(tok, turns), tok, [(EchoEnv(), TASK)], n_samples=1)[0]
    assert masked_text(tok, ep) == call + "<answer>ok</answer><|im_end|>"
    assert ep.reward == 1.0 and not ep.truncated and ep.turns == 2
    # the full sequence is exactly the chat template's rendering of the transcript
    full = tok.apply_chat_template(ep.messages, tools=TASK.tools, tokenize=False)
    assert tok.decode(ep.token_ids, skip_special_tokens=False) == full
    assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs)
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
    # tool output tokens are masked out
    assert "result for" not in masked_text(tok, ep)


def test_turn_limit_truncates(micro):
    _, tok = micro
    call = tool_call_text("search", {"query": "again"})
    eps = rollout(ScriptedBackend(tok, [call]), tok, [(EchoEnv(), TASK)], n_samples=2, max_turns=2)
    for ep in eps:
        assert ep.truncated and ep.turns == 2 and ep.reward == 0.0
        assert masked_text(tok, ep) == call * 2


def test_token_limit_truncates_mid_turn(micro):
    _, tok = micro
    long = "word " * 200 + "<|im_end|>"
    ep = rollout(ScriptedBackend(tok, [long]), tok, [(EchoEnv(), TASK)], max_tokens=80)[0]
    assert ep.truncated and len(ep.token_ids) == 80
    assert ep.loss_mask[-1] == 1


def test_hf_rollout_end_to_end_masks(micro):
    model, tok = micro
    eps = rollout(HFBackend(model, tok), tok, [(EchoEnv(), TASK)] * 3, n_samples=2, max_tokens=200,
                  max_turn_tokens=30, seed=0)
    assert len(eps) == 6 and [e.sample for e in eps] == [0, 1] * 3
    for ep in eps:
        assistant = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        text = masked_text(tok, ep).replace("<|im_end|>", "")
        assert text == "".join(assistant)
        assert ep.n_sampled > 0 and all(lp <= 0 for lp in ep.logprobs)


def test_environment_calls_of_one_turn_run_at_once_against_a_slow_service(micro):
    """A search env backed by a slow retrieval server (0.3 s a call): with workers, a turn of 16 episodes waits about
    one call, not sixteen; the episodes, their order and their rewards are those of the one-at-a-time loop."""
    import time

    from fake_http import JSONServer

    from envs import env_options
    from envs.search import SEARCH_TOOL, SearchEnv
    _, tok = micro
    latency = 0.3

    import threading
    lock, flight = threading.Lock(), {"now": 0, "most": 0}

    def slow(path, headers, body):
        with lock:
            flight["now"] += 1
            flight["most"] = max(flight["most"], flight["now"])
        time.sleep(latency)
        with lock:
            flight["now"] -= 1
        q = body["queries"][0]
        return 200, {"result": [[{"document": {"contents": f'"{q}"\\nborn in Brimsk.'}, "score": 1.0}]]}
    tasks = [Task(f"s{i}", "search", "test", [{"role": "user", "content": f"Where was P{i} born?"}], tools=[SEARCH_TOOL],
                  gold={"answers": ["Brimsk"]}) for i in range(16)]
    turns = [tool_call_text("search", {"query": "P"}), "<answer>Brimsk</answer><|im_end|>"]
    with JSONServer(slow) as server:
        runs = {}
        for workers in (1, 16):
            env = SearchEnv(retriever_url=server.url + "/retrieve", workers=workers)
            flight["most"] = 0
            t0 = time.time()
            eps = rollout(ScriptedBackend(tok, turns), tok, [(env, t) for t in tasks], n_samples=1)
            runs[workers] = (time.time() - t0, eps, flight["most"])
    (slow_s, one, serial), (fast_s, many, parallel) = runs[1], runs[16]
    # the calls of one turn are in flight together (the server sees them at once), so the turn waits about one
    # call's latency; the wall-time bound is loose (a loaded machine adds overhead, not serial waits)
    assert serial == 1 and parallel >= 8, (serial, parallel)   # 16 when no thread starts late (15 seen under load)
    assert slow_s >= 16 * latency and fast_s < slow_s / 2, (slow_s, fast_s)
    assert [(e.task_id, e.token_ids, e.reward) for e in one] == [(e.task_id, e.token_ids, e.reward) for e in many]
    assert all(e.reward == 1.0 and e.metrics["searches"] == 1 for e in many)
    assert SearchEnv().workers == 1                                   # the in-process worlds stay serial
    import argparse
    a = argparse.Namespace(math_data=None, if_data=None, search_data=None, search_corpus=None,
                           retriever_url="http://x/retrieve", tau_data=None, user_url=None, user_model=None,
                           user_key_env=None, max_user_errors=0.25, env_workers=8)
    assert env_options(a)["search"]["workers"] == 8 and "workers" not in env_options(a)["ecommerce"]

LIMITS = dict(max_tokens=20000, max_turn_tokens=4000)   # the micro tokenizer spends more tokens than the tiny one


class Sampler:
    """A 'policy' that happens to sample exactly these texts, token by token as the tokenizer splits them, closing
    each turn as a sampler does (at a stop token, else with <|im_end|>), with made-up log-probs."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.i = tok, texts, 0

    def generate(self, prompts, max_new_tokens, temperature, stop_ids, adapters=None):
        ids = self.tok(self.texts[self.i], add_special_tokens=False)["input_ids"]
        self.i += 1
        stop = [j for j, t in enumerate(ids) if t in stop_ids]
        ids = ids[: stop[0] + 1] if stop else ids + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        return [Generation(ids, [-0.3] * len(ids), True)]


@pytest.mark.parametrize("domain", ["math", "search", "ecommerce", "if"])
def test_expert_replay_is_a_sampled_episode_of_the_same_text(micro, domain):
    _, tok = micro
    env = make_env(domain)
    for task in env.tasks("test", n=3) + env.tasks("ood", n=2):
        texts = env.expert(task)
        replay = expert_episodes(tok, env, [task], **LIMITS)[0]
        sampled = rollout(Sampler(tok, texts), tok, [(env, task)], 1, **LIMITS)[0]
        assert replay.token_ids == sampled.token_ids and replay.loss_mask == sampled.loss_mask
        assert replay.prompt_len == sampled.prompt_len and replay.messages == sampled.messages
        assert replay.reward == sampled.reward == 1.0 and not replay.truncated   # the expert solves its task
        assert all(lp == 0.0 for lp in replay.logprobs)
        # the mask covers the expert's turns and nothing else
        said = [tok.decode([t for t, m in zip(replay.token_ids, replay.loss_mask) if m], skip_special_tokens=False)]
        assert said[0].replace("<|im_end|>", "") == "".join(texts)


def test_every_tiny_expert_episode_scores_one(micro):
    _, tok = micro
    for domain in ("math", "search", "ecommerce", "if"):
        env = make_env(domain)
        for split in ("train", "val", "test", "ood"):
            eps = expert_episodes(tok, env, env.tasks(split, n=25), **LIMITS)
            assert len(eps) == 25 and all(e.reward == 1.0 for e in eps), (domain, split)


def test_replay_backend_cuts_at_a_stop_token_and_at_the_limit(micro):
    _, tok = micro
    eos, call_end = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("</tool_call>")
    g = ReplayBackend(tok, ["<tool_call>{}</tool_call> more"]).generate([[1]], 100, 1.0, [eos, call_end])[0]
    assert g.token_ids[-1] == call_end and g.stopped and "more" not in tok.decode(g.token_ids)
    g = ReplayBackend(tok, ["a long reply " * 20]).generate([[1]], 5, 1.0, [eos])[0]
    assert len(g.token_ids) == 5 and not g.stopped
    g = ReplayBackend(tok, ["x"]).generate([[1]], 5, 1.0, [eos])[0]
    assert g.token_ids[-1] == eos and g.stopped


def test_saved_episodes_render_exactly_as_the_live_ones(micro, tmp_path):
    _, tok = micro
    for domain in ("search", "ecommerce"):
        env = make_env(domain)
        tasks = env.tasks("train", n=4)
        live = expert_episodes(tok, env, tasks, **LIMITS)
        path = tmp_path / f"{domain}.jsonl"
        path.write_text("".join(json.dumps(episode_record(e, t)) + "\n" for e, t in zip(live, tasks)))
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        again = saved_episodes(tok, rows, **LIMITS)
        for x, y in zip(live, again):
            assert x.token_ids == y.token_ids and x.loss_mask == y.loss_mask and y.reward == 1.0
        assert expert_records(str(tmp_path), domain) == rows
    with pytest.raises(UsageError, match="not a directory"):
        expert_records(str(tmp_path / "missing"), "search")
