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
