"""The full-scale pieces that run without a GPU: --dry-run's FSDP2 plan and memory estimate on the meta device,
the known configurations, --attn auto, and bench/gpu_step.py's code on a micro model (--smoke)."""
import importlib
import os
import subprocess
import sys

import pytest
import torch

import train_seq
from acl.common import resolve_attn
from acl.scale import KNOWN_CONFIGS, dry_run, init_config, shard_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shard_rows_is_torch_chunk():
    for n in (1, 7, 8, 151936, 4096):
        for world in (1, 2, 3, 8, 16):
            rows = [shard_rows(n, world, r) for r in range(world)]
            assert rows == [c.shape[0] for c in torch.empty(n).chunk(world)] + [0] * (world - len(torch.empty(n).chunk(world)))
            assert sum(rows) == n


def test_dry_run_qwen3_8b(tmp_path, capsys):
    a = train_seq.check_args(train_seq.get_args(["--preset", "qwen3-8b", "--dry-run", "--world-size", "16",
                                                 "--runs", str(tmp_path / "runs")]))
    out = dry_run(a, a.init, 16, a.micro_batch, a.max_tokens)
    text = capsys.readouterr().out
    assert out["n_params"] == 8_190_735_360                  # Qwen3-8B: 8.19B with its untied output head
    assert sum(out["per_rank"]) == out["n_params"]          # the shards cover the model exactly once
    assert max(out["per_rank"]) - min(out["per_rank"]) < out["n_params"] / 16 * 0.01
    assert out["memory"]["weights+grads+adam (fp32, sharded)"] == 16 * max(out["per_rank"])
    assert out["fits"] and "fits in a 141 GiB GPU" in text
    # the wake: the sharded state and vLLM's bf16 weights (2 bytes a parameter) plus the largest gathered parameter
    state = out["memory"]["weights+grads+adam (fp32, sharded)"] + out["memory"]["reference model"]
    assert state + 2 * out["n_params"] < out["wake"] < state + 2 * out["n_params"] + 4 * 151_936 * 4096 + 1
    assert out["peak"] == max(out["total"], out["wake"], out["generating"]) and "peak 78.1 GiB at generation" in text
    assert "parameters per rank" in text and "resolved config" in text
    assert not os.path.exists(tmp_path / "runs")            # nothing written, nothing downloaded


def test_dry_run_scales_with_world_size_and_offload(tmp_path):
    base = ["--preset", "qwen3-8b", "--dry-run", "--runs", str(tmp_path)]
    a8 = train_seq.check_args(train_seq.get_args(base + ["--world-size", "8"]))
    a64 = train_seq.check_args(train_seq.get_args(base + ["--world-size", "64"]))
    m8, m64 = dry_run(a8, a8.init, 8, 4, 8192), dry_run(a64, a64.init, 64, 4, 8192)
    assert max(m8["per_rank"]) > 7 * max(m64["per_rank"])
    off = train_seq.check_args(train_seq.get_args(base + ["--world-size", "8", "--cpu-offload"]))
    assert dry_run(off, off.init, 8, 4, 8192)["memory"]["weights+grads+adam (fp32, sharded)"] == 0
    small = dry_run(a8, a8.init, 8, 1, 8192)   # a smaller micro-batch shrinks the activations; the logits are one
    key = "logits (one 4,096-token chunk, + grad, fp32 work)"   # chunk of the fused head's whatever the micro-batch
    assert small["memory"]["activations"] < m8["memory"]["activations"]
    assert small["memory"][key] == m8["memory"][key] == 4096 * 151936 * (2 * 2 + 10)


def test_dry_run_command_line_on_a_local_config(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    from transformers import Qwen3Config
    Qwen3Config(**KNOWN_CONFIGS["Qwen/Qwen3-1.7B"]).save_pretrained(ck)   # a local config.json is read as is
    r = subprocess.run([sys.executable, "train_seq.py", "--init", str(ck), "--dry-run", "--world-size", "2",
                        "--runs", str(tmp_path / "runs")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "on 2 ranks" in r.stdout and "1.721B parameters" in r.stdout   # Qwen3-1.7B, tied embeddings
    assert not os.path.exists(tmp_path / "runs")
    bad = subprocess.run([sys.executable, "train_seq.py", "--init", "nobody/no-such-model", "--dry-run", "--world-size", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1].startswith("error: no config for")


def test_known_configs_and_attn():
    assert init_config("Qwen/Qwen3-8B-Base").num_hidden_layers == 36
    with pytest.raises(ValueError):
        init_config("nobody/no-such-model")
    assert resolve_attn("eager") == "eager"
    assert resolve_attn("auto") in ("sdpa", "flash_attention_2")
    if not torch.cuda.is_available():
        assert resolve_attn("auto") == "sdpa"


@pytest.mark.slow
def test_gpu_step_smoke():
    r = subprocess.run([sys.executable, "bench/gpu_step.py", "--smoke"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| training tokens/s |" in r.stdout and "| MFU (vs 989 TFLOP/s nominal bf16 dense) |" in r.stdout
    assert "| hf generation:" in r.stdout


@pytest.mark.parametrize("script", ["train_seq.py", "mmopd.py", "sdft.py"])
def test_the_full_scale_presets_refuse_the_tiny_worlds(script, tmp_path, call):
    """--preset qwen3-8b without a domain's data would train on that domain's tiny world: refused in one line that
    names every missing flag, before anything is written (a dry run needs no data)."""
    ck = tmp_path / "ck"
    from transformers import Qwen3Config
    Qwen3Config(**dict(KNOWN_CONFIGS["Qwen/Qwen3-1.7B"], num_hidden_layers=1)).save_pretrained(ck)
    args = ["--preset", "qwen3-8b", "--runs", str(tmp_path / "runs"), "--domains" if script != "train_seq.py" else
            "--curriculum", "search,ecommerce", "--search-data", str(tmp_path)]
    if script == "sdft.py":   # sdft checks its student first; a config-only directory is enough to get past it
        (ck / "model.safetensors").write_bytes(b"")
        args += ["--student", str(ck)]
    r = call(importlib.import_module(script[:-3]).main, args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    for flag in ("--search-corpus or --retriever-url (search)", "--tau-data (ecommerce)", "--user-url (ecommerce)",
                 "--user-model (ecommerce)"):
        assert flag in r.stderr, r.stderr
    assert "--search-data" not in r.stderr and not os.path.exists(tmp_path / "runs")


def test_a_user_endpoint_without_a_model_name_is_refused(tmp_path, call):
    """A served model answers an unknown name with an error, which would end every e-commerce episode in a user error
    (reward 0): --user-url needs --user-model, in every script that takes it."""
    for cmd in (["train_seq.py", "--curriculum", "ecommerce", "--init", os.path.join(ROOT, "assets", "tiny-base"), "--runs",
                 str(tmp_path / "runs")],
                ["evaluate.py", "--suite", "full", "--ckpt", os.path.join(ROOT, "assets", "tiny-base"), "--benchmarks",
                 "tau-retail", "--out-dir", str(tmp_path / "eval")]):
        r = call(importlib.import_module(cmd[0][:-3]).main, [*cmd[1:], "--user-url", "http://127.0.0.1:9/v1"])
        assert r.returncode == 2 and "--user-url needs --user-model" in r.stderr, (cmd, r.stderr[-2000:])
