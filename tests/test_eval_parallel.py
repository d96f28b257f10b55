"""evaluate.py --devices: checkpoints dealt round-robin to one process per device (here `cpu` entries), each record
written once by its worker, the same scores as one process, the table printed by the launcher after every worker has
ended (one made slow on purpose), and a failed worker stopping the launcher in one line with the others' records
kept for --resume."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import evaluate
from acl.common import save_checkpoint

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--suite", "tiny", "--n", "3", "--domains", "math,if", "--max-turn-tokens", "12", "--max-tokens", "200",
        "--threads", "1"]
NAMES = ("base", "seq/1-math", "seq/2-if")


def checkpoints(micro, runs):
    model, tok = micro
    for k, sub in enumerate(NAMES):   # different weights (the same ones would be scored once)
        m = copy.deepcopy(model)
        with torch.no_grad():
            next(m.parameters()).view(-1)[0] += 0.01 * k
        save_checkpoint(str(runs / sub), m, tok, {"method": "test"})
    return [str(runs / sub) for sub in NAMES]


def run(tmp_path, *args, **env):
    saves = tmp_path / "saves.txt"
    r = subprocess.run([sys.executable, os.path.join("tests", "eval_slow_worker.py"), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                                ACL_TEST_SAVES=str(saves), **env))
    lines = saves.read_text().splitlines() if saves.exists() else []
    saves.unlink(missing_ok=True)
    return r, lines


def scores(path):
    rec = json.load(open(path))
    return {b: (v["per_seed"], v["per_task"], v["metrics"], v.get("gold")) for b, v in rec["benchmarks"].items()}


@pytest.mark.slow
def test_two_workers_a_slow_one_the_same_scores_as_one_process(micro, tmp_path):
    ckpts = checkpoints(micro, tmp_path / "runs" / "tiny")
    one, par = tmp_path / "one", tmp_path / "par"
    r, _ = run(tmp_path, "--ckpt", *ckpts, *FAST, "--out-dir", str(one))
    assert r.returncode == 0, r.stderr[-3000:]
    # worker 0 (base, seq/2-if) is 3 s slower at each save than worker 1 (seq/1-math)
    r, saved = run(tmp_path, "--ckpt", *ckpts, *FAST, "--out-dir", str(par), "--devices", "cpu,cpu", ACL_TEST_SLOW="0")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert f"worker 0 on cpu: {ckpts[0]}, {ckpts[2]}" in out and f"worker 1 on cpu: {ckpts[1]}" in out
    records = [str(par / f"{n.replace('/', '-')}.json") for n in NAMES]
    assert sorted(p for p in saved if p in records) == sorted(records)   # each record written exactly once
    assert saved[-1] == str(par / "seq_matrix.json")                     # the launcher's, after all the records
    for name in NAMES:
        f = f"{name.replace('/', '-')}.json"
        assert scores(par / f) == scores(one / f), name
    # the table and the matrix once, by the launcher, after the slow worker's last record
    assert out.count("| checkpoint | math/test |") == 1 and out.count("sampled score:") == 1
    assert out.index(f"saved {par / 'seq-2-if.json'}") < out.index("| checkpoint | math/test |")
    for name in ("base", "seq-1-math", "seq-2-if"):
        assert f"| {name} | " in out
    assert json.load(open(par / "seq_matrix.json"))["rows"] == ["base", "seq-1-math", "seq-2-if"]


@pytest.mark.slow
def test_a_failed_worker_stops_the_launcher_and_resume_keeps_the_others(micro, tmp_path):
    ckpts = checkpoints(micro, tmp_path / "runs" / "tiny")[:2]
    par = tmp_path / "par"
    args = ["--ckpt", *ckpts, *FAST, "--domains", "math", "--no-gold", "--out-dir", str(par), "--devices", "cpu,cpu"]
    r, saved = run(tmp_path, *args, ACL_TEST_FAIL="1")
    assert r.returncode == 1 and "| checkpoint |" not in r.stdout
    err = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and f"the worker on device cpu ({ckpts[1]}) exited with status 1" in err[0]
    assert saved == [str(par / "base.json")] and os.listdir(par) == ["base.json"]
    r, saved = run(tmp_path, *args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert saved == [str(par / "seq-1-math.json"), str(par / "seq_matrix.json")] and "[base] evaluated before" in r.stdout
    assert "| base | " in r.stdout and "| seq-1-math | " in r.stdout


def test_bad_devices_stop_in_one_line_before_any_work(micro, tmp_path, call):
    ckpts = checkpoints(micro, tmp_path / "runs" / "tiny")[:1]
    for devices, message in (("0", "GPU 0 is not here (0 visible)"), ("cpu,gpu1", "--devices takes GPU indices")):
        if devices == "0" and torch.cuda.is_available():
            continue
        r = call(evaluate.main, ["--ckpt", *ckpts, *FAST, "--devices", devices])
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and message in r.stderr
        assert sorted(os.listdir(tmp_path / "runs" / "tiny")) == ["base", "seq"]


def test_two_workers_each_with_its_own_vllm_engine(micro, tmp_path):
    """--backend vllm under --devices: each worker starts its own engine (no process group between them); greedy
    scores equal one process's, whose engine takes the second checkpoint by a weight push. Needs vllm (.ci/run runs
    it in .venv-vllm)."""
    import pytest
    pytest.importorskip("vllm", reason="vllm is not installed here: bash tests/setup_vllm_cpu.sh")
    ckpts = checkpoints(micro, tmp_path / "runs" / "tiny")[:2]
    args = ["--ckpt", *ckpts, *FAST, "--domains", "math", "--no-gold", "--backend", "vllm", "--temperature", "0"]
    r, _ = run(tmp_path, *args, "--out-dir", str(tmp_path / "one"))
    assert r.returncode == 0, r.stderr[-3000:]
    r, saved = run(tmp_path, *args, "--out-dir", str(tmp_path / "par"), "--devices", "cpu,cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("vllm backend:") == 2 and "| seq-1-math | " in r.stdout
    for f in ("base.json", "seq-1-math.json"):
        assert scores(tmp_path / "par" / f) == scores(tmp_path / "one" / f), f
