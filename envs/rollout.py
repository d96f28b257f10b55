"""The multi-turn rollout loop over any environment: what a policy's episode is, token by token.

    from acl.engine import HFBackend
    from envs.rollout import rollout
    episodes = rollout(HFBackend(model, tok), tok, [(env, task) for task in tasks], n_samples=8)

Each Episode keeps the exact sampled token ids (never decoded and re-tokenized), a loss mask that is 1
only on tokens the policy sampled, the sampling log-probs, the reward, metrics and transcript.
Prompt, tool and user tokens are rendered with the tokenizer's chat template (ChatML/Qwen layout) and
appended with mask 0. A backend is anything with
    generate(prompts: list[list[int]], max_new_tokens: int, temperature: float, stop_ids: list[int],
             adapters: list[str | None] | None = None) -> list[Generation]
(adapters: a LoRA adapter directory per prompt, or None for the base weights), plus load_weights(named
tensors) for the weight push after an update and sleep()/wake() around the training phase; a backend may also
offer stream() (continuous batching), which rollout() then prefers. The engines live in the library:
acl/engine.py (HFBackend, transformers, any device; make_backend, the one factory) and acl/vllm.py (VLLMBackend,
a colocated vLLM engine). ReplayBackend below replays given texts: an expert's or a saved episode.
"""
import os
from dataclasses import dataclass, field

import torch

from envs.base import UsageError

# The tiny arena's limits per episode and per assistant turn (the rollout defaults; evaluate.py's tiny suite
# and train_seq.py's tiny preset use them too). A by-the-book e-commerce episode runs to ~1,230 tokens (an
# exchange: four tool answers in JSON); a limit of 1,024 cut every exchange and most address episodes
# (tests/test_pretrain.py checks that every clean demonstration fits).
MAX_TOKENS, MAX_TURN_TOKENS = 1536, 256
# This process's rollouts so far, read as differences by the cost table (acl.step.cost_since): episodes, environment
# calls (assistant turns a live environment answered; a saved transcript's replay is none) and policy-sampled tokens
# (an expert's replayed texts are none)
ROLLOUT_COUNTS = {"episodes": 0, "env_calls": 0, "sampled_tokens": 0}



@dataclass
class Generation:
    token_ids: list          # sampled tokens, up to and including the stop token if one was hit
    logprobs: list           # log-prob of each sampled token under the sampling distribution
    stopped: bool            # True if a stop token ended it, False if max_new_tokens did


@dataclass
class Episode:
    task_id: str
    env: str
    split: str
    sample: int                      # index within the task's group (GRPO groups by task_id)
    token_ids: list                  # prompt + every turn, exactly as sampled / rendered
    loss_mask: list                  # 1 on policy-sampled tokens, 0 on prompt, tool and user tokens
    logprobs: list                   # sampling log-prob on sampled tokens, 0.0 elsewhere
    prompt_len: int
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)
    truncated: bool = False
    turns: int = 0
    adapter: str | None = None       # the LoRA adapter it was sampled with (None: the base weights)

    @property
    def n_sampled(self) -> int:
        return sum(self.loss_mask)


