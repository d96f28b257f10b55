"""common.py: atomic checkpoints, and FSDP2 under torchrun (2 CPU processes, gloo) matching one process."""
import json
import os
import subprocess
import sys

import pytest
import torch

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_checkpoint_is_atomic(micro, tmp_path):
    model, tok = micro
    out = tmp_path / "ckpt"
    common.save_checkpoint(str(out), model, tok, {"method": "test", "step": 1})
    meta = json.loads((out / "acl_meta.json").read_text())
    assert meta["method"] == "test" and "code_revision" in meta
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()

    class Broken:
        def save_pretrained(self, path, **kw):
            open(os.path.join(path, "partial"), "w").close()
            raise OSError("disk full")
    with pytest.raises(OSError):
        common.save_checkpoint(str(out), Broken(), None, {"method": "broken"})
    assert json.loads((out / "acl_meta.json").read_text())["method"] == "test"  # the old one is intact
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]                               # no temporary left behind


def test_fsdp2_two_cpu_processes_match_one(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    script = os.path.join(ROOT, "tests", "dist_check.py")
    one = subprocess.run([sys.executable, script, str(tmp_path / "one.pt")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          script, str(tmp_path / "two.pt")], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert abs(a["loss"] - b["loss"]) < 1e-5
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.allclose(a["state"][k], b["state"][k], atol=1e-5), k


def test_run_files_belong_to_one_recipe(tmp_path):
    """check_run_files: a resume state saved with another recipe, a finished checkpoint of another recipe, and a
    divergence marker are each refused with one line; the same recipe passes."""
    out = str(tmp_path / "seq" / "1-math")
    state, state_recipe, diverged = common.run_files(out)
    os.makedirs(os.path.dirname(state))
    open(state, "wb").close()
    common.save_json(state_recipe, {"lr": 1.0})
    common.check_run_files(out, {"lr": 1.0})
    with pytest.raises(common.UsageError, match="was saved by a run with another recipe"):
        common.check_run_files(out, {"lr": 2.0})
    os.remove(state_recipe)   # a resume state without its recipe (an older writer) is not trusted either
    with pytest.raises(common.UsageError, match="another recipe"):
        common.check_run_files(out, {"lr": 1.0})
    os.remove(state)
    os.makedirs(out)
    common.write_meta(out, {"method": "seq", "recipe": {"lr": 1.0}})
    with pytest.raises(common.UsageError, match="was made with another recipe"):
        common.check_run_files(out, {"lr": 2.0})
    common.mark_diverged(out, "[seq/1-math] GRPO step 3: non-finite loss nan")
    with pytest.raises(common.UsageError, match="diverged in an earlier run"):
        common.check_run_files(out, {"lr": 1.0})
