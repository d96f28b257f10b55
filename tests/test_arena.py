"""arena.sh end to end at toy size (QUICK=1 with ORDERS=1 and MLE_CONTINUAL=1, ~6 min on 2 cores; the slow tier):
killed in the middle of a step and run again, every step runs and connects and the report has every row, column and
finding. (The SEEDS aggregation is tests/test_report.py's, on hand-made records; a killed step's resume is each
script's own test.)"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def arena(runs, **kw):
    # this interpreter, as it is (venv.sh's ACL_PYTHON): the suite's own environment, whatever set it up
    env = dict(os.environ, QUICK="1", RUNS=str(runs), TOKENIZERS_PARALLELISM="false", PROGRESS="4",
               ACL_PYTHON=sys.executable, **kw.pop("env", {}))
    return subprocess.Popen(["bash", "arena.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, **kw)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The QUICK arena, once in the suite: killed while MMOPD trains (lane B, after the merges), then run again with
    the same command to the end."""
    runs = tmp_path_factory.mktemp("arena") / "runs" / "tiny-quick"
    p = arena(runs, env=dict(ORDERS="1", MLE_CONTINUAL="1"))
    t0 = time.time()
    while time.time() - t0 < 600:
        line = p.stdout.readline()
        if "mmopd: started" in line or not line:
            break
    time.sleep(2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    killed = {d for d in ("sdft", "mle", "mmopd") if (runs / d / "acl_meta.json").is_file()}
    assert not (runs / "report.md").exists()
    p = arena(runs, env=dict(ORDERS="1", MLE_CONTINUAL="1"))
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-4000:]
    return runs, out, killed


@pytest.mark.slow
def test_quick_arena_killed_and_resumed_runs_every_step_and_reports(quick):
    runs, out, killed = quick
    assert "mmopd" not in killed   # it was killed before MMOPD finished: the rerun made it
    # finished steps are kept: the sequential stages are not trained again, the evaluations resume
    assert "[seq/4-if] finished before, skipping" in open(runs / "logs" / "seq.log").read()
    steps = {line.split()[0] for line in open(runs / "arena_times.md") if re.match(r"^[a-z-]+ +\d+ s$", line.strip())}
    assert {"seq", "oracles", "analyze-seq", "merge-uniform", "merge-grid", "merge-balanced", "sdft", "mle", "mmopd",
            "analyze", "evaluate-runs", "evaluate-oracles", "evaluate-consolidators", "evaluate-mle-tag", "evaluate-mle-learned",
            "evaluate-mle-request",
            "evaluate-mixed"} <= steps
    text = open(runs / "report.md").read()
    for row in report.ROWS:
        assert f"| {row} |" in text, row
    for col in ("math in", "math ood", "search in", "search ood", "ecommerce in", "ecommerce ood", "if in", "if ood"):
        assert col in text
    found = re.findall(r"^\| (\d+) \| .* \| \*\*(holds|contradicted|not shown|not measurable here)\*\* \|", text, re.M)
    assert [int(i) for i, _ in found] == list(range(1, 11)), found
    assert "total (wall)" in text and "![accuracy after each stage](eval/seq_matrix.png)" in text
    # ORDERS=1: three more curricula, e-commerce last reusing the study's math and search stages, in the report
    assert {f"order-{o}{e}" for o in ("rev", "efirst", "elast") for e in ("", "-evaluate")} <= steps
    elast = open(runs / "logs" / "order-elast.log").read()
    assert "[seq/1-math] the same stage is finished in" in elast and "[seq/2-search] the same stage is finished" in elast
    assert "[seq/3-if] step 1/1" in elast and "copied" not in open(runs / "logs" / "order-rev.log").read()
    assert "## Stage order (beyond the study)" in text and "| if → ecommerce → search → math, 1 seed(s) |" in text
    assert re.search(r"Verdict \(criterion fixed in report.py before the runs\): \*\*(the domain decides|the position "
                     r"decides|neither decides|not measurable here)\*\*", text)
    # MLE_CONTINUAL=1: the continual MLE's directories evaluated on the domains seen, its section and the cost table
    assert {"mle-continual", "evaluate-mle-continual"} <= steps
    assert (runs / "eval" / "mle-continual-4-if-refit.json").is_file()
    assert "## MLE as a continual learner (beyond the study)" in text and "| if arrives | ecommerce |" in text
    assert "## The cost of a new domain (beyond the study)" in text and "| MLE continual + re-fits | " in text
    assert "## Routing without tags (beyond the study)" in text and "| request | ecommerce/ood |" in text
    assert (runs / "eval-mixed" / "mle-request.json").is_file()
    # the lanes' progress: each long step's newest "ETA" line is echoed while it runs
    assert re.search(r"^\[[\d:]+\]   evaluate-runs: saved .* checkpoint \d+/6 \| \d+s elapsed, ETA \d+s$", out, re.M), out


