"""Nothing lost, nothing half-done: every script that writes refuses a dangerous target before any work, with the
disk unchanged; bad values stop with one line and exit status 2 before a model is loaded; the environments are
bounded in time and output on what a model writes."""
import os
import sys
import threading
import time

import pytest
import torch

import analyze
import evaluate
import merge
from acl.common import Parser, save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(root) -> dict:
    """{relative path: (size, mtime_ns)} of every file, and every directory's path, under root: 'nothing changed on
    disk' (a directory's own mtime is left out: a temporary entry made and removed inside it moves it)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root)] = "dir"
        for name in files:
            st = os.lstat(os.path.join(d, name))
            out[os.path.relpath(os.path.join(d, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def refused(fn, capsys, message):
    """fn() stops with exit status 2 and one line on stderr that contains `message`."""
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.fixture
def tree(micro, tmp_path, monkeypatch):
    """A run directory with a base, two stages, an older merge, a foreign directory and a file; cwd = tmp_path."""
    model, tok = micro
    runs = tmp_path / "runs"
    for name, method in (("base", "base"), ("s1", "seq"), ("s2", "seq"), ("merge/old", "merge")):
        save_checkpoint(str(runs / name), model, tok, {"method": method})
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("weeks of work")
    (tmp_path / "notes.txt").write_text("do not lose")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("out, message", [
    (".", "current directory"), ("..", "current directory"), ("runs/base", "an input"), ("runs/s1", "an input"),
    ("runs", "an input"), ("notes.txt", "a file"), ("mine", "did not write"), ("runs/merge/old", "--overwrite"),
])
def test_merge_out_is_refused_with_nothing_changed(tree, capsys, out, message):
    before = snapshot(tree)
    args = ["--base", "runs/base", "--models", "runs/s1", "runs/s2", "--weights", "0.5", "0.5", "--out", out]
    refused(lambda: merge.main(args), capsys, message)
    assert snapshot(tree) == before


def test_merge_replaces_its_own_older_output_only_with_overwrite(tree, capsys):
    args = ["--base", "runs/base", "--models", "runs/s1", "runs/s2", "--weights", "0.5", "0.5", "--out", "runs/merge/old"]
    merge.main(args + ["--overwrite"])
    assert "merged 2 models" in capsys.readouterr().out
    before = snapshot(tree)   # a seq checkpoint is another kind: never replaced, --overwrite or not
    refused(lambda: merge.main(args[:-1] + ["runs/s2", "--overwrite"]), capsys, "an input")
    save_checkpoint(str(tree / "runs" / "other"), *_micro_pair(), {"method": "seq"})
    capsys.readouterr()
    before = snapshot(tree)
    refused(lambda: merge.main(args[:-1] + ["runs/other", "--overwrite"]), capsys, "not a 'merge' one")
    assert snapshot(tree) == before


def _micro_pair():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=8, intermediate_size=32)), None


@pytest.mark.parametrize("bad, message", [
    (["--weights", "nan", "0.5"], "finite"), (["--weights", "0.5", "0.5", "--shard-gb", "0"], "--shard-gb"),
    (["--weights", "0.5", "0.5", "--threads", "-1"], "--threads"),
])
def test_merge_bad_values(tree, capsys, bad, message):
    before = snapshot(tree)
    refused(lambda: merge.main(["--base", "runs/base", "--models", "runs/s1", "runs/s2", *bad, "--out", "runs/m"]),
            capsys, message)
    assert snapshot(tree) == before


@pytest.mark.parametrize("out, message", [
    (".", "current directory"), ("notes.txt", "a file"), ("mine", "did not write"), ("runs/s1", "not a 'base' one"),
    ("runs/base", "--overwrite"),
])
def test_tiny_base_out_is_refused_before_the_build(tree, capsys, monkeypatch, out, message):
    import pretrain
    before = snapshot(tree)
    monkeypatch.setattr(sys, "argv", ["pretrain.py", "--out", out])
    t0 = time.time()
    refused(pretrain.main, capsys, message)
    assert time.time() - t0 < 5 and snapshot(tree) == before


@pytest.mark.parametrize("bad, message", [
    (["--batch-tokens", "0"], "--batch-tokens"), (["--max-len", "0"], "--max-len"), (["--threads", "-1"], "--threads"),
    (["--lr", "-1e-3"], "--lr > 0"),
])
def test_tiny_base_bad_values_before_the_build(tree, capsys, monkeypatch, bad, message):
    import pretrain
    monkeypatch.setattr(sys, "argv", ["pretrain.py", "--out", "runs/new", *bad])
    t0 = time.time()
    refused(pretrain.main, capsys, message)
    assert time.time() - t0 < 5 and not (tree / "runs" / "new").exists()


@pytest.mark.parametrize("bad, message", [
    (["--out-dir", "notes.txt"], "a file"), (["--out-dir", "."], "current directory"),
    (["--max-tokens", "100", "--max-turn-tokens", "200"], "must not exceed"), (["--n", "0"], "--n must be >= 1"),
    (["--threads", "-1"], "--threads"),
])
def test_evaluate_refuses_before_any_rollout(tree, capsys, monkeypatch, bad, message):
    before = snapshot(tree)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "--ckpt", "runs/s1", *bad])
    refused(evaluate.main, capsys, message)
    assert snapshot(tree) == before


@pytest.mark.parametrize("bad, message", [
    (["--out", "notes.txt"], "a file"), (["--entropy-threshold", "-1"], "--entropy-threshold"),
    (["--n", "0"], "--n"), (["--threads", "-1"], "--threads"), (["--domain", "maths"], "not a domain"),
])
def test_analyze_refuses_before_any_work(tree, capsys, bad, message):
    before = snapshot(tree)
    args = ["--base", "runs/base", "--ckpts", "runs/s1", "runs/s2", "--ref", "runs/s1", "--out", "runs/an", "--domain",
            "math", *bad]
    refused(lambda: analyze.main(args), capsys, message)
    assert snapshot(tree) == before


def test_analyze_domain_flag_wins_over_the_reference_metadata(tree):
    from acl.common import write_meta
    write_meta(str(tree / "runs" / "s1"), {"method": "seq", "stage": "math"})
    a = analyze.parse_args(["--base", "runs/base", "--ckpts", "runs/s1", "runs/s2", "--ref", "runs/s1", "--domain", "if",
                            "--out", "runs/an"])
    assert a.domain == "if"
    a = analyze.parse_args(["--base", "runs/base", "--ckpts", "runs/s1", "runs/s2", "--ref", "runs/s1", "--out", "runs/an"])
    assert a.domain == "math"


@pytest.mark.parametrize("bad, message", [
    (["--splits", "tset"], "--splits"), (["--n", "-1"], "--n"), (["--samples", "0"], "--samples"),
    (["--batch", "0"], "--batch"), (["--max-tokens", "10", "--max-turn-tokens", "20"], "--max-turn-tokens"),
])
def test_rollout_cli_bad_values(tree, capsys, monkeypatch, bad, message):
    import acl.engine
    monkeypatch.setattr(sys, "argv", ["acl.engine", "--ckpt", "runs/s1", *bad])
    refused(acl.engine.main, capsys, message)


def test_a_negative_number_after_a_flag_is_its_value(capsys):
    p = Parser()
    p.add_argument("--lr", type=float)
    p.add_argument("--weights", nargs="+", type=float)
    assert p.parse_args(["--lr", "-1e-3", "--weights", "0.5", "-2"]).lr == -1e-3
    assert p.parse_args(["--lr", "-.5"]).lr == -0.5
    refused(lambda: p.parse_args(["--nope"]), capsys, "unrecognized arguments")


# ----------------------------------------------------------------------------- environments, bounded

def test_search_answer_extraction_is_linear():
    from envs.search import last_answer
    assert last_answer("x <answer>a</answer> y <answer> b </answer>") == "b"
    assert last_answer("<answer>no end") is None and last_answer("no answer</answer>") is None
    text = "<answer>" * 12500 + "x" * 100
    t0 = time.time()
    assert last_answer(text) is None and last_answer(text + "</answer>") == "x" * 100
    assert time.time() - t0 < 0.05


def test_a_huge_tool_name_gives_a_short_observation():
    from envs import make_env
    from envs.base import tool_call_text
    for domain in ("search", "ecommerce"):
        env = make_env(domain)
        state = env.reset(env.tasks("test", n=1)[0])
        obs = env.step(state, tool_call_text("x" * 100_000, {}))
        assert obs and all(len(m["content"]) < 500 and len(m.get("name", "")) <= 64 for m in obs), domain


def test_math_grading_is_bounded_off_the_main_thread(monkeypatch):
    """A pathological answer (math-verify takes ~35 s on it) graded in a worker thread, where math-verify's own timer
    cannot run: scored 0 within the time limit, counted; the next grade works."""
    import envs.math as M
    monkeypatch.setattr(M, "GRADE_TIMEOUT", 1)
    gold = {"kind": "math_verify", "answer": "3"}
    before, out = M.GRADE_TIMEOUTS["count"], []
    t0 = time.time()
    th = threading.Thread(target=lambda: out.extend([M.grade("\\boxed{2^{2^{2^{5}}}}", gold),
                                                     M.grade("\\boxed{3}", gold)]))
    th.start()
    th.join(60)
    assert out == [0.0, 1.0] and M.GRADE_TIMEOUTS["count"] == before + 1 and time.time() - t0 < 20


def test_a_full_disk_is_one_line_and_leaves_no_partial_output(tree, capsys, monkeypatch):
    def full(base, models, weights, method, out_dir, *a):
        with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
            f.write(b"x" * 1000)   # half a file, then the disk is full
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(merge, "stream_merge", full)
    before = snapshot(tree)
    with pytest.raises(SystemExit) as e:
        merge.main(["--base", "runs/base", "--models", "runs/s1", "runs/s2", "--weights", "0.5", "0.5", "--out", "runs/m"])
    assert str(e.value.code).startswith("error: writing runs/m failed: [Errno 28] No space left on device")
    assert snapshot(tree) == before   # the temporary directory went with the failure


def test_a_user_model_that_starts_failing_mid_run_stops_the_run_with_the_count(tmp_path, tiny_agent):
    """The LLM user answers the start-up probe, then fails every request: the first GRPO batch's e-commerce
    episodes all end in a user error, and the run stops with the count instead of training on their zero rewards."""
    import subprocess

    from fake_http import JSONServer
    init = tiny_agent   # it talks to the user (the base never makes a tool call; a micro model's turns hit the limit)
    calls = []

    def respond(path, headers, body):
        calls.append(body)
        if len(calls) == 1:   # the probe
            return 200, {"choices": [{"message": {"role": "assistant", "content": "ok"}}]}
        return 500, None
    with JSONServer(respond) as user:
        r = subprocess.run([sys.executable, "train_seq.py", "--curriculum", "ecommerce", "--init", init, "--runs",
                            str(tmp_path / "runs"), "--steps", "ecommerce=1", "--prompts", "ecommerce=2", "--group", "2",
                            "--rft-prompts", "0", "--eval-n", "0", "--threads", "1",
                            "--user-url", user.url + "/v1", "--user-model", "m"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "of 4 e-commerce episodes ended in a user-model error (more than --max-user-errors 0.25)" in r.stderr
    assert "stopped before training on it" in r.stderr and len(calls) > 1
    assert not os.path.exists(tmp_path / "runs" / "seq" / "1-ecommerce")


def test_check_install_names_what_does_not_work(monkeypatch, capsys):
    """`train_seq.py --check-install` prints the versions and exits 0 on this machine's install; a vllm
    older than the backend supports and a flash-attn that does not import (a wheel built for another torch) are each
    a problem line, and exit status 1."""
    import importlib.metadata as md
    import types

    import train_seq
    with pytest.raises(SystemExit) as e:
        train_seq.main(["--check-install"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "install ok" in out and f"torch {torch.__version__}" in out and "transformers" in out
    real = md.version
    fake = {"vllm": "0.9.0", "flash-attn": "2.8.3.post2"}
    monkeypatch.setattr(md, "version", lambda name: fake[name] if name in fake else real(name))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.9.0"))
    monkeypatch.setitem(sys.modules, "flash_attn", None)   # import flash_attn raises ImportError
    with pytest.raises(SystemExit) as e:
        train_seq.main(["--check-install"])
    out = capsys.readouterr().out
    assert e.value.code == 1
    assert "vllm          0.9.0: NOT usable (RuntimeError: vllm 0.9.0 is too old" in out
    assert "flash-attn    2.8.3.post2: does NOT import" in out
    assert out.count("problem: ") == 2 and "install ok" not in out
    # GPUs torch cannot use (a CPU wheel, or a driver too old for its CUDA), and a package that is installed but does
    # not import (peft here): each a problem
    import acl.scale
    monkeypatch.setattr(md, "version", real)
    monkeypatch.delitem(sys.modules, "vllm")
    monkeypatch.setattr(acl.scale, "nvidia_devices", lambda: ["nvidia0", "nvidia1"])
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(SystemExit) as e:
        train_seq.main(["--check-install"])
    out = capsys.readouterr().out
    assert e.value.code == 1 and "NVIDIA GPUs (nvidia0, nvidia1) but torch" in out and "driver >= 580" in out
    assert "peft" in out and "does NOT import" in out and out.count("problem: ") == 2