class ChatML:
    """The token pieces the loop needs from a ChatML (Qwen-family) chat template: the prompt, the
    text that closes an assistant turn, and the rendering of observation messages (tool results or a
    user reply) followed by the next assistant header. Observations are rendered as the difference
    between two full renderings after a fixed dummy history, so they match the template exactly."""

    def __init__(self, tok):
        self.tok = tok
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        self.stop_ids = [self.eos] + [i for i in [tok.convert_tokens_to_ids("</tool_call>")] if i != tok.unk_token_id and i is not None]
        self._dummy = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "MARK"},
                       {"role": "user", "content": "z"}]
        self._before = self._render(self._dummy)
        i = self._before.index("MARK") + 4
        self.close_text = self._before[i: self._before.index("<|im_start|>", i)]   # e.g. "<|im_end|>\n"
        self.eos_text = tok.convert_ids_to_tokens(self.eos)
        self.header = self.encode(self._render(self._dummy, gen=True)[len(self._before):])  # "<|im_start|>assistant\n"

    def _render(self, messages, tools=None, gen=False):
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)

    def encode(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, messages, tools):
        return self.encode(self._render(messages, tools, gen=True))

    def close(self, ended_with_eos: bool):
        """Tokens that end an assistant turn after what was sampled (mask 0)."""
        text = self.close_text
        if ended_with_eos and text.startswith(self.eos_text):
            text = text[len(self.eos_text):]
        return self.encode(text) if text else []

    def observation(self, messages):
        """Tokens of the observation messages plus the next assistant header (just the header if none)."""
        if not messages:
            return list(self.header)
        before = self._before
        after = self._render(self._dummy + list(messages), gen=True)
        if not after.startswith(before):  # a template that rewrites history: fall back to the messages alone
            after, before = self._render(list(messages), gen=True), ""
        return self.encode(after[len(before):])


class ServiceError(RuntimeError):
    """An outside service failed on too many of one batch's episodes: training on the zero rewards it left would be
    a silent failure."""


def env_calls(calls, workers: int = 1) -> list:
    """[(fn, args), ...] -> [fn(*args), ...] in order: one after another, or with workers > 1 on a thread pool of that
    size (an environment that waits on an outside service, the retriever or the LLM user, sets `workers`), so that a
    turn of 64 episodes waits about one call's latency, not 64. Each call touches its own episode's state only."""
    if workers <= 1 or len(calls) <= 1:
        return [fn(*args) for fn, args in calls]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(workers, len(calls))) as pool:
        return list(pool.map(lambda c: c[0](*c[1]), calls))


