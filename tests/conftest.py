"""Shared fixtures: a micro tokenizer + randomly initialised micro Qwen3 built in a second or two."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def micro():
    """(model, tokenizer): a micro Qwen3 with the tiny chat template, untrained."""
    import torch
    from transformers import Qwen3ForCausalLM

    from pretrain import model_config, train_tokenizer
    texts = ["What is 12+7? \\boxed{19}", "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"x\"}}</tool_call>",
             "Tomas Velder was born in Brimsk. <answer>Brimsk</answer>"] * 20
    tok = train_tokenizer(texts, vocab_size=400)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(model_config(tok, "micro", 512)).eval()
    return model, tok


@pytest.fixture
def dead_tag():
    """tmp_tag() of a process of this host that has exited: what a killed writer's temporary names carry."""
    import socket
    import subprocess
    p = subprocess.Popen(["true"])
    p.wait()
    return f"{socket.gethostname()}-{p.pid}"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def call(capsys, monkeypatch):
    """call(main, args) runs a script's main in this process as `python script.py args` runs it (from the repository
    root; main() without an argv parameter reads sys.argv) -> an object with returncode, stdout and stderr, as
    subprocess.run gives. For the one-line refusals: a fresh Python costs 3-5 s (torch and transformers imports),
    this costs nothing. torch's thread count is restored after (a script's --threads sets it)."""
    import inspect
    import types

    import torch

    def go(main, args):
        threads = torch.get_num_threads()
        monkeypatch.chdir(ROOT)
        capsys.readouterr()
        args = [str(x) for x in args]
        code = 0
        try:
            if inspect.signature(main).parameters:
                main(args)
            else:
                monkeypatch.setattr(sys, "argv", [main.__module__ + ".py", *args])
                main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            torch.set_num_threads(threads)
        out = capsys.readouterr()
        return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
    return go


# The committed base knows each domain in plain text but has never seen the agent protocol (tool calls, \boxed{},
# <answer>): every stage's cold start teaches it. Tests that need a policy which already speaks the protocol (multi-turn
# e-commerce episodes, a boxed answer that ends a turn, some full rewards to filter) start from this one instead: the
# base after a small cold start on the scripted expert's episodes of every domain. Built once and kept in
# pytest's cache under the hash of the base's weights and of this recipe (~30 s to build), so the hourly run
# reuses it.
AGENT_RECIPE = dict(tasks={"math": 128, "search": 384, "ecommerce": 64, "if": 128}, epochs=2, batch=16, lr=1e-3, seed=0)


def build_tiny_agent(out: str):
    """tiny-base + AGENT_RECIPE's SFT on the scripted expert's episodes of every domain (mixed), saved at `out`."""
    import torch

    from acl.common import load_policy, save_checkpoint, seed_all
    from acl.step import sft_epochs
    from envs import make_env
    from envs.rollout import expert_episodes
    r = AGENT_RECIPE
    seed_all(r["seed"])
    model, tok = load_policy(os.path.join(ROOT, "assets", "tiny-base"), "cpu")
    eps = []
    for d, n in r["tasks"].items():
        env = make_env(d)
        eps += expert_episodes(tok, env, env.tasks("train", n=n, seed=r["seed"]))
    opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    sft_epochs(model, opt, eps, epochs=r["epochs"], batch=r["batch"], micro_batch=r["batch"], micro_tokens=4096,
               grad_clip=1.0, seed=r["seed"], label="tiny-agent")
    save_checkpoint(out, model.eval(), tok, dict(kind="tiny-agent", recipe=r))


@pytest.fixture(scope="session")
def tiny_agent(request):
    """The directory of the tiny agent (build_tiny_agent), from pytest's cache when the base and recipe match."""
    import hashlib
    import inspect
    import json
    h = hashlib.sha256(json.dumps(AGENT_RECIPE, sort_keys=True).encode() + inspect.getsource(build_tiny_agent).encode())
    with open(os.path.join(ROOT, "assets", "tiny-base", "model.safetensors"), "rb") as f:
        h.update(f.read())
    cache = request.config.cache.mkdir("tiny-agent")
    out = os.path.join(cache, h.hexdigest()[:16])
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        build_tiny_agent(out)     # save_checkpoint writes atomically: a killed build leaves no half checkpoint here
    return out
