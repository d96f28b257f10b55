"""The e-commerce per-turn probe: what a tiny checkpoint can do, turn by turn (the reward only says whether a
whole episode succeeded).

    python bench/ecommerce_turns.py runs/tiny/base --n 100     # per-turn exact match, greedy and sampled;
                                                               # then success per task kind, sampled (~2 min)
    python bench/ecommerce_turns.py CKPT --n 80 --split val

1. Per expert turn (turn_accuracy): the by-the-book episodes of --n tiny ecommerce tasks of --split
   (envs.ecommerce.expert_turns, played through the environment) are teacher-forced: for every assistant turn,
   given the expert's exact prefix, does the checkpoint write the expert's turn exactly (after stripping
   surrounding whitespace)? Once greedy, once sampled at temperature 1 from the full distribution. Turns are
   grouped by kind: ask_identity, call:<tool>, confirm, answer.
2. Per task kind (kind_success): one sampled (T=1) episode per task through envs.rollout.rollout (its default
   token limits): success and tool calls per episode, by task kind (cancel, address, return, exchange,
   amount); evaluate.py reports only the mean over kinds.

Tiny arena only (the tasks carry the expert's turns): the scripted user, the hf backend, the checkpoint's
dtype on the CPU.
"""
import argparse
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from acl.common import Parser, is_checkpoint, usage_exit  # noqa: E402
from envs.base import parse_tool_calls  # noqa: E402
from envs.ecommerce import EcommerceEnv, expert_turns, play  # noqa: E402


def turn_kind(messages, j) -> str:
    """The kind of the expert's assistant turn messages[j]: call:<tool>, confirm, ask_identity or answer."""
    text = messages[j]["content"]
    calls, _ = parse_tool_calls(text)
    if calls:
        return "call:" + calls[0][0]
    if "Please confirm (yes/no)" in text:
        return "confirm"
    return "ask_identity" if not any(m["role"] == "assistant" for m in messages[:j]) else "answer"


def expert_turn_prompts(env, chatml, tasks) -> list:
    """Every assistant turn of the by-the-book episodes of `tasks`: [(kind, prompt ids of the expert's exact
    prefix, the expert's text)]."""
    items = []
    for task in tasks:
        messages = play(env, task, expert_turns(task)).messages
        items += [(turn_kind(messages, j), chatml.prompt(messages[:j], task.tools), m["content"])
                  for j, m in enumerate(messages) if m["role"] == "assistant"]
    return items


def turn_accuracy(backend, tok, env, tasks, temperature=0.0, seed=0, max_new_tokens=160):
    """Teacher-forced on by-the-book tiny episodes: for every assistant turn, given the expert's exact prefix,
    does the policy write the expert's turn exactly? -> {kind: [turns, exact]} (sampled when temperature > 0)."""
    import torch

    from envs.rollout import ChatML
    cm = ChatML(tok)
    items = expert_turn_prompts(env, cm, tasks)
    torch.manual_seed(seed)
    gens = backend.generate([p for _, p, _ in items], max_new_tokens, temperature, cm.stop_ids)
    out = {}
    for (kind, _, want), g in zip(items, gens):
        text = tok.decode([t for t in g.token_ids if t != cm.eos], skip_special_tokens=False)
        row = out.setdefault(kind, [0, 0])
        row[0] += 1
        row[1] += text.strip() == want.strip()
    return out


def kind_success(backend, tok, env, tasks, seed=0):
    """One sampled (T=1) episode per task -> {task kind: [episodes, successes, tool calls]}: which kinds of
    tiny task a checkpoint finishes (evaluate.py gives only the mean over kinds)."""
    from envs.rollout import rollout
    kinds = {t.id: t.gold["kind"] for t in tasks}
    out = {}
    for e in rollout(backend, tok, [(env, t) for t in tasks], 1, 1.0, seed=seed):
        row = out.setdefault(kinds[e.task_id], [0, 0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + e.reward, row[2] + e.metrics["tool_calls"]
    return out


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint to teacher-force on expert episodes")
    p.add_argument("--n", type=int, default=80, help="tiny tasks")
    p.add_argument("--split", default="test", choices=["train", "val", "test"])
    a = p.parse_args(argv)
    if not is_checkpoint(a.ckpt):
        usage_exit(f"no checkpoint at {a.ckpt}")
    if a.n < 1:
        usage_exit("need --n >= 1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from acl.engine import HFBackend
    tok = AutoTokenizer.from_pretrained(a.ckpt)
    backend = HFBackend(AutoModelForCausalLM.from_pretrained(a.ckpt), tok)   # from_pretrained: inference mode
    env = EcommerceEnv()
    tasks = env.tasks(a.split, n=a.n)
    greedy, sampled = (turn_accuracy(backend, tok, env, tasks, t) for t in (0.0, 1.0))
    print("| expert turn | turns | greedy exact | sampled (T=1) exact |\n|---|---|---|---|")
    for kind in sorted(greedy):
        n, g = greedy[kind]
        print(f"| {kind} | {n} | {g / n:.2f} | {sampled[kind][1] / n:.2f} |")
    print("\n| task kind | episodes | success (T=1) | tool calls per episode |\n|---|---|---|---|")
    for kind, (n, ok, calls) in sorted(kind_success(backend, tok, env, tasks).items()):
        print(f"| {kind} | {n} | {ok / n:.2f} | {calls / n:.1f} |")


if __name__ == "__main__":
    main()
