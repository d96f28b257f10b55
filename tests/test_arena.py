"""arena.sh end to end at toy size (QUICK=1, ~3 min on 2 cores): every step runs and connects, the report has every
row, column and finding; killed in the middle of a step and run again, it ends with the same report numbers."""
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


def numbers(text: str) -> list:
    """The report's tables and findings, without what differs between runs by design (the date, the commit, times)."""
    body = text.split("## Time per step")[0]
    return [line for line in body.splitlines() if line.startswith("|") or line.startswith("BWT")]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    runs = tmp_path_factory.mktemp("arena") / "runs" / "tiny-quick"
    p = arena(runs)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-4000:]
    return runs, out


def test_quick_arena_runs_every_step_and_reports(quick):
    runs, out = quick
    steps = {line.split()[0] for line in open(runs / "arena_times.md") if re.match(r"^[a-z-]+ +\d+ s$", line.strip())}
    assert {"seq", "oracles", "analyze-seq", "merge-uniform", "merge-grid", "merge-balanced", "sdft", "mle", "mmopd",
            "analyze", "evaluate-runs", "evaluate-consolidators", "evaluate-mle-learned", "evaluate-mixed"} <= steps
    text = open(runs / "report.md").read()
    for row in report.ROWS:
        assert f"| {row} |" in text, row
    for col in ("math in", "math ood", "search in", "search ood", "ecommerce in", "ecommerce ood", "if in", "if ood"):
        assert col in text
    found = re.findall(r"^\| (\d+) \| .* \| \*\*(holds|contradicted|not shown|not measurable here)\*\* \|", text, re.M)
    assert [int(i) for i, _ in found] == list(range(1, 11)), found
    assert "total (wall)" in text and "![accuracy after each stage](eval/seq_matrix.png)" in text
    # the lanes' progress: each long step's newest "ETA" line is echoed while it runs
    assert re.search(r"^\[[\d:]+\]   evaluate-runs: saved .* checkpoint \d+/9 \| \d+s elapsed, ETA \d+s$", out, re.M), out


def test_a_killed_arena_resumes_to_the_same_report(quick, tmp_path):
    runs, _ = quick
    again = tmp_path / "runs" / "tiny-quick"
    p = arena(again)
    t0 = time.time()
    while time.time() - t0 < 600:   # kill it while MMOPD trains (lane B, after the merges)
        line = p.stdout.readline()
        if "mmopd: started" in line or not line:
            break
    time.sleep(2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (again / "report.md").exists()
    p = arena(again)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-4000:]
    assert numbers(open(again / "report.md").read()) == numbers(open(runs / "report.md").read())


def test_seeds_2_runs_the_whole_study_again_and_reports_over_the_seeds(quick):
    """SEEDS=2 on the finished run (in place, after the tests that compare with its report: a moved run is another
    recipe to train_seq.py, its parent's path changed): seed 0's steps are kept (training skips, evaluations
    --resume), the whole study runs again with training seed 1 in <runs>-seed1, and the report gives mean ± std."""
    runs = quick[0]
    p = arena(runs, env={"SEEDS": "2"})
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-4000:]
    assert "seed-1: done in" in out and "[15/15] seed-1: started" in out
    assert "evaluated before with these settings" in open(runs / "logs" / "evaluate-runs.log").read()
    seed1 = runs.parent / "tiny-quick-seed1"
    assert (seed1 / "report.md").is_file() and (seed1 / "seq" / "4-if" / "acl_meta.json").is_file()
    assert '"seed": 1' in open(seed1 / "seq" / "1-math" / "acl_meta.json").read()
    assert '"seed": 1' in open(seed1 / "mmopd" / "acl_meta.json").read()
    text = open(runs / "report.md").read()
    assert "± is the std over the 2 training seeds" in text and "over 2 training seeds" in text
    assert "| seed 0 | seed 1 |" in text
    found = re.findall(r"^\| (\d+) \| .* \| \*\*(holds \d, not shown \d, contradicted \d(?:, not measurable \d)?)\*\* \|",
                       text, re.M)
    assert [int(i) for i, _ in found] == list(range(1, 11)), found


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