def rollout(backend, tok, items, n_samples: int = 1, temperature: float = 1.0, max_turns: int | None = None,
            max_tokens: int = MAX_TOKENS, max_turn_tokens: int = MAX_TURN_TOKENS, seed: int | None = None, adapters=None):
    """Roll out every (env, task) in `items` n_samples times; returns Episodes in items x samples order.
    adapters: None, or a LoRA adapter directory (or None) per item, passed to the backend with each prompt.

    An episode ends when its env says done, or is cut (truncated=True) at max_turns assistant turns
    (default: the env's own limit), at max_tokens tokens in all, or when one turn hits max_turn_tokens
    without a stop token."""
    if seed is not None:
        torch.manual_seed(seed)
    if hasattr(backend, "forget"):   # caches kept from an earlier rollout may hold KV of weights since updated
        backend.forget()
    chat = ChatML(tok)
    workers = max([getattr(env, "workers", 1) for env, _ in items], default=1)
    everything = []
    starts = [(j, env, task, k) for j, (env, task) in enumerate(items) for k in range(n_samples)]
    states = env_calls([(env.reset, (task,)) for _, env, task, _ in starts], workers)
    for (j, env, task, k), state in zip(starts, states):
        ids = chat.prompt(state.messages, task.tools)
        ep = Episode(task.id, task.env, task.split, k, list(ids), [0] * len(ids), [0.0] * len(ids), len(ids))
        ep.adapter = adapters[j] if adapters else None
        everything.append((env, state, ep))
        if len(ids) >= max_tokens:  # no room to answer at all
            state.done = state.truncated = True

    def end_turns(ended):
        """[((env, state, episode), Generation)] whose turn ended -> those that go on: the turn's tokens appended, the
        environments' answers (at once where they wait on an outside service) rendered after them."""
        stepped = []
        for (env, state, ep), g in ended:
            room = max_tokens - len(ep.token_ids)
            toks, lps, stopped = g.token_ids[:room], g.logprobs[:room], g.stopped and len(g.token_ids) <= room
            ep.token_ids += toks
            ep.loss_mask += [1] * len(toks)
            ep.logprobs += lps
            ended_eos = stopped and toks[-1] == chat.eos
            text = tok.decode(toks[:-1] if ended_eos else toks, skip_special_tokens=False)
            if not stopped:  # cut mid-turn: the env still scores what was written, flagged truncated
                state.messages.append({"role": "assistant", "content": text})
                state.turns += 1
                state.done = state.truncated = True
                continue
            stepped.append((env, state, ep, text, ended_eos))
        answers = env_calls([(env.step, (state, text)) for env, state, _, text, _ in stepped], workers)
        still = []
        for (env, state, ep, _, ended_eos), obs in zip(stepped, answers):
            tail = chat.close(ended_eos)
            ep.token_ids += tail
            ep.loss_mask += [0] * len(tail)
            ep.logprobs += [0.0] * len(tail)
            if state.done:
                continue
            obs_ids = chat.observation(obs)
            limit = max_turns if max_turns is not None else env.max_turns
            if state.turns >= limit or len(ep.token_ids) + len(obs_ids) >= max_tokens:
                state.done = state.truncated = True
                continue
            ep.token_ids += obs_ids
            ep.loss_mask += [0] * len(obs_ids)
            ep.logprobs += [0.0] * len(obs_ids)
            still.append((env, state, ep))
        return still

    def budget(ep):
        return min(max_turn_tokens, max_tokens - len(ep.token_ids))

    live = [x for x in everything if not x[1].done]
    if getattr(backend, "reuse_kv", False) and getattr(backend, "stream", None) and not adapters and workers <= 1 and live:
        # continuous batching: an episode's next turn starts as soon as its environment has answered
        def turn_done(ended):
            return [(key[id(ep)], list(ep.token_ids), budget(ep)) for _, _, ep in end_turns([(live[k], g) for k, g in ended])]
        key = {id(ep): k for k, (_, _, ep) in enumerate(live)}
        backend.stream([list(ep.token_ids) for _, _, ep in live], [budget(ep) for _, _, ep in live], temperature,
                       chat.stop_ids, turn_done)
        live = []
    while live:   # turn by turn: every live episode's turn in one call, then every environment's answer
        kw = dict(adapters=[ep.adapter for _, _, ep in live]) if adapters else {}
        gens = backend.generate([ep.token_ids for _, _, ep in live], max(budget(ep) for _, _, ep in live),
                                temperature, chat.stop_ids, **kw)
        live = end_turns(list(zip(live, gens)))
    if hasattr(backend, "forget"):   # the episodes are over: free the caches of their last turns
        backend.forget()
    for env, state, ep in everything:
        ep.reward, ep.metrics = env.score(state)
        ep.messages, ep.truncated, ep.turns = state.messages, state.truncated, state.turns
        ROLLOUT_COUNTS["env_calls"] += 0 if isinstance(env, TranscriptEnv) else ep.turns
        ROLLOUT_COUNTS["sampled_tokens"] += 0 if isinstance(backend, ReplayBackend) else ep.n_sampled
    ROLLOUT_COUNTS["episodes"] += len(everything)
    return [ep for _, _, ep in everything]


# ----------------------------------------------------------------------------- replayed episodes

