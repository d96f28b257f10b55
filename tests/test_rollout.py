"""The rollout loop: masks, log-probs, limits, on a micro model and on a scripted backend; the hf backend's kept
caches and continuous batching against full re-prefill, with both attentions, and its cap on kept caches."""
import os

import pytest
import torch

from acl.engine import HFBackend
from envs.base import Env, Task, function_schema, parse_tool_calls, tool_call_text, tool_message
from envs.rollout import ChatML, Generation, rollout

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


def test_hf_backend_logprobs_match_teacher_forcing(micro):
    model, tok = micro
    chat = ChatML(tok)
    prompts = [chat.prompt(TASK.messages, TASK.tools), chat.prompt([{"role": "user", "content": "hi"}], None)]
    torch.manual_seed(0)
    gens = HFBackend(model, tok, max_batch=8).generate(prompts, 12, 1.0, chat.stop_ids)
    for p, g in zip(prompts, gens):
        assert 1 <= len(g.token_ids) <= 12
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(p) - 1:-1].float(), -1)
        ref = logp.gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert torch.allclose(ref, torch.tensor(g.logprobs), atol=1e-4), (ref, g.logprobs)


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


def test_hf_backend_greedy_matches_transformers_generate(micro):
    """The hand-written decode loop (shared prefills, rows leaving the batch) = model.generate, greedily."""
    model, tok = micro
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    prompts = [tok("What is 12+7?")["input_ids"], tok("Tomas")["input_ids"], tok("What is 12+7?")["input_ids"],
               tok("<answer>Brimsk")["input_ids"]]
    gens = HFBackend(model, tok, max_batch=3).generate(prompts, 12, 0.0, stop)
    for p, g in zip(prompts, gens):
        ref = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, eos_token_id=stop, pad_token_id=tok.pad_token_id)
        want = ref[0, len(p):].tolist()
        assert g.token_ids == want[: len(g.token_ids)] and len(g.token_ids) == len(want)
        assert g.stopped == (want[-1] in stop)
    assert gens[0].token_ids == gens[2].token_ids


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


class Watched(HFBackend):
    """HFBackend that records, after each turn-by-turn call, its prompts and how many caches it keeps; for continuous
    batching (stream) the size of every batch it stacks and every row's budget; the attention each stack ran under."""

    def generate(self, prompts, *a, **kw):
        out = super().generate(prompts, *a, **kw)
        self.__dict__.setdefault("sizes", []).append((len(prompts), sum(len(v) for k in self.kept.values()
                                                                          for v in k.values())))
        self.__dict__.setdefault("shared_lens", []).append([len(s[0]) for s in self.shared.values() if s])
        return out

    def stream(self, prompts, budgets, temperature, stop_ids, turn_done):
        self.budgets = [list(budgets)]

        def recorded(ended):
            go_on = turn_done(ended)
            self.budgets.append([b for _, _, b in go_on])
            return go_on
        return super().stream(prompts, budgets, temperature, stop_ids, recorded)

    def _stack(self, parts, B, room):
        self.__dict__.setdefault("stacked", []).append(B)
        self.__dict__.setdefault("attention", set()).add(self.model.config._attn_implementation)
        return super()._stack(parts, B, room)


class TurnByTurn(Watched):
    stream = None        # rollout() then calls generate() once per turn, on the kept caches


def tiny_base(device="cpu"):
    from acl.common import load_policy
    model, tok = load_policy(os.path.join(ROOT, "assets", "tiny-base"), device)
    return model.eval(), tok


def items_of(domain, n=4):
    from envs import make_env
    env = make_env(domain)
    return [(env, t) for t in env.tasks("test", n=n, seed=0)]


