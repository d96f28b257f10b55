"""acl/common.py: atomic checkpoints, and FSDP2 under torchrun (2 CPU processes, gloo) matching one process."""
import json
import os
import subprocess
import sys

import pytest
import torch

from acl import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_checkpoint_is_atomic(micro, tmp_path):
    model, tok = micro
    out = tmp_path / "ckpt"
    common.save_checkpoint(str(out), model, tok, {"method": "test", "step": 1})
    meta = json.loads((out / "acl_meta.json").read_text())
    assert meta["method"] == "test" and "code_revision" in meta
    numerics = meta["numerics"]   # what the floating-point path depended on (common.numerics)
    assert numerics["threads"] == torch.get_num_threads() and numerics["device"].startswith(("cpu", "cuda"))
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()

    class Broken:
        def save_pretrained(self, path, **kw):
            open(os.path.join(path, "partial"), "w").close()
            raise OSError("disk full")
    with pytest.raises(OSError):
        common.save_checkpoint(str(out), Broken(), None, {"method": "broken"})
    assert json.loads((out / "acl_meta.json").read_text())["method"] == "test"  # the old one is intact
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]                               # no temporary left behind


def test_atomic_writes_are_flushed_to_disk_before_their_rename(micro, tmp_path, monkeypatch):
    """fsync of every written file and of the directory before the rename, and of the parent after it: a crash leaves
    the old file or the whole new one, never an empty one under the final name."""
    model, tok = micro
    synced, renames = [], []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    monkeypatch.setattr(os, "rename", lambda a, b: renames.append((b, len(synced))) or real_rename(a, b))
    monkeypatch.setattr(os, "replace", lambda a, b: renames.append((b, len(synced))) or real_replace(a, b))
    common.save_checkpoint(str(tmp_path / "ckpt"), model, tok, {"method": "test"})
    (_, n_before), = [r for r in renames if r[0] == str(tmp_path / "ckpt")]
    before = synced[:n_before]
    assert any(p.endswith("model.safetensors") for p in before) and any(p.endswith("acl_meta.json") for p in before)
    assert synced[-1] == str(tmp_path)   # the parent, after the rename
    synced.clear()
    common.save_json(str(tmp_path / "x.json"), {"a": 1})
    assert synced[0].startswith(str(tmp_path / "x.json.tmp-")) and synced[-1] == str(tmp_path)