class ReplayBackend:
    """A backend that 'samples' given assistant texts, one per call: the tokens a policy would have sampled had
    it written exactly them (the text's tokens up to the first stop token, else followed by <|im_end|>), with
    log-prob 0. Run through rollout() with one item, an expert's turns become an Episode with the token ids, the
    loss mask and the chat template of a sampled one (expert_episodes)."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls, self.eos = tok, list(texts), 0, tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, max_new_tokens, temperature, stop_ids, adapters=None):
        assert len(prompts) == 1, "a replay backend drives one episode"
        text = self.texts[self.calls] if self.calls < len(self.texts) else ""
        self.calls += 1
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        cut = next((i + 1 for i, t in enumerate(ids) if t in stop_ids), None)
        ids = ids[:cut] if cut else ids + [self.eos]
        stopped = len(ids) <= max_new_tokens
        ids = ids[:max_new_tokens]
        return [Generation(ids, [0.0] * len(ids), stopped)]

    def sleep(self):
        pass

    def wake(self, tags=None):
        pass


class TranscriptEnv:
    """An environment that answers with a saved transcript's observations: what follows each assistant message
    in `messages` up to the next one. With ReplayBackend it renders a saved episode (a teacher's rollout from
    a file) exactly as the rollout loop renders a live one, without the live environment."""

    def __init__(self, messages, max_turns: int = 1000):
        self.messages, self.max_turns = messages, max_turns

    def reset(self, task):
        from envs.base import EpisodeState
        return EpisodeState(task=task, messages=[dict(m) for m in task.messages])

    def step(self, state, text):
        state.messages.append({"role": "assistant", "content": text})
        state.turns += 1
        turns = [i for i, m in enumerate(self.messages) if m.get("role") == "assistant"]
        i = turns[state.turns - 1] if state.turns <= len(turns) else len(self.messages)
        nxt = turns[state.turns] if state.turns < len(turns) else len(self.messages)
        obs = [dict(m) for m in self.messages[i + 1: nxt]]
        state.messages += obs
        state.done = state.turns >= len(turns)
        return obs

    def score(self, state):
        return 0.0, {}


def expert_episodes(tok, env, tasks, max_tokens: int = MAX_TOKENS, max_turn_tokens: int = MAX_TURN_TOKENS) -> list:
    """The scripted expert's episode of every task that has one (env.expert(task)), rendered through rollout()
    with a ReplayBackend and scored by `env`: Episodes whose loss mask covers exactly the expert's turns. Tasks
    without a script (real data) are left out."""
    out = []
    for task in tasks:
        texts = env.expert(task)
        if texts is not None:
            out += rollout(ReplayBackend(tok, texts), tok, [(env, task)], 1, max_tokens=max_tokens,
                           max_turn_tokens=max_turn_tokens)
    return out


def episode_record(ep, task) -> dict:
    """One line of an episode file (evaluate.py --save-episodes; train_seq.py --expert-data reads them): the
    chat messages with the task's tools, and how the environment scored it."""
    return dict(task_id=ep.task_id, env=ep.env, split=ep.split, sample=ep.sample, messages=ep.messages,
                tools=task.tools, reward=ep.reward, metrics=ep.metrics, truncated=ep.truncated)


def saved_episodes(tok, records, max_tokens: int = MAX_TOKENS, max_turn_tokens: int = MAX_TURN_TOKENS) -> list:
    """Episode records (episode_record's dicts) rendered as Episodes (TranscriptEnv + ReplayBackend), each with
    its saved reward; the opening messages are those before the first assistant message."""
    from envs.base import Task
    out = []
    for r in records:
        msgs = r["messages"]
        first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
        task = Task(id=r.get("task_id", ""), env=r.get("env", ""), split=r.get("split", "train"),
                    messages=msgs[:first], tools=r.get("tools"))
        texts = [m.get("content") or "" for m in msgs[first:] if m.get("role") == "assistant"]
        ep = rollout(ReplayBackend(tok, texts), tok, [(TranscriptEnv(msgs[first:]), task)], 1, max_tokens=max_tokens,
                     max_turn_tokens=max_turn_tokens)[0]
        ep.reward, ep.metrics = float(r.get("reward", 0.0)), dict(r.get("metrics") or {})
        out.append(ep)
    return out


def expert_records(path: str, domain: str) -> list:
    """The episode records of `domain` in the *.jsonl files of directory `path` (evaluate.py --save-episodes'
    format), sorted; UsageError on a missing directory or a malformed line."""
    from envs.base import read_jsonl
    if not os.path.isdir(path):
        raise UsageError(f"--expert-data {path}: not a directory")
    out = []
    for name in sorted(f for f in os.listdir(path) if f.endswith(".jsonl")):
        out += [r for r in read_jsonl(os.path.join(path, name))
                if isinstance(r, dict) and r.get("env") == domain and isinstance(r.get("messages"), list)]
    return out
