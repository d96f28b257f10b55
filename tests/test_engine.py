"""acl/engine.py, the HF engine: sampled log-probs = teacher forcing, greedy decoding = transformers' generate, kept
KV caches and continuous batching = full re-prefill on every domain (with the shared-prefix attention and with stock
sdpa, as a GPU runs it), the byte cap on kept caches, the shared-prefix attention by hand, and a stream admit freeing
what it stacked."""
import os

import pytest
import torch
from test_rollout import TASK

from acl.engine import HFBackend
from envs.rollout import ChatML, rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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

    def _decode(self, cache, nxt, attn, pos, kw):
        self.__dict__.setdefault("graph_steps", set()).add(self.decoder is not None and not kw)
        return super()._decode(cache, nxt, attn, pos, kw)

    def _stack(self, parts, B, room):
        self.__dict__.setdefault("stacked", []).append(B)
        self.__dict__.setdefault("attention", set()).add(self.model.config._attn_implementation)
        return super()._stack(parts, B, room)


class TurnByTurn(Watched):
    stream = None        # rollout() then calls generate() once per turn, on the kept caches


def tiny_policy(path, device="cpu"):
    """(model, tokenizer) of a tiny checkpoint, for inference: the tiny_agent fixture's (conftest.py), which
    speaks the protocol, so e-commerce episodes run to several turns and turns end before their limit."""
    from acl.common import load_policy
    model, tok = load_policy(path, device)
    return model.eval(), tok


def items_of(domain, n=4):
    from envs import make_env
    env = make_env(domain)
    return [(env, t) for t in env.tasks("test", n=n, seed=0)]


def check_kept_equals_re_prefill(model, tok, shared_attention=True, graphs=False):
    """Greedy rollouts on every domain continued on kept caches, turn by turn (generate) and with continuous batching
    (stream, also with a batch cap of 3 rows: episodes wait, then join a running batch) = the re-prefill path's token
    for token, with the same masks and rewards; no cache outlives its rollout, and within one the kept ones are at
    most one call's rows, the stream's batch at most max_batch rows. The attention is shared_prefix_attention on a
    CPU, or with shared_attention False (and on a GPU) the model's own; graphs: each decode step through GraphDecode
    (its static step on a CPU, a CUDA graph on a GPU), which then decoded every domain."""
    from envs import DOMAINS
    split = shared_attention and model.device.type == "cpu"
    attention = {"aclarena-shared" if split else model.config._attn_implementation}
    for d in DOMAINS:
        items = items_of(d)
        plain = rollout(HFBackend(model, tok, reuse_kv=False), tok, items, 2, temperature=0.0, seed=0)
        want = [(e.token_ids, e.loss_mask, e.reward) for e in plain]
        backend = TurnByTurn(model, tok, shared_attention=shared_attention, graphs=graphs)
        kept = rollout(backend, tok, items, 2, temperature=0.0, seed=0)
        sizes = backend.sizes
        assert [(e.token_ids, e.loss_mask, e.reward) for e in kept] == want, d
        assert backend.graph_steps == {graphs}, d   # every decode step through GraphDecode, or none
        assert backend.kept == {} and all(n_kept <= n for n, n_kept in sizes), (d, sizes)
        for cap in (64, 3):
            streamed = Watched(model, tok, max_batch=cap, shared_attention=shared_attention, graphs=graphs)
            assert [(e.token_ids, e.loss_mask, e.reward) for e in rollout(streamed, tok, items, 2, temperature=0.0,
                                                                          seed=0)] == want, (d, cap)
            assert 0 < max(streamed.stacked) <= cap and not hasattr(streamed, "sizes"), streamed.__dict__.keys()
            assert streamed.graph_steps == {graphs}, (d, cap)
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


def check_sampled_logprobs_are_teacher_forced(model, tok, shared_attention=True, graphs=False):
    """Sampled rollouts on every domain, with continuous batching (3 rows a batch) and turn by turn: each sampled
    token's log-prob equals the model's teacher-forced one within float tolerance. The episodes end max_turn_tokens - 16
    tokens after the shortest prompt, so each row's budget (max_tokens - its length) is below max_turn_tokens and
    differs by row."""
    from envs import DOMAINS
    from envs.rollout import MAX_TURN_TOKENS
    chat, budgets, worst = ChatML(tok), [], 0.0
    for d in DOMAINS:
        items = items_of(d)
        lengths = [len(chat.prompt(env.reset(t).messages, t.tools)) for env, t in items]
        end = min(lengths) + MAX_TURN_TOKENS - 16
        assert max(lengths) < end - 32, (d, lengths)     # every row has room for a turn
        streamed = Watched(model, tok, max_batch=3, shared_attention=shared_attention, graphs=graphs)
        for b in (streamed, TurnByTurn(model, tok, shared_attention=shared_attention, graphs=graphs)):
            for e in rollout(b, tok, items, 2, seed=1, max_tokens=end):
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


ATTENTIONS = pytest.mark.parametrize("shared_attention,graphs", [(True, False), (False, False), (False, True)],
                                     ids=["shared-prefix", "stock-sdpa", "static-step"])


@ATTENTIONS
def test_kept_kv_caches_give_the_re_prefilled_episodes_and_are_freed(shared_attention, graphs, tiny_agent):
    """check_kept_equals_re_prefill on the tiny agent, with the project's shared-prefix attention, with the model's
    stock sdpa (the attention a GPU run takes: kept caches, padding inside a row and stacked parts), and with stock
    sdpa through GraphDecode's static step (what a CUDA graph replays: every position of a fixed capacity, masked)."""
    model, tok = tiny_policy(tiny_agent)
    assert model.config._attn_implementation == "sdpa"
    check_kept_equals_re_prefill(model, tok, shared_attention, graphs)