def test_the_leftover_sweep_removes_only_what_a_dead_writer_of_these_outputs_left(tmp_path, dead_tag):
    """A killed write's temporaries go; a live writer's (another lane of the same arena), another host's (a node
    sharing runs/), another output's and a name that a glob character in --out would have widened to all stay."""
    import socket
    live = f"{socket.gethostname()}-{os.getppid()}"
    d, inrun = tmp_path / "seq", tmp_path / "inrun"
    d.mkdir(), inrun.mkdir()
    gone = [d / f".tmp-x[1]-{dead_tag}-9", d / f".resume-x[1].tmp-{dead_tag}", d / f".resume-x[1].json.tmp-{dead_tag}",
            d / f"x[1].metrics.jsonl.tmp-{dead_tag}", inrun / f"seq-x[1].json.tmp-{dead_tag}"]
    stay = [d / f".tmp-x[1]-{live}-9", d / f".tmp-x[1]-otherhost-{dead_tag.rsplit('-', 1)[1]}-9", d / f".tmp-x1-{dead_tag}-9",
            d / f".tmp-y-{dead_tag}-9", inrun / f"seq-y.json.tmp-{dead_tag}", inrun / f"seq-x[1].json.tmp-{live}"]
    for p in gone + stay:
        p.mkdir() if p.name.startswith(".tmp-") else p.write_text("")
    common.remove_leftovers([str(d / "x[1]")], files=[str(inrun / "seq-x[1].json")])
    assert [p for p in gone if p.exists()] == [] and [p for p in stay if not p.exists()] == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_sharded_resume_state_restarts_on_two_ranks_and_on_one(tmp_path, mode):
    """save_train_state under FSDP2 on 2 ranks writes one DCP shard file per rank (no gather); loading it on 2 ranks
    and in one process restores the same weights, AdamW moments, extra and RNG, and the next step is the saved run's
    own next step. A LoRA run's state holds the adapter's weights only."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    script, state = os.path.join(ROOT, "tests", "dist_resume.py"), str(tmp_path / ".resume-x")
    extra = [] if mode == "full" else ["lora"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script]
    for cmd, out, what in [(torchrun, "saved", "save"), (torchrun, "two", "load"), ([sys.executable, script], "one", "load")]:
        r = subprocess.run([*cmd, state, str(tmp_path / f"{out}.pt"), what, *extra], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        if what == "save":
            assert sorted(os.listdir(state)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"]
            assert json.load(open(state + ".json")) == {"lr": 0.01}
            assert not [f for f in os.listdir(tmp_path) if "tmp" in f]
    from torch.distributed.checkpoint import FileSystemReader
    saved_keys = [k for k in FileSystemReader(state).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert saved_keys and all(("lora_" in k) == (mode == "lora") for k in saved_keys), saved_keys[:3]
    saved = torch.load(tmp_path / "saved.pt")
    for name in ("two", "one"):
        got = torch.load(tmp_path / f"{name}.pt")
        assert got["extra"] == {"step": 1, "cursor": 7} and torch.equal(got["rng"], saved["rng"])
        assert torch.equal(got["m1"], saved["m1"])
        for k in saved["w1"]:
            assert torch.equal(got["w1"][k], saved["w1"][k]), (name, k)
            assert torch.allclose(got["w2"][k], saved["w2"][k], atol=1e-6), (name, k)


def test_save_dtype_bf16_writes_bf16_weights_and_says_so(micro, tmp_path):
    """--save-dtype bf16 (halves a full-scale run's disk): every floating tensor is written in bf16 and config.json's
    dtype says so (vLLM loads it as bf16); loading it in fp32 gives the bf16-rounded weights."""
    model, tok = micro
    out = str(tmp_path / "ckpt")
    common.save_checkpoint(out, model, tok, {"method": "test"}, dtype=torch.bfloat16)
    header, _ = common.read_header(os.path.join(out, "model.safetensors"))
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    loaded, _ = common.load_policy(out, torch.device("cpu"))
    for name, p in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], p.detach().to(torch.bfloat16).float()), name
    assert next(model.parameters()).dtype == torch.float32   # the live model is untouched


def test_the_process_group_gets_the_dist_timeout(monkeypatch):
    """--dist-timeout minutes reach init_process_group (ranks wait at a barrier while rank 0 evaluates)."""
    import datetime
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(common.dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    common.init_dist(90)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(minutes=90)}


@pytest.mark.slow
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
    os.makedirs(state)
    common.save_json(state_recipe, {"lr": 1.0})
    common.check_run_files(out, {"lr": 1.0})
    with pytest.raises(common.UsageError, match="was saved by a run with another recipe"):
        common.check_run_files(out, {"lr": 2.0})
    os.remove(state_recipe)   # a resume state without its recipe (an older writer) is not trusted either
    with pytest.raises(common.UsageError, match="another recipe"):
        common.check_run_files(out, {"lr": 1.0})
    os.rmdir(state)
    os.makedirs(out)
    common.write_meta(out, {"method": "seq", "recipe": {"lr": 1.0}})
    with pytest.raises(common.UsageError, match="was made with another recipe"):
        common.check_run_files(out, {"lr": 2.0})
    common.mark_diverged(out, "[seq/1-math] GRPO step 3: non-finite loss nan")
    with pytest.raises(common.UsageError, match="diverged in an earlier run"):
        common.check_run_files(out, {"lr": 1.0})


def test_metrics_go_to_wandb_too_with_one_run_per_checkpoint(tmp_path, monkeypatch):
    """--wandb PROJECT: the rows of metrics.jsonl also go to W&B (numbers only, nested per-domain rows flattened,
    at their step), offline without a key; a resumed run continues the same W&B run (its id comes from the
    checkpoint path); without the wandb package the flag is refused before any work."""
    import types
    calls = []

    class Run:
        def log(self, row, step):
            calls.append(("log", row, step))

        def finish(self):
            calls.append(("finish",))
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = str(tmp_path / "seq" / "1-math")
    m = common.Metrics(out, 0, wandb="aclarena", config={"lr": 1e-3, "curriculum": ["math"]})
    m.log({"stage": "seq/1-math", "step": 1, "reward": 0.25, "domains": {"math": {"rkl": 0.5}}})
    m.finish()
    init = calls[0][1]
    assert init["project"] == "aclarena" and init["resume"] == "allow" and init["config"]["lr"] == 1e-3
    assert os.environ["WANDB_MODE"] == "offline"
    assert calls[1] == ("log", {"reward": 0.25, "domains/math/rkl": 0.5}, 1) and calls[2] == ("finish",)
    assert [json.loads(x)["step"] for x in open(out + ".metrics.jsonl")] == [1]
    common.Metrics(out, 1, wandb="aclarena")
    assert calls[3][1]["id"] == init["id"]
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(common.UsageError, match="--wandb needs the wandb package"):
        common.check_wandb("aclarena")
    common.check_wandb(None)


def test_run_name():
    assert common.run_name("runs/tiny/seq/1-math") == (os.path.join(ROOT, "runs", "tiny", "eval"), "seq-1-math")
    assert common.run_name("/x/runs/tiny/oracle/math/")[1] == "oracle-math"
    assert common.run_name("/x/runs/a/runs/tiny/base") == ("/x/runs/a/runs/tiny/eval", "base")
    assert common.run_name("/x/ckpts/base") == (None, "base")
