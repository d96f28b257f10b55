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
