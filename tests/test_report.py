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