@pytest.mark.parametrize("quick_flag", [None, "0", "1"])
def test_the_default_arena_gets_past_its_settings(quick_flag):
    """The default study (QUICK and RUNS unset) reaches its checks: an unknown ARENA is refused with its line, exit 2,
    before anything is written (a `[ ] &&` that failed under set -e once ended `bash arena.sh` silently, status 1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("QUICK", "RUNS")}
    env.update(ACL_PYTHON=sys.executable, ARENA="nowhere", TOKENIZERS_PARALLELISM="false", **({} if quick_flag is None else {"QUICK": quick_flag}))
    r = subprocess.run(["bash", "arena.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "ARENA=nowhere: tiny or qwen3-8b" in r.stderr, (r.returncode, r.stderr)
    assert not os.path.exists(os.path.join(ROOT, "runs", "nowhere"))


def test_the_full_scale_arena_needs_a_local_base_first(tmp_path):
    """ARENA=qwen3-8b reads the base model from BASE (default runs/qwen3-8b/base), which it never downloads: without it
    the arena stops in one line, naming the download, before anything is written (it stopped days in, at merge.py)."""
    env = dict(os.environ, ARENA="qwen3-8b", RUNS=str(tmp_path / "runs" / "q"))
    r = subprocess.run(["bash", "arena.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no model there; download the base once" in r.stderr, (r.returncode, r.stderr)
    assert r.stderr.strip().count("\n") == 0 and os.listdir(tmp_path) == []


def two_nodes(tmp_path, fail=""):
    """The full-scale arena on two 'nodes' (NODE_RANK 0 and 1, one shared runs/), its torchrun and python replaced by
    stubs that log each call's node, start and end (calls_of reads them); node 0's python steps take 0.4 s; the
    stub fails on the script named `fail`. -> [(returncode, output) of node 0, of node 1]."""
    bin_, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_.mkdir()
    for prog in ("python", "torchrun"):
        stub = bin_ / prog
        stub.write_text(f"""#!/bin/bash
s=$(date +%s.%N)
script=$(for x in "$@"; do case "$x" in *.py) echo "$x"; break;; esac; done)
[ "{prog}" != python ] || sleep 0.4
echo "$NODE_RANK {prog} $script $s $(date +%s.%N)" >> {log}
[ "$script" != "{fail}" ]
""")
        stub.chmod(0o755)
    base = tmp_path / "models" / "Qwen3-8B-Base"   # a base outside runs/: evaluated through the link runs/q/base
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if k not in ("QUICK", "SEEDS", "ACL_PYTHON", "NODE_RANK")}
    env.update(ARENA="qwen3-8b", RUNS=str(tmp_path / "runs" / "q"), BASE=str(base), PATH=f"{bin_}:{env['PATH']}",
               NODE_POLL="0.1", TOKENIZERS_PARALLELISM="false")
    procs = [subprocess.Popen(["bash", "arena.sh"], cwd=ROOT, env=dict(env, NODE_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    return [(p.wait(timeout=120), p.stdout.read()) for p in procs]


def test_two_nodes_share_the_arena_node_0_alone_runs_the_python_steps_and_node_1_waits_for_them(tmp_path):
    """ARENA=qwen3-8b with NODE_RANK 0 and 1 (issue 38): the python steps (analyze, merge, evaluate, report) run on
    node 0 alone; node 1 starts each torchrun step only after node 0 has finished every python step before it (a
    torchrun launched during node 0's hours of evaluation would time out at the rendezvous); node 0 alone writes the
    time table and the report; the base outside runs/ is linked in as runs/q/base, so it is evaluated as `base`."""
    (r0, out0), (r1, out1) = two_nodes(tmp_path)
    assert r0 == 0 and r1 == 0, out0[-2000:] + out1[-2000:]
    py = [c for c in calls_of(tmp_path, 0) if c[1] == "python"]
    assert [c[2] for c in py][-1] == "report.py" and {"analyze.py", "merge.py", "evaluate.py"} <= {c[2] for c in py}
    assert not [c for c in calls_of(tmp_path, 1) if c[1] == "python"]
    assert "node 0's step; node 1 waits for it" in out1 and "node 1: done" in out1
    t0 = [c for c in calls_of(tmp_path, 0) if c[1] == "torchrun"]
    t1 = [c for c in calls_of(tmp_path, 1) if c[1] == "torchrun"]
    assert [c[2] for c in t0] == [c[2] for c in t1] == ["train_seq.py", "train_seq.py", "mmopd.py", "sdft.py", "mle.py"]
    for k, launch in enumerate(t1):   # every python call node 0 made before its k-th torchrun, ended before node 1's
        before = [c for c in py if c[3] < t0[k][3]]
        assert all(c[4] <= launch[3] for c in before), (k, launch, before)
    assert os.path.islink(tmp_path / "runs" / "q" / "base")
    assert os.path.isfile(tmp_path / "runs" / "q" / "arena_times.md")
    assert "seq" in open(tmp_path / "runs" / "q" / "arena_times.txt").read()   # node 0's table; node 1 keeps its own
    assert os.path.isfile(tmp_path / "runs" / "q" / "logs" / "arena_times.node1.txt")


def test_a_python_step_that_fails_on_node_0_stops_node_1(tmp_path):
    (r0, out0), (r1, out1) = two_nodes(tmp_path, fail="analyze.py")
    assert r0 != 0 and r1 != 0 and "analyze-seq failed on node 0: node 1 stops" in out1, out1[-2000:]
    assert not [c for c in calls_of(tmp_path, 1) if c[2] == "sdft.py"]


def calls_of(tmp_path, node):
    """The stubs' calls on one node, in order (a node runs one step at a time): [(node, program, script, start, end)]."""
    return [c for c in (tuple(x if i in (1, 2) else float(x) if i > 2 else int(x) for i, x in enumerate(line.split()))
                        for line in (tmp_path / "calls.log").read_text().splitlines()) if c[0] == node]