@ATTENTIONS
def test_sampled_logprobs_are_the_teacher_forced_ones_on_every_domain(shared_attention, graphs, tiny_agent):
    """check_sampled_logprobs_are_teacher_forced on the tiny agent, each attention (measured: 3e-5 at most)."""
    model, tok = tiny_policy(tiny_agent)
    assert check_sampled_logprobs_are_teacher_forced(model, tok, shared_attention, graphs) < 1e-4


def test_kept_caches_stay_within_a_byte_cap_and_give_the_same_episodes(tiny_agent):
    """kv_cap bounds the bytes of kept caches held at once (the previous call's not yet used included): beyond it a
    row is not kept and its next turn is prefilled whole. With a cap of none and of a third of what the multi-turn
    domains keep uncapped, turn by turn and streamed, the episodes are the re-prefill path's (token ids, masks,
    rewards) and the uncapped run's; the cap is never exceeded and, when it allows, some caches are still kept."""
    model, tok = tiny_policy(tiny_agent)
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


def test_graph_decode_pads_a_batch_to_its_bucket_and_shares_the_graph(micro):
    """GraphDecode rounds a batch's rows up to a power of two (>= 8; within max_batch when the batch fits), so the
    batch sizes continuous batching passes through share one static shape: batches of 3, 5, 8 and 6 rows (each a
    fresh prefill copied in, then a step on the adopted cache) give each row the model's own step logits, with one
    build; 9 rows with max_batch 12 take a second, of 12 rows."""
    from acl.engine import GraphDecode, cache_kwarg
    model, tok = micro
    backend = HFBackend(model, tok, max_batch=12, shared_attention=False)
    dec = GraphDecode(model, max_rows=12)
    assert [dec.rows(b) for b in (1, 3, 8, 9, 12, 13, 40)] == [8, 8, 8, 12, 12, 16, 64]
    assert [GraphDecode(model, max_rows=4).rows(b) for b in (1, 3, 4, 5)] == [4, 4, 4, 8]
    texts = ["What is 12+7?", "Tomas", "<answer>Brimsk", "hi there", "What is 3*4? \\boxed{", "x", "search(",
             "Velder", "born in"]
    for B, builds in ((3, 1), (5, 1), (8, 1), (6, 1), (9, 2)):
        prompts = [tok(t)["input_ids"] for t in texts[:B]]
        cache, logits, attn, pos = backend._prefill(prompts, 4, torch.device("cpu"))
        ref, *_ = backend._prefill(prompts, 4, torch.device("cpu"))
        for _ in range(2):   # the first step copies the fresh cache in, the second runs on the adopted one
            nxt, attn, pos = logits.argmax(-1), torch.cat([attn, torch.ones_like(attn[:, :1])], 1), pos + 1
            with torch.no_grad():
                want = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos[:, None], use_cache=True,
                             **{cache_kwarg(model): ref}).logits[:, -1]
                logits = dec.step(cache, nxt, attn, pos)
            assert logits.shape == want.shape and torch.allclose(logits, want, atol=1e-5), B
            assert cache.layers[0].kbuf.size(0) == B and cache.layers[0].kbuf.data_ptr() == dec.kv[0][0].data_ptr()
        assert dec.builds == builds and dec.shape[0] == dec.rows(B), (B, dec.builds, dec.shape)


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


def test_a_stream_admit_frees_the_caches_it_stacked(tiny_agent):
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
    model, tok = tiny_policy(tiny_agent)
    b = Freed(model, tok, max_batch=3)
    rollout(b, tok, items_of("ecommerce"), 2, temperature=0.0, seed=0)
    assert len(b.alive) > 3 and not any(b.alive), b.alive


def test_make_backend_rewakes_a_sleeping_vllm_engine_in_wake_and_push_order(monkeypatch):
    """A later make_backend on the process's sleeping vLLM engine (the next checkpoint of evaluate.py, a script's
    second stage) wakes the weights, pushes, and only then the KV cache: waking everything before the push would
    hold the KV cache beside the push's gathered tensors, the peak wake_and_push exists to avoid."""
    import acl.engine as engine_mod

    calls = []

    class Sleeping:
        path = "ckpt-a"

        def wake(self, tags=None):
            calls.append(("wake", tuple(tags) if tags else "all"))

        def load_weights(self, named):
            calls.append(("push", [n for n, _ in named]))

    eng = Sleeping()
    monkeypatch.setattr(engine_mod, "shared_vllm", lambda *a, **k: (eng, False))
    monkeypatch.setattr(engine_mod, "same_tensors", lambda *a, **k: None)
    monkeypatch.setattr(engine_mod, "checkpoint_tensors", lambda path: iter([("w", torch.zeros(1))]))
    monkeypatch.setattr(engine_mod, "full_params", lambda policy: iter([("p", torch.zeros(1))]))
    for policy in (None, torch.nn.Linear(1, 1)):
        calls.clear()
        backend, model = engine_mod.make_backend("vllm", None, "ckpt-b", policy=policy)
        assert backend is eng and model is None
        assert calls == [("wake", ("weights",)), ("push", ["w" if policy is None else "p"]), ("wake", ("kv_cache",))]