def check_kept_equals_re_prefill(model, tok, shared_attention=True):
    """Greedy rollouts on every domain continued on kept caches, turn by turn (generate) and with continuous batching
    (stream, also with a batch cap of 3 rows: episodes wait, then join a running batch) = the re-prefill path's token
    for token, with the same masks and rewards; no cache outlives its rollout, and within one the kept ones are at
    most one call's rows, the stream's batch at most max_batch rows. The attention is shared_prefix_attention on a
    CPU, or with shared_attention False (and on a GPU) the model's own."""
    from envs import DOMAINS
    split = shared_attention and model.device.type == "cpu"
    attention = {"aclarena-shared" if split else model.config._attn_implementation}
    for d in DOMAINS:
        items = items_of(d)
        plain = rollout(HFBackend(model, tok, reuse_kv=False), tok, items, 2, temperature=0.0, seed=0)
        want = [(e.token_ids, e.loss_mask, e.reward) for e in plain]
        backend = TurnByTurn(model, tok, shared_attention=shared_attention)
        kept = rollout(backend, tok, items, 2, temperature=0.0, seed=0)
        sizes = backend.sizes
        assert [(e.token_ids, e.loss_mask, e.reward) for e in kept] == want, d
        assert backend.kept == {} and all(n_kept <= n for n, n_kept in sizes), (d, sizes)
        for cap in (64, 3):
            streamed = Watched(model, tok, max_batch=cap, shared_attention=shared_attention)
            assert [(e.token_ids, e.loss_mask, e.reward) for e in rollout(streamed, tok, items, 2, temperature=0.0,
                                                                          seed=0)] == want, (d, cap)
            assert 0 < max(streamed.stacked) <= cap and not hasattr(streamed, "sizes"), streamed.__dict__.keys()
            assert streamed.kept == {} and streamed.shared == {} and streamed.attention == attention, d
        if d == "ecommerce":
            assert max(e.turns for e in kept) > 2 and len(sizes) > 2      # multi-turn: later calls started on caches
            assert len(streamed.stacked) > 3                                # episodes joined a running batch
            assert backend.attention == attention, backend.attention
            if split:   # the system prompt with its tool schemas was split off once and kept for every later turn
                assert all(lens and lens[0] >= 64 for lens in backend.shared_lens), backend.shared_lens
                assert len({tuple(lens) for lens in backend.shared_lens}) == 1, backend.shared_lens
            else:
                assert not any(backend.shared_lens), backend.shared_lens


def check_sampled_logprobs_are_teacher_forced(model, tok, shared_attention=True):
    """Sampled rollouts on every domain, with continuous batching (3 rows a batch) and turn by turn: each sampled
    token's log-prob equals the model's teacher-forced one within float tolerance. The episodes end 200 tokens after
    the longest prompt, so each row's budget (max_tokens - its length) is below max_turn_tokens and differs by row."""
    from envs import DOMAINS
    from envs.rollout import MAX_TURN_TOKENS
    chat, budgets, worst = ChatML(tok), [], 0.0
    for d in DOMAINS:
        items = items_of(d)
        longest = max(len(chat.prompt(env.reset(t).messages, t.tools)) for env, t in items)
        streamed = Watched(model, tok, max_batch=3, shared_attention=shared_attention)
        for b in (streamed, TurnByTurn(model, tok, shared_attention=shared_attention)):
            for e in rollout(b, tok, items, 2, seed=1, max_tokens=longest + 200):
                ids = torch.tensor([e.token_ids], device=model.device)
                with torch.no_grad():
                    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                forced = logp.gather(-1, ids[0, 1:, None])[:, 0].cpu()
                on = torch.tensor(e.loss_mask[1:]).bool()
                torch.testing.assert_close(torch.tensor(e.logprobs[1:])[on], forced[on], atol=1e-4, rtol=0)
                worst = max(worst, (torch.tensor(e.logprobs[1:])[on] - forced[on]).abs().max().item())
        budgets.append(streamed.budgets)
    # each stream started its rows on budgets of their own (their prompts' lengths differ), all below max_turn_tokens,
    # and went on to later turns (search, e-commerce) on budgets as low as 10 tokens
    for first in (b[0] for b in budgets):
        assert len(set(first)) > 1 and max(first) < MAX_TURN_TOKENS, first
    assert sum(len(b) for _, *later in budgets for b in later) > 10, budgets
    return worst


@pytest.mark.parametrize("shared_attention", [True, False], ids=["shared-prefix", "stock-sdpa"])
def test_kept_kv_caches_give_the_re_prefilled_episodes_and_are_freed(shared_attention):
    """check_kept_equals_re_prefill on the tiny base, with the project's shared-prefix attention and with the model's
    stock sdpa (the attention a GPU run takes: kept caches, padding inside a row and stacked parts)."""
    model, tok = tiny_base()
    assert model.config._attn_implementation == "sdpa"
    check_kept_equals_re_prefill(model, tok, shared_attention)


@pytest.mark.parametrize("shared_attention", [True, False], ids=["shared-prefix", "stock-sdpa"])
def test_sampled_logprobs_are_the_teacher_forced_ones_on_every_domain(shared_attention):
    """check_sampled_logprobs_are_teacher_forced on the tiny base, both attentions (measured: 3e-5 at most)."""
    model, tok = tiny_base()
    assert check_sampled_logprobs_are_teacher_forced(model, tok, shared_attention) < 1e-4


