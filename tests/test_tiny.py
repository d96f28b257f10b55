"""envs/tiny.py end to end (micro size, seconds) and its bad-input handling."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "envs.tiny", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))


def test_build_base_end_to_end(tmp_path):
    out = tmp_path / "base"
    r = run("--out", str(out), "--size", "micro", "--steps", "30", "--n-demos", "40", "--vocab-size", "400",
            "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((out / "acl_meta.json").read_text())
    assert meta["method"] == "base" and meta["step"] == 30 and meta["config"]["size"] == "micro"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]  # nothing half-written left
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs import make_env
    from envs.rollout import HFBackend, rollout
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    # digits are single tokens, the tool-call markers are single tokens
    assert len(tok("12345")["input_ids"]) == 5
    assert len(tok("<tool_call></tool_call>")["input_ids"]) == 2
    for d in ("math", "search", "ecommerce", "if"):
        env = make_env(d)
        eps = rollout(HFBackend(model, tok), tok, [(env, t) for t in env.tasks("test", n=2)], n_samples=1,
                      max_tokens=400, max_turn_tokens=24, seed=0)
        assert all(0.0 <= e.reward <= 1.0 for e in eps)


@pytest.mark.parametrize("args,msg", [
    (["--domains", "math,chess"], "unknown domain 'chess'"),
    (["--steps", "0"], "--steps"),
    (["--noise", "1.5"], "--noise"),
])
def test_bad_flags_stop_before_writing(tmp_path, args, msg):
    out = tmp_path / "base"
    r = run("--out", str(out), *args, timeout=120)
    assert r.returncode != 0
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
