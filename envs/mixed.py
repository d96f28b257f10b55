"""Mixed-domain tasks (tiny arena, evaluation only): one episode needs two domains' skills, a search whose answer
feeds an arithmetic step. The study names such requests as an open problem for routed consolidators (MLE picks one
expert per request); they carry no domain tag, so an MLE checkpoint is scored on them with its learned router.

    from envs.mixed import MixedEnv
    env = MixedEnv()
    tasks = env.tasks("test", n=100)      # "How many years before 2030 was Brakholm Labs founded?"

Two kinds, over the search world's organisations (the test sub-world for `test`, the ood one for `ood`; never the
train sub-world, so the years must be searched, not remembered):
  years-before  "How many years before 2030 was {org} founded?"                   -> 2030 - founded
  sum           "What is the sum of the years in which {org1} and {org2} were founded?" -> founded1 + founded2
Protocol and tools are the tiny search task's (same system prompt, the `search` tool, <answer>N</answer>), so only
the arithmetic is new. Reward: exact match of the answer with the number. The scripted expert searches every
organisation, then answers: the gold log-likelihood is defined too.
"""
import random

from envs.base import SPLITS, Task, UsageError, tool_call_text
from envs.search import SEARCH_TOOL, TINY_SYSTEM, SearchEnv, exact_match

REFERENCE_YEAR = 2030
KINDS = ("years-before", "sum")


class MixedEnv(SearchEnv):
    """Search + arithmetic in one episode, on the tiny search world (SearchEnv's tool, turns and scoring loop)."""
    domain = "mixed"

    def __init__(self, seed: int = 0):
        super().__init__(seed=seed)

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list:
        if split not in ("test", "ood"):
            raise UsageError(f"mixed tasks are for evaluation: split test or ood, not {split!r}"
                             if split in SPLITS else f"unknown split {split!r} for mixed")
        orgs = sorted(e["name"] for e in self.world.values() if e["kind"] == "org" and e["pool"] == split)
        rng = random.Random(f"mixed-tasks:{split}:{seed}")
        out = []
        for i in range(300 if n is None else n):
            kind = KINDS[i % len(KINDS)]
            if kind == "years-before":
                org = rng.choice(orgs)
                q, path, answer = (f"How many years before {REFERENCE_YEAR} was {org} founded?", [org],
                                   REFERENCE_YEAR - int(self.world[org]["founded"]))
            else:
                a, b = rng.sample(orgs, 2)
                q, path, answer = (f"What is the sum of the years in which {a} and {b} were founded?", [a, b],
                                   int(self.world[a]["founded"]) + int(self.world[b]["founded"]))
            out.append(Task(id=f"mixed-{split}-{seed}-{i}", env="mixed", split=split,
                            messages=[{"role": "system", "content": TINY_SYSTEM}, {"role": "user", "content": q}],
                            tools=[SEARCH_TOOL], gold={"answers": [str(answer)], "question": q, "path": path,
                                                       "kind": kind}))
        return out

    def score(self, state) -> tuple:
        answer = state.info.get("answer")
        em = exact_match(answer, state.task.gold["answers"]) if answer is not None else 0.0
        return em, {"em": em, "searches": float(state.info.get("searches", 0)), "answered": float(answer is not None)}

    def expert(self, task: Task) -> list | None:
        """Search every organisation on the task's path, then answer with the computed number."""
        return [tool_call_text("search", {"query": name}) for name in task.gold["path"]] + \
            [f"<answer>{task.gold['answers'][0]}</answer>"]