def test_kept_caches_stay_within_a_byte_cap_and_give_the_same_episodes():
    """kv_cap bounds the bytes of kept caches held at once (the previous call's not yet used included): beyond it a
    row is not kept and its next turn is prefilled whole. With a cap of none and of a third of what the multi-turn
    domains keep uncapped, turn by turn and streamed, the episodes are the re-prefill path's (token ids, masks,
    rewards) and the uncapped run's; the cap is never exceeded and, when it allows, some caches are still kept."""
    model, tok = tiny_base()
    assert HFBackend(model, tok).cap > 2 ** 20       # the default: a share of the RAM, far above the tiny arena's
    for d in ("search", "ecommerce"):
        items = items_of(d)
        want = [(e.token_ids, e.loss_mask, e.reward)
                for e in rollout(HFBackend(model, tok, reuse_kv=False), tok, items, 2, temperature=0.0, seed=0)]
        for kind in (TurnByTurn, Watched):
            free = kind(model, tok, max_batch=3)
            assert [(e.token_ids, e.loss_mask, e.reward) for e in rollout(free, tok, items, 2, temperature=0.0,
                                                                          seed=0)] == want, d
            for cap in (0, free.kept_peak // 3):
                b = kind(model, tok, max_batch=3, kv_cap=cap)
                got = rollout(b, tok, items, 2, temperature=0.0, seed=0)
                assert [(e.token_ids, e.loss_mask, e.reward) for e in got] == want, (d, kind.__name__, cap)
                assert b.kept_peak <= cap and (b.kept_peak > 0) == (cap > 0), (d, kind.__name__, cap, b.kept_peak)
                assert b.kept == {} and b.kept_bytes == 0 and b.kept_old == 0


def test_shared_prefix_attention_is_attention_over_prefix_and_own_tokens():
    """shared_prefix_attention (the hf backend's generation on a CPU): each row's attention over one shared prefix and
    its own masked tokens, merged by log-sum-exps, equals plain softmax attention over the concatenation, for one-token
    (decode) and many-token (prefill) queries, grouped-query heads and padding; without a prefix it is plain attention."""
    import types

    import torch.nn.functional as F

    from acl.engine import shared_prefix_attention
    torch.manual_seed(0)
    B, H, Hk, T, P, D = 3, 6, 2, 9, 5, 8
    module = types.SimpleNamespace(layer_idx=1)
    pk, pv = torch.randn(1, Hk, P, D), torch.randn(1, Hk, P, D)
    prefix = [None, (pk, pv)]
    k, v = torch.randn(B, Hk, T, D), torch.randn(B, Hk, T, D)
    for q in (1, 4):
        query = torch.randn(B, H, q, D)
        mask = torch.ones(B, 1, q, T, dtype=torch.bool).tril(T - q)   # causal, the queries last
        mask[0, :, :, :3] = False                                          # row 0 left-padded
        full_k = torch.cat([pk.expand(B, -1, -1, -1), k], 2).repeat_interleave(H // Hk, 1)
        full_v = torch.cat([pv.expand(B, -1, -1, -1), v], 2).repeat_interleave(H // Hk, 1)
        full_mask = torch.cat([torch.ones(B, 1, q, P, dtype=torch.bool), mask], -1)
        want = F.scaled_dot_product_attention(query, full_k, full_v, attn_mask=full_mask).transpose(1, 2)
        got, _ = shared_prefix_attention(module, query, k, v, mask, scaling=D ** -0.5, shared_prefix=prefix)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        plain = F.scaled_dot_product_attention(query, k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1),
                                               attn_mask=mask).transpose(1, 2)
        torch.testing.assert_close(shared_prefix_attention(module, query, k, v, mask, scaling=D ** -0.5)[0], plain,
                                   atol=1e-5, rtol=1e-5)

def test_a_stream_admit_frees_the_caches_it_stacked():
    """After an admit, the stacked batch's cache is the only one: the previous batch's and the parts' caches (fresh
    prefills, kept caches of the rows that joined) are freed while it decodes, not held until the next admit (they
    held about the batch's cache once more through every decode step)."""
    import weakref

    class Freed(HFBackend):
        def _stack(self, parts, B, room):
            self.refs = [weakref.ref(p[4]) for p in parts]
            return super()._stack(parts, B, room)

        def stream(self, prompts, budgets, temperature, stop_ids, turn_done):
            self.alive = []

            def checked(ended):
                self.alive.append(sum(r() is not None for r in self.refs))
                return turn_done(ended)
            return super().stream(prompts, budgets, temperature, stop_ids, checked)
    model, tok = tiny_base()
    b = Freed(model, tok, max_batch=3)
    rollout(b, tok, items_of("ecommerce"), 2, temperature=0.0, seed=0)
    assert len(b.alive) > 3 and not any(b.alive), b.alive
