"""report.py: the balanced-profile finding on hand-made evaluation records (ratios, minimum, bootstrap, verdict)."""
import json
import os
import subprocess
import sys

import pytest

import report
from common import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOMAINS = ("math", "search")


def record(path, scores):
    """An evaluate.py record with `<domain>/test` per-task scores: {domain: [score per task]}."""
    bench = {f"{d}/test": {"mean": sum(s) / len(s), "task_ids": [f"{d}-{i}" for i in range(len(s))], "per_task": s}
             for d, s in scores.items()}
    with open(path, "w") as f:
        json.dump({"benchmarks": bench}, f)


@pytest.fixture
def eval_dir(tmp_path):
    n = 200
    record(tmp_path / "oracle-math.json", {"math": [1.0] * (n // 2) + [0.0] * (n // 2)})         # 0.5
    record(tmp_path / "oracle-search.json", {"search": [1.0] * (n // 4) + [0.0] * (3 * n // 4)})  # 0.25
    # balanced: 0.4 / 0.5 = 0.8 and 0.2 / 0.25 = 0.8; lopsided: 0.5 / 0.5 = 1.0 but 0.05 / 0.25 = 0.2
    record(tmp_path / "balanced.json", {"math": [1.0] * 80 + [0.0] * 120, "search": [1.0] * 40 + [0.0] * 160})
    record(tmp_path / "lopsided.json", {"math": [1.0] * 100 + [0.0] * 100, "search": [1.0] * 10 + [0.0] * 190})
    return str(tmp_path)


def test_ratios_minimum_and_verdict(eval_dir):
    res = report.balance(eval_dir, ["balanced", "lopsided"], domains=DOMAINS, boots=500)
    assert res["balanced"]["ratio"] == pytest.approx({"math": 0.8, "search": 0.8})
    assert res["lopsided"]["min"] == pytest.approx(0.2) and res["balanced"]["min"] == pytest.approx(0.8)
    assert 0.02 < res["balanced"]["boot"].std().item() < 0.2
    assert "**holds**" in report.balance_table(res, ["balanced", "lopsided"], "balanced", DOMAINS)
    assert "**does not hold**" in report.balance_table(res, ["balanced", "lopsided"], "lopsided", DOMAINS)
    record(os.path.join(eval_dir, "near.json"), {"math": [1.0] * 84 + [0.0] * 116, "search": [1.0] * 42 + [0.0] * 158})
    close = report.balance(eval_dir, ["balanced", "near"], domains=DOMAINS, boots=500)   # 0.84 vs 0.80: within noise
    assert "**not shown" in report.balance_table(close, ["balanced", "near"], "near", DOMAINS)


def test_missing_or_mismatched_records_fail_with_one_line(eval_dir):
    with pytest.raises(UsageError, match="no evaluation"):
        report.balance(eval_dir, ["absent"], domains=DOMAINS)
    record(os.path.join(eval_dir, "other.json"), {"math": [1.0] * 10, "search": [0.0] * 10})
    with pytest.raises(UsageError, match="different math/test tasks"):
        report.balance(eval_dir, ["other"], domains=DOMAINS)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "report.py"), "--balance", "--eval-dir", eval_dir,
                        "--names", "absent"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- report.md

def full_record(path, rates, n=100):
    """A record with `<domain>/test` and `<domain>/ood` of every domain, n tasks each: rates {domain: test rate} (ood:
    a tenth of it); task k of a domain scores 1 when k < rate * n, so two records differ on exactly the tasks between."""
    bench = {}
    for d, rate in rates.items():
        for split, r in (("test", rate), ("ood", rate / 10)):
            per = [1.0 if k < round(r * n) else 0.0 for k in range(n)]
            bench[f"{d}/{split}"] = {"mean": sum(per) / n, "n": n, "task_ids": [f"{d}-{split}-{k}" for k in range(n)],
                                     "per_task": per}
    with open(path, "w") as f:
        json.dump({"benchmarks": bench}, f)


ALL = ("math", "search", "ecommerce", "if")


@pytest.fixture
def run(tmp_path):
    """A fake arena run with a built-in story: math and search forgotten at the e-commerce stage and partly back after
    IF; SDFT and MMOPD recover them; the uniform merge loses e-commerce; MLE the most balanced by far."""
    ev = tmp_path / "runs" / "eval"
    ev.mkdir(parents=True)
    rates = {
        "base": (0.1, 0.1, 0.1, 0.1), "seq-1-math": (0.6, 0.1, 0.1, 0.1), "seq-2-search": (0.6, 0.6, 0.1, 0.1),
        "seq-3-ecommerce": (0.2, 0.2, 0.6, 0.1), "seq-4-if": (0.4, 0.3, 0.55, 0.6),
        "oracle-math": (0.6, 0.1, 0.1, 0.1), "oracle-search": (0.1, 0.6, 0.1, 0.1),
        "oracle-ecommerce": (0.1, 0.1, 0.6, 0.1), "oracle-if": (0.1, 0.1, 0.1, 0.6),
        "merge-uniform": (0.55, 0.5, 0.1, 0.3), "merge-grid": (0.5, 0.5, 0.3, 0.3), "merge-balanced": (0.5, 0.5, 0.3, 0.3),
        "sdft": (0.55, 0.55, 0.3, 0.3), "mmopd": (0.55, 0.55, 0.5, 0.5), "mle": (0.6, 0.6, 0.6, 0.6),
        "mle-learned": (0.6, 0.6, 0.55, 0.6)}
    for name, r in rates.items():
        full_record(ev / f"{name}.json", dict(zip(ALL, r)))
    (tmp_path / "runs" / "analysis").mkdir()
    (tmp_path / "runs" / "analysis" / "analysis.json").write_text(json.dumps({
        "stage_moves": [{"checkpoint": "seq/2-search", "total": 1.0, "rft": 0.9, "rl": 0.2},
                        {"checkpoint": "seq/3-ecommerce", "total": 1.0, "rft": 0.8, "rl": 0.5}],
        "token": {"checkpoints": {"seq/4-if": {"low_consistency": 0.95, "high_flip_share": 0.7, "high_fraction": 0.2}}}}))
    (tmp_path / "runs" / "arena_times.md").write_text("# arena.sh started\nseq 100 s\ntotal (wall) 100 s (1.7 min)\n")
    return tmp_path / "runs"


def test_report_has_every_row_column_and_finding(run):
    out = report.report(str(run), str(run / "report.md"))
    text = open(out).read()
    for row in report.ROWS:
        assert f"| {row} |" in text, row
    for col in ("math in", "math ood", "search in", "ecommerce ood", "if in", "average"):
        assert col in text
    assert "| *Seq-IF, the study* | 0.40 | 0.67 | 0.87 | 0.98 |" in text and "after \\ on" in text
    rows = {int(line.split("|")[1]): line.split("|")[3].strip() for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert sorted(rows) == list(range(1, 10))
    # the built-in story decides each criterion
    assert rows[1] == "**holds**"            # math 0.6 -> 0.4, search 0.6 -> 0.3
    assert rows[2] == "**holds**"            # math falls at e-commerce (0.6 -> 0.2) and rises at IF (-> 0.4)
    assert rows[3] == "**holds**"            # SDFT and MMOPD at 0.55 of a 0.6 peak: 0.92
    assert rows[4] == "**holds**"            # SDFT below Seq-Final on IF (0.3 vs 0.6) and e-commerce (0.3 vs 0.55)
    assert rows[5] == "**holds**"            # uniform keeps math/search, e-commerce 0.1, weakest agentic mean
    assert rows[6] == "**holds**"            # MLE 1.0 of every oracle, the runner-up 0.83
    assert rows[7] == "**holds**"            # each oracle only its own domain
    assert rows[8] == "**holds**" and rows[9] == "**does not hold**"   # 0.8 / 0.5 = 1.6x < 2
    assert "seq 100 s" in text and "**0.600 ± 0.049**" in text   # the best of a column in bold, with its SE


def test_finding_6_first_but_within_noise_is_not_shown(run):
    """MLE first by a margin the bootstrap cannot separate from 0: "not shown", never "not measurable here"."""
    full_record(run / "eval" / "mmopd.json", dict(zip(ALL, (0.6, 0.6, 0.6, 0.59))))   # 59 of MLE's 60 IF tasks
    text = open(report.report(str(run), str(run / "r.md"))).read()
    row6 = next(line for line in text.splitlines() if line.startswith("| 6 |"))
    assert row6.split("|")[3].strip() == "**not shown**" and "mle 1.00" in row6


def test_report_says_what_it_cannot_measure(run):
    for name in ("sdft", "mmopd", "merge-uniform", "mle"):
        os.remove(run / "eval" / f"{name}.json")
    os.remove(run / "analysis" / "analysis.json")
    text = open(report.report(str(run), str(run / "r.md"))).read()
    rows = {int(line.split("|")[1]): line.split("|")[3].strip() for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert [rows[i] for i in (3, 5, 6, 8, 9)] == ["**not measurable here**"] * 5 and rows[1] == "**holds**"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "report.py"), "--runs", str(run / "nope")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: no run directory")


def test_report_over_training_seeds(run):
    """SEEDS > 1: the same study in runs/<arena>-seed<s>; every table becomes mean ± std over the seeds and each
    finding is checked in each seed, with the count of seeds where it holds."""
    import shutil

    from evaluate import save_results
    seed1 = run.parent / (run.name + "-seed1")
    shutil.copytree(run / "eval", seed1 / "eval")
    for d, r in ((run, 0.6), (seed1, 0.4)):   # seed 1's math stage learned less
        full_record(d / "eval" / "seq-1-math.json", dict(zip(ALL, (r, 0.1, 0.1, 0.1))))
        recs = report.load_records(str(d / "eval"))
        m, _ = report.matrices(recs)
        save_results(str(d / "eval" / "seq_matrix.json"), m)
    alone = open(report.report(str(run), str(run / "alone.md"))).read()   # a sibling is not taken unless named
    assert "training seeds" not in alone and "| 1 | Seq-Final sits" in alone
    text = open(report.report(str(run), str(run / "report.md"), [str(seed1)])).read()
    assert "## The accuracy matrix of the sequential run, over 2 training seeds" in text
    assert "mean ± std over 2 training seeds" in text and "| seq-1-math | 0.500 ± 0.141 |" in text
    assert "| Seq-Math | 0.500 ± 0.141 | 0.050 ± 0.014 |" in text       # the study's table: std over the seeds
    assert "| Seq-Math | 0.83 ± 0.24 |" in text                          # ÷ each seed's best single (0.6 / 0.6, 0.4 / 0.6)
    # finding 8 needs analyze.py's token report, which only seed 0's run has: holds in 1 of 2
    assert "| 8 | Low-entropy tokens stay ≥ 90% stable across stages; the change is carried by high-entropy tokens | " \
           "**1 of 2** | holds | not measurable here |" in text and "| seed runs | seed runs-seed1 |" in text
    assert "| 7 | Oracles specialise and do not transfer | **2 of 2** | holds | holds |" in text
    shutil.rmtree(seed1 / "eval")
    seed1.joinpath("eval").mkdir()
    with pytest.raises(UsageError, match="no evaluation records"):
        report.report(str(run), str(run / "report.md"), [str(seed1)])
