"""The gold-replay check of a tau2/tau3 telecom data directory: every task set up, its gold actions run (the agent's
through the environment, the user's on the phone, synced after each) and scored, and once more with no action at
all. A check of a data directory and of envs/tau_telecom.py's port of tau2's telecom domain (docs/full-scale.md has
the figures on tau2-bench's own files).

    python bench/tau_gold_replay.py data/tau2/domains/telecom small   # tau3's 20 small tasks: 20 solved by gold, 0 by nothing
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from acl.common import usage_exit  # noqa: E402
from envs.base import UsageError  # noqa: E402
from envs.ecommerce import EcommerceEnv  # noqa: E402
from envs.tau_store import run_tool, sync  # noqa: E402


def gold_check(data_dir: str, split: str) -> tuple:
    """(tasks, solved by replaying their gold actions, solved by doing nothing) for a telecom directory: every task
    set up, then each task's gold actions run (the agent's through the environment, the user's on the phone, synced
    after each) and scored, and once more with no action. A check of a data directory and of this port."""
    env = EcommerceEnv(data=data_dir, user_url="http://127.0.0.1:9/v1", user_model="none")   # the user never speaks
    env._chat = lambda chat, max_tokens=None, tools=None: ("My phone has a problem.", [])
    tasks, solved = env.tasks(split), {"gold": 0.0, "nothing": 0.0}
    for run in solved:
        for task in tasks:
            state = env.reset(task)
            info = state.info
            for a in task.gold["actions"] if run == "gold" else []:
                if a["requestor"] == "user":
                    run_tool(info["world"] + "_user", info["user_db"], a["name"], a["arguments"])
                    sync(info["world"], info["db"], info["user_db"])
                    info["calls"].append((a["name"], a["arguments"]))
                else:
                    env._call(state, a["name"], a["arguments"])
            info["ended"], state.done = info["ended"] or "user_stop", True
            solved[run] += env.score(state)[0]
    return len(tasks), solved["gold"], solved["nothing"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not 1 <= len(argv) <= 2:
            raise UsageError("usage: python bench/tau_gold_replay.py DIR [SPLIT]")
        n, gold, nothing = gold_check(argv[0], argv[1] if len(argv) > 1 else "base")
    except UsageError as e:
        usage_exit(e)
    print(f"{n} tasks: gold actions replayed solve {gold:.0f}, doing nothing solves {nothing:.0f}")


if __name__ == "__main__":
    main()
