"""report.py: the findings' criteria on the study's own numbers (tests/data/study_table.json) and on a null table,
the balanced-profile finding on hand-made evaluation records (ratios, minimum, bootstrap, verdict), and the report of
a hand-made arena run."""
import json
import os
import re
import subprocess
import sys

import pytest

import report
from acl import forgetting
from envs.base import UsageError

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


def scores(eval_dir, names):
    return report.Scores.from_records(report.load_records(eval_dir, names + [f"oracle-{d}" for d in DOMAINS]))


def test_ratios_minimum_and_verdict(eval_dir):
    res = report.balance(scores(eval_dir, ["balanced", "lopsided"]), ["balanced", "lopsided"], domains=DOMAINS,
                         boots=500)
    assert res["balanced"]["ratio"] == pytest.approx({"math": 0.8, "search": 0.8})
    assert res["lopsided"]["min"] == pytest.approx(0.2) and res["balanced"]["min"] == pytest.approx(0.8)
    assert 0.02 < res["balanced"]["boot"].std().item() < 0.2
    assert "**holds**" in report.balance_table(res, ["balanced", "lopsided"], "balanced", DOMAINS)
    assert "**contradicted**" in report.balance_table(res, ["balanced", "lopsided"], "lopsided", DOMAINS)
    record(os.path.join(eval_dir, "near.json"), {"math": [1.0] * 84 + [0.0] * 116, "search": [1.0] * 42 + [0.0] * 158})
    close = report.balance(scores(eval_dir, ["balanced", "near"]), ["balanced", "near"], domains=DOMAINS,
                           boots=500)   # 0.84 vs 0.80: within noise
    assert "**not shown" in report.balance_table(close, ["balanced", "near"], "near", DOMAINS)


def test_missing_or_mismatched_records_fail_with_one_line(eval_dir):
    with pytest.raises(UsageError, match="no evaluation"):
        scores(eval_dir, ["absent"])
    record(os.path.join(eval_dir, "other.json"), {"math": [1.0] * 10, "search": [0.0] * 10})
    with pytest.raises(UsageError, match="different math/test tasks"):
        report.balance(scores(eval_dir, ["other"]), ["other"], domains=DOMAINS)
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


def model_level(drift: float, own: float = 0.9, leak: float = 0.0) -> dict:
    """analyze.py's model level (labels, norms, cosines) of displacements made by hand: each oracle moves along its
    own axis; stage k adds `own` along its domain's oracle, `drift` along an axis of its own and `leak` along the math
    oracle's (stage 1 is the math oracle itself)."""
    import numpy as np
    e = np.eye(8)
    vec = {f"oracle-{d}": e[i] for i, d in enumerate(ALL)}
    x = e[0].copy()
    vec["seq-1-math"] = x.copy()
    for k, d in enumerate(ALL[1:], 1):
        x = x + own * e[k] + drift * e[3 + k] + leak * e[0]
        vec[f"seq-{k + 1}-{d}"] = x.copy()
    labels = list(vec)
    V = np.array([vec[n] for n in labels])
    norms = np.linalg.norm(V, axis=1)
    return {"checkpoints": labels, "norms": dict(zip(labels, norms.tolist())),
            "cosine": {"all": (V @ V.T / np.outer(norms, norms)).tolist()}}


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
        "mle-learned": (0.6, 0.6, 0.55, 0.6), "mle-request": (0.6, 0.55, 0.5, 0.6)}
    for name, r in rates.items():
        full_record(ev / f"{name}.json", dict(zip(ALL, r)))
    (tmp_path / "runs" / "analysis").mkdir()
    (tmp_path / "runs" / "analysis" / "analysis.json").write_text(json.dumps(model_level(drift=0.3) | {
        "stage_moves": [  # per lr·update: SFT 56 and 67, RL 25 and 17: SFT's updates agree more in direction
            {"checkpoint": "seq-2-search", "total": 1.0, "rft": 0.9, "rl": 0.05, "rft_lr_steps": 0.016, "rl_lr_steps": 0.002},
            {"checkpoint": "seq-3-ecommerce", "total": 1.0, "rft": 0.8, "rl": 0.02, "rft_lr_steps": 0.012,
             "rl_lr_steps": 0.0012}],
        "token": {"checkpoints": {"seq-4-if": {"n": 10000, "consistency": 0.9, "low_consistency": 0.97,
                                               "high_flip_share": 0.85, "high_fraction": 0.2}}}}))
    (tmp_path / "runs" / "arena_times.md").write_text("# arena.sh started\nseq 100 s\ntotal (wall) 100 s (1.7 min)\n")
    return tmp_path / "runs"


def verdicts(text):
    """{finding number: the verdict cell} of a one-seed report's findings table."""
    return {int(line.split("|")[1]): line.split("|")[3].strip() for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}


def test_report_has_every_row_column_and_finding(run):
    out = report.report(str(run), str(run / "report.md"))
    text = open(out).read()
    for row in report.ROWS:
        assert f"| {row} |" in text, row
    for col in ("math in", "math ood", "search in", "ecommerce ood", "if in", "average"):
        assert col in text
    assert "| *Seq-IF, the study* | 0.40 | 0.67 | 0.87 | 0.98 |" in text and "after \\ on" in text
    rows = verdicts(text)
    assert sorted(rows) == list(range(1, 11))
    # the built-in story decides each criterion
    assert rows[1] == "**holds**"            # math 0.6 -> 0.4, search 0.6 -> 0.3, e-commerce 0.6 -> 0.55
    assert rows[2] == "**holds**"            # math falls at e-commerce (0.6 -> 0.2) and rises at IF (-> 0.4)
    assert rows[3] == "**holds**"            # SDFT and MMOPD recover 0.15 of math's 0.2 and 0.25 of search's 0.3
    assert rows[4] == "**holds**"            # SDFT below Seq-Final on IF (0.3 vs 0.6) and e-commerce (0.3 vs 0.55)
    assert rows[5] == "**holds**"            # uniform loses e-commerce, the weakest agentic mean, keeps math ood
    assert rows[6] == "**holds**"            # MLE 1.0 of every oracle, the runner-up 0.83
    assert rows[7] == "**holds**"            # each oracle only its own domain
    assert rows[8] == "**holds**" and rows[9] == "**holds**" and rows[10] == "**holds**"
    assert "seq 100 s" in text and "**0.600 ± 0.049**" in text   # the best of a column in bold, with its SE
    assert "| 1 | Seq-Final sits below the earlier peaks of math, search and e-commerce (forgetting) | **holds** | 0.092 |" \
        in text   # the MDE: 2 × the largest of its paired SEs (search's, 0.046)
    for _claim, quote, fn in report.FINDINGS:   # every criterion printed beside the study's words
        assert quote in text and " ".join(fn.__doc__.split())[:60] in text
    assert "SDFT ablation grid" not in text   # not run


def test_report_shows_the_sdft_grid_when_it_was_run(run):
    full_record(run / "eval" / "sdft-ablation-nodedup.json", dict(zip(ALL, (0.55, 0.65, 0.3, 0.3))))
    text = open(report.report(str(run), str(run / "r.md"))).read()
    assert "## The SDFT ablation grid" in text
    assert "| nodedup | balanced | interleaved | base, --dedup-threshold 1.0 | 0.550 ± 0.050 (0.000 ± 0.000) | " \
           "0.650 ± 0.048 (0.100 ± 0.030) |" in text


def test_findings_contradicted_and_not_shown(run):
    """The other two verdicts on the same run: SDFT above Seq-Final on e-commerce contradicts finding 4; a stage whose
    move is closer to another domain's oracle contradicts finding 10; a close call is "not shown"."""
    full_record(run / "eval" / "sdft.json", dict(zip(ALL, (0.55, 0.55, 0.7, 0.3))))
    analysis = json.loads((run / "analysis" / "analysis.json").read_text())
    analysis.update(model_level(drift=0.3, leak=1.5))   # each stage moves more toward the math oracle than its own
    (run / "analysis" / "analysis.json").write_text(json.dumps(analysis))
    rows = verdicts(open(report.report(str(run), str(run / "r.md"))).read())
    assert rows[4] == "**contradicted**" and rows[10] == "**contradicted**"
    full_record(run / "eval" / "sdft.json", dict(zip(ALL, (0.55, 0.55, 0.54, 0.3))))   # 1 task below Seq-Final
    rows = verdicts(open(report.report(str(run), str(run / "r.md"))).read())
    assert rows[4] == "**not shown**"


def test_verdict_rules():
    assert report.signed(0.1, 0.04) == "holds" and report.signed(-0.1, 0.04) == "contradicted"
    assert report.signed(0.05, 0.04) == "not shown" and report.signed(0.1, None) == "not measurable here"
    assert report.signed(-0.1, 0.04, -1) == "holds"
    assert report.above(0.95, 0.01, 0.9) == "holds" and report.above(0.91, 0.01, 0.9) == "not shown"
    assert report.above(0.85, 0.01, 0.9) == "contradicted"
    assert report.decide(["holds", "holds"], [report.guard("not shown")]) == "holds"
    assert report.decide(["holds", "not shown"]) == "not shown"
    assert report.decide(["holds", "holds"], [report.guard("contradicted")]) == "contradicted"
    assert report.decide(["holds", "not measurable here"]) == "not measurable here"
    assert report.tally(["holds", "not shown", "not shown"]) == "holds 1, not shown 2, contradicted 0"


# ----------------------------------------------------------------------------- the study's own numbers

def study_scores(null: bool = False):
    table = json.load(open(os.path.join(ROOT, "tests", "data", "study_table.json")))
    if null:   # every checkpoint equal to the base, on every column
        table["checkpoints"] = {c: {col: 20.0 for col in table["columns"]} for c in table["checkpoints"]}
    return report.Scores.from_table(table)


def test_every_finding_the_study_states_holds_on_its_own_numbers():
    """The criteria read the study as it reads itself: each finding its table states with numbers holds on them.
    Finding 7 cannot be computed from the table (it gives the base's score on NQ alone, so no oracle's own-domain gain
    but search's), nor 8-10 (token and model level: not scores); none of them may come out contradicted."""
    got = {i: (v, text) for i, _, v, text, _ in report.check_findings(study_scores(), None)}
    assert [got[i][0] for i in range(1, 7)] == ["holds"] * 6, got
    assert got[7][0] == "not measurable here" and "search 8.700 ± 0.408" in got[7][1]   # Seq-Math's NQ transfer
    assert [got[i][0] for i in (8, 9, 10)] == ["not measurable here"] * 3
    assert "merge-uniform" not in got[6][1]   # no IFEval for the uniform merge in the study: left out, not zero
    assert "mle 0.81" in got[6][1] and "sdft 0.62" in got[6][1]


def test_a_null_table_shows_nothing():
    """Every checkpoint equal to the base: no finding holds and none is contradicted."""
    got = {i: v for i, _, v, _, _ in report.check_findings(study_scores(null=True), None)}
    assert [got[i] for i in range(1, 8)] == ["not shown"] * 7, got
    assert [got[i] for i in (8, 9, 10)] == ["not measurable here"] * 3   # no analysis in a table of scores


def test_out_replaces_only_a_report(run, tmp_path):
    notes = tmp_path / "README.md"
    notes.write_text("# my notes\n")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "report.py"), "--runs", str(run), "--out", str(notes)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "is not a report this script wrote" in r.stderr and notes.read_text() == "# my notes\n"
    report.report(str(run), str(tmp_path / "r.md"))
    report.report(str(run), str(tmp_path / "r.md"))   # its own report: replaced


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

    from acl.common import save_json as save_results
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
    # finding 8 needs analyze.py's token report, which only seed 0's run has; seed 1's math stage is not above Seq-Final
    assert "| 8 | Low-entropy tokens stay stable across stages; almost all change is carried by the high-entropy " \
           "minority | **holds 1, not shown 0, contradicted 0, not measurable 1** | holds (MDE 0.023) | not measurable " \
           "here (MDE –) |" in text and "| seed runs | seed runs-seed1 |" in text
    assert "| 1 | Seq-Final sits below the earlier peaks of math, search and e-commerce (forgetting) | **holds 1, not " \
           "shown 1, contradicted 0** | holds (MDE 0.092) | not shown (MDE 0.092) |" in text
    assert "| 7 | Oracles specialise; their gains do not carry consistently across domains | **holds 2, not shown 0, " \
           "contradicted 0** |" in text
    shutil.rmtree(seed1 / "eval")
    seed1.joinpath("eval").mkdir()
    with pytest.raises(UsageError, match="no evaluation records"):
        report.report(str(run), str(run / "report.md"), [str(seed1)])


def test_a_report_never_mixes_records_of_other_scoring_code_or_settings(run, tmp_path):
    """Every record of one report scored by one code with one set of sampling settings, else one line naming them;
    the report stamps the scoring code and the commits that made its numbers."""
    ev = run / "eval"
    for f in ev.glob("*.json"):
        rec = json.loads(f.read_text())
        f.write_text(json.dumps(dict(rec, scoring_code="abc", code_revision="c1", settings={"temperature": 1.0})))
    text = open(report.report(str(run), str(tmp_path / "r.md"))).read()
    assert "scored by code abc at commit c1" in text
    rec = json.loads((ev / "sdft.json").read_text())
    (ev / "sdft.json").write_text(json.dumps(dict(rec, scoring_code="def", code_revision="c2")))
    with pytest.raises(UsageError, match="different scoring code or settings: .*sdft"):
        report.report(str(run), str(tmp_path / "r.md"))
    (ev / "sdft.json").write_text(json.dumps(dict(rec, settings={"temperature": 0.6}, code_revision="c2")))
    with pytest.raises(UsageError, match="different scoring code or settings"):
        report.report(str(run), str(tmp_path / "r.md"))
    (ev / "sdft.json").write_text(json.dumps(dict(rec, code_revision="c2")))   # another commit, the same scoring
    assert "scored by code abc at commits c1, c2" in open(report.report(str(run), str(tmp_path / "r.md"))).read()


def test_the_forgetting_law_section_fits_drop_against_kl(run, tmp_path):
    """analyze.py's kl_moves beside the records: one point per stage k >= 2 and earlier domain (the stage's KL on its
    own domain, the earlier domain's paired drop), the least-squares slope with its SE, and the scatter plotted."""
    path = run / "analysis" / "analysis.json"
    an = json.loads(path.read_text())
    moves = []
    for k, (d, kl) in enumerate(zip(ALL[1:], (0.02, 0.09, 0.05)), 2):
        for dd in ALL:
            moves.append(dict(before=f"seq-{k - 1}-{ALL[k - 2]}", after=f"seq-{k}-{d}", domain=dd,
                              kl=kl if dd == d else kl / 3, se=0.001, tokens=100, episodes=10))
    moves.append(dict(before="seq-2-search-rft", after="seq-2-search", domain="search", kl=0.005, se=0.001,
                      tokens=100, episodes=10))
    moves.append(dict(before="seq-1-math", after="seq-2-search-rft", domain="search", kl=0.015, se=0.001,
                      tokens=100, episodes=10))
    path.write_text(json.dumps(dict(an, kl_moves=moves)))
    text = open(report.report(str(run), str(tmp_path / "r.md"))).read()
    assert "## The forgetting law (beyond the study)" in text
    assert "| seq-2-search | 0.0200 ± 0.0010 | 0.0150 | 0.0050 | math 0.000 ± 0.000 |" in text
    assert "| seq-3-ecommerce | 0.0900 ± 0.0010 | – | – | math 0.400 ± " in text   # 0.6 -> 0.2
    assert "b = " in text and "6 points" in text
    assert (run / "analysis" / "forgetting_kl.png").is_file()


def test_the_cold_start_ablation_adds_its_stages_to_the_law_and_nothing_else(run, tmp_path):
    """report(law_runs=...): another cold start's sequential run (arena.sh LAW_ABLATION=1) adds its stages' points to
    the law's table, fit and plot, under its own name; the study's tables are the main run's; a law run without
    records, or scored with other settings, is refused in one line."""
    def kl_moves(kls):
        return [dict(before=f"seq-{k - 1}-{ALL[k - 2]}", after=f"seq-{k}-{d}", domain=dd, kl=kl if dd == d else kl / 3,
                     se=0.001, tokens=100, episodes=10) for k, (d, kl) in enumerate(zip(ALL[1:], kls), 2) for dd in ALL]
    path = run / "analysis" / "analysis.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), kl_moves=kl_moves((0.02, 0.09, 0.05)))))
    none = tmp_path / "runs-coldnone"
    (none / "eval").mkdir(parents=True)
    (none / "analysis").mkdir()
    for name in ("seq-1-math", "seq-2-search", "seq-3-ecommerce", "seq-4-if"):   # GRPO alone: nothing learned, kept
        full_record(none / "eval" / f"{name}.json", dict(zip(ALL, (0.1, 0.1, 0.1, 0.1))))
    (none / "analysis" / "analysis.json").write_text(json.dumps({"kl_moves": kl_moves((0.001, 0.002, 0.001))}))
    text = open(report.report(str(run), str(tmp_path / "r.md"), law_runs=[str(none)])).read()
    assert "| runs-coldnone | seq-2-search | 0.0010 ± 0.0010 | – | – | math 0.000 ± 0.000 |" in text
    assert "| runs | seq-3-ecommerce | 0.0900 ± 0.0010 |" in text and "12 points" in text
    assert f"--law-runs {none}" in text
    # the study's table is the main run's alone: Seq-Final's math is the fixture's 0.400, not the ablation's 0.100
    assert "| Seq-IF | 0.400 ± " in text
    rec = json.loads((none / "eval" / "seq-2-search.json").read_text())
    (none / "eval" / "seq-2-search.json").write_text(json.dumps(dict(rec, settings={"temperature": 0.6})))
    with pytest.raises(UsageError, match="different scoring code or settings: .*runs-coldnone/seq-2-search"):
        report.report(str(run), str(tmp_path / "r.md"), law_runs=[str(none)])
    empty = tmp_path / "runs-coldself"
    (empty / "eval").mkdir(parents=True)
    with pytest.raises(UsageError, match="--law-runs .*runs-coldself: no evaluation records"):
        report.report(str(run), str(tmp_path / "r.md"), law_runs=[str(empty)])


FORGET = {"math": 0.2, "search": 0.3, "ecommerce": 0.05, "if": 0.1}   # the fixture's study order forgets these three


def order_run(path, order, forget=FORGET):
    """A sequential run under `order` made by hand: seq/<i>-<domain>/acl_meta.json and each stage's record; every domain
    scores 0.6 until the final stage, which keeps 0.6 - forget[d] of each earlier domain d."""
    (path / "eval").mkdir(parents=True)
    for i, d in enumerate(order, 1):
        (path / "seq" / f"{i}-{d}").mkdir(parents=True)
        (path / "seq" / f"{i}-{d}" / "acl_meta.json").write_text(json.dumps({"stage": d, "curriculum": list(order)}))
        (path / "seq" / f"{i}-{d}-rft").mkdir()   # a cold start's checkpoint is no stage
        last = i == len(order)
        full_record(path / "eval" / f"seq-{i}-{d}.json",
                    {x: 0.6 - (forget[x] if last and x != d else 0.0) for x in ALL})
    return str(path)


def test_the_stage_order_section_asks_whether_the_order_or_the_domain_decides(run, tmp_path):
    """report(order_runs=...) (issue 42): the study's order from the main run beside three more, read from their seq/
    directories; each domain's forgetting (own stage - the order's final, paired) with its position, and its final
    score; here each domain forgets the same wherever it stands, so the domain decides (adjusted R² 1.00). A second
    seed of one order gives mean ± std [SE]; a run without stages is refused in one line."""
    # the fixture's study order: math 0.6 -> 0.4, search 0.6 -> 0.3, ecommerce 0.6 -> 0.55 at seq-4-if
    rev = order_run(tmp_path / "o-rev", ("if", "ecommerce", "search", "math"))
    efirst = order_run(tmp_path / "o-efirst", ("ecommerce", "math", "search", "if"))
    elast = order_run(tmp_path / "o-elast", ("math", "search", "if", "ecommerce"))
    text = open(report.report(str(run), str(tmp_path / "r.md"), order_runs=[rev, efirst, elast])).read()
    assert "## Stage order (beyond the study)" in text and f"--orders {rev} {efirst} {elast}" in text
    assert re.search(r"\| math → search → ecommerce → if \(the study's\), 1 seed\(s\) \| 0\.200 ± 0\.0\d\d \(1\) \| "
                     r"0\.300 ± 0\.0\d\d \(2\) \| 0\.050 ± 0\.0\d\d \(3\) \| \(last, 4\) \|", text)
    assert re.search(r"\| if → ecommerce → search → math, 1 seed\(s\) \| \(last, 4\) \| 0\.300 ± 0\.0\d\d \(3\) \| "
                     r"0\.050 ± 0\.0\d\d \(2\) \| 0\.100 ± 0\.0\d\d \(1\) \|", text)
    assert "| ecommerce → math → search → if, 1 seed(s) | 0.400 ± " in text   # the final scores table: math 0.6 - 0.2
    assert "Over the 12 cells" in text and "by the domain alone: adjusted R² 1.00" in text
    assert "**the domain decides**" in text
    rev2 = order_run(tmp_path / "o-rev2", ("if", "ecommerce", "search", "math"), dict(FORGET, search=0.4))
    text = open(report.report(str(run), str(tmp_path / "r.md"), order_runs=[rev, rev2, efirst, elast])).read()
    assert re.search(r"\| if → ecommerce → search → math, 2 seed\(s\) \| \(last, 4\) \| 0\.350 ± 0\.071 \[0\.0\d\d\] \(3\)",
                     text)
    (tmp_path / "o-none" / "eval").mkdir(parents=True)
    with pytest.raises(UsageError, match="--orders .*o-none: no sequential run"):
        report.report(str(run), str(tmp_path / "r.md"), order_runs=[str(tmp_path / "o-none")])


def test_the_cost_table_sums_each_methods_pieces(run):
    """method_costs/cost_table (issue 42): the cost of adding the last domain, each method's pieces summed from the
    `cost` they recorded; a method with a piece missing shows –; no recorded cost at all, no section."""
    assert report.cost_table([str(run)]) == []

    def piece(path, n, pool=False):
        c = dict(env_calls=n, sampled_tokens=10 * n, trained_tokens=100 * n, seconds=n)
        os.makedirs(path, exist_ok=True)
        body = {"funnel": {"if": {"cost": c}}} if pool else {"cost": c}
        (path / ("pool.json" if pool else "acl_meta.json")).write_text(json.dumps(body))
    piece(run / "seq" / "4-if", 1)
    piece(run / "oracle" / "if", 2)
    piece(run / "sdft-pool", 4, pool=True)
    piece(run / "sdft", 8)
    piece(run / "mmopd", 16)
    for d in ALL:
        piece(run / "mle" / "experts" / d, 32)
    piece(run / "mle-continual" / "backbone" / "4-if", 64)
    piece(run / "mle-continual" / "4-if" / "experts" / "if", 128)
    costs = report.method_costs(str(run))
    assert costs["sequential RL"][0]["env_calls"] == 1 and costs["SDFT from scratch"][0]["env_calls"] == 14
    assert costs["MMOPD"][0]["trained_tokens"] == 1700 and costs["MLE one-shot"][0]["env_calls"] == 14 + 4 * 32
    assert costs["MLE continual"][0]["seconds"] == 2 + 4 + 64 + 128
    assert costs["MLE continual + re-fits"][0] is None   # no re-fit recorded
    lines = "\n".join(report.cost_table([str(run)]))
    assert "| sequential RL | 1 | 10 | 100 | 1 | its stage |" in lines
    assert "| MLE continual + re-fits | – | – | – | – |" in lines


def test_the_continual_mle_section_shows_adapter_drift_and_the_refit(run, tmp_path):
    """eval/mle-continual-<k>-<domain>[-refit].json (arena.sh MLE_CONTINUAL=1): an earlier domain's score before a
    backbone refresh, the refresh's paired change (kept expert) and the re-fit's; the last step against one-shot MLE
    (the fixture's mle: 0.6 everywhere)."""
    ev = run / "eval"
    for k, d in enumerate(ALL, 1):
        # each refresh costs every earlier domain 0.1 with its kept expert; the re-fit wins 0.05 of it back
        kept = {x: 0.6 - 0.1 * (k - 1 - i) if i < k - 1 else 0.6 for i, x in enumerate(ALL[:k])}
        full_record(ev / f"mle-continual-{k}-{d}.json", kept)
        if k > 1:
            full_record(ev / f"mle-continual-{k}-{d}-refit.json",
                        {x: v + (0.05 if x != d else 0.0) for x, v in kept.items()})
    text = open(report.report(str(run), str(tmp_path / "r.md"))).read()
    assert "## MLE as a continual learner (beyond the study)" in text
    assert re.search(r"\| search arrives \| math \| 0\.600 ± 0\.0\d\d \| -0\.100 ± 0\.0\d\d \| 0\.050 ± 0\.0\d\d \|", text)
    assert re.search(r"\| if arrives \| math \| 0\.400 ± 0\.0\d\d \| -0\.100 ± 0\.0\d\d \| 0\.050 ± 0\.0\d\d \|", text)
    assert re.search(r"\| continual, experts kept \| -0\.300 ± 0\.0\d\d \| -0\.200 ± 0\.0\d\d \| -0\.100 ± 0\.0\d\d \| "
                     r"0\.000 ± 0\.000 \|", text)


def test_the_routing_section_measures_router_accuracy_and_the_cost_of_a_wrong_route(run, tmp_path):
    """Routing without tags: the request router's records with routed_to (which expert served each task): its
    accuracy per domain and split, the misrouted tasks' paired cost against tag routing, and where mixed tasks went."""
    assert "## Routing without tags" not in open(report.report(str(run), str(tmp_path / "r.md"))).read()
    ev = run / "eval"
    tag = json.loads((ev / "mle.json").read_text())
    rec = json.loads(json.dumps(tag))
    for col, b in rec["benchmarks"].items():
        d = col.split("/")[0]
        n = len(b["per_task"])
        # the first 20 math test tasks go to the search expert, and score 0 there (tag routing: 1 on the first 60)
        wrong = 20 if col == "math/test" else 0
        b["routed_to"] = ["search"] * wrong + [d] * (n - wrong)
        b["per_task"] = [0.0] * wrong + b["per_task"][wrong:]
        b["mean"] = sum(b["per_task"]) / n
    (ev / "mle-request.json").write_text(json.dumps(rec))
    (run / "eval-mixed").mkdir()
    (run / "eval-mixed" / "mle-request.json").write_text(json.dumps({"benchmarks": {"mixed/test": {
        "routed_to": ["search"] * 3 + ["math"]}}}))
    text = open(report.report(str(run), str(tmp_path / "r.md"))).read()
    assert "## Routing without tags (beyond the study)" in text and "| MLE-request | " in text
    assert "| request | math/test | 0.800 | 20 | 1.000 ± 0.000 | -0.200 ± 0.040 |" in text
    assert "| request | search/test | 1.000 | 0 | – (none misrouted) | 0.000 ± 0.000 |" in text
    assert "- request on mixed/test: search 75%, math 25%" in text


def test_adjusted_r2_by_hand():
    assert report.adjusted_r2(["a", "a", "b", "b"], [1.0, 1.0, 3.0, 3.0]) == pytest.approx(1.0)
    # levels explain nothing: within-level variance is all of it, and the adjustment makes it negative
    assert report.adjusted_r2(["a", "b", "a", "b"], [1.0, 1.0, 3.0, 3.0]) == pytest.approx(1 - (4 / 2) / (4 / 3))
    assert report.adjusted_r2(["a", "b"], [1.0, 2.0]) is None and report.adjusted_r2(["a", "a", "b"], [1, 1, 1]) is None


def test_the_arenas_bars_are_measured_from_the_records(run, tmp_path):
    """Issue 41's bars in the report: each domain's own stage on `test` (>= 0.50 in three, >= 0.35 in all), its oracle
    on `ood` (>= 0.10), and the largest paired SE of the forgetting and consolidator - Seq-Final cells (<= 0.02): the
    fixture's 100 tasks miss the SE bar and its oracles (ood a tenth of 0.6) the ood bar; 2,500 tasks meet the SE bar,
    and an own stage at 0.30 misses the first."""
    text = open(report.report(str(run), str(tmp_path / "r.md"))).read()
    assert "| own stage on `test` ≥ 0.50 in three domains, ≥ 0.35 in all | 0.600 | 0.600 | 0.600 | 0.600 | met (4 of 4" in text
    assert "| its oracle on `ood` ≥ 0.10 | 0.060 | 0.060 | 0.060 | 0.060 | math missed, search missed" in text
    assert re.search(r"largest paired SE of a forgetting cell: 0\.0\d+ \(seq-\d-\w+ − seq-4-if on \w+\); 3 of 3 cells "
                     r"above 0\.02 \(missed\)", text), text
    ev = tmp_path / "big"
    ev.mkdir()
    rates = {"seq-1-math": (0.6, 0, 0, 0), "seq-2-search": (0.3, 0.6, 0, 0), "seq-3-ecommerce": (0.1, 0.2, 0.3, 0),
             "seq-4-if": (0.1, 0.1, 0.1, 0.6), "oracle-math": (0.6, 0, 0, 0), "sdft": (0.4, 0.4, 0.2, 0.5)}
    for name, r in rates.items():
        full_record(ev / f"{name}.json", dict(zip(ALL, r)), n=2500)
    lines = "\n".join(report.arena_bars([report.Scores.from_records(report.load_records(str(ev)))]))
    assert "| 0.600 | 0.600 | 0.300 | 0.600 | missed (3 of 4 ≥ 0.50) |" in lines
    assert "| its oracle on `ood` ≥ 0.10 | 0.060 | – | – | – | math missed, search –" in lines
    assert "0 of 3 cells above 0.02 (met)" in lines and "0 of 4 cells above 0.02 (met)" in lines


def test_across_training_seeds(tmp_path):
    """arena.sh SEEDS > 1: every seed's accuracy matrix, from hand-made records, as mean ± std over the seeds."""
    def math_record(values):
        return {"math/test": {"mean": sum(values) / len(values), "n": len(values),
                              "task_ids": [f"t{i}" for i in range(len(values))], "per_task": values}}
    runs = []
    for k, (a, b) in enumerate([(0.5, 0.2), (0.7, 0.4), (0.6, 0.3)]):
        m = forgetting.accuracy_matrix([("seq-1-math", "math", math_record([a] * 4)),
                                        ("seq-2-if", "if", math_record([b] * 4))], math_record([0.1] * 4), ["math"])
        run = tmp_path / f"runs/tiny-seed{k}"
        os.makedirs(run / "eval")
        (run / "eval" / "seq_matrix.json").write_text(json.dumps(m))
        runs.append(str(run))
    text = report.across_seeds(runs)
    assert "mean ± std over 3 training seeds" in text and "| seq-1-math | 0.600 ± 0.100 |" in text
    assert "BWT -0.300 ± 0.000" in text
    saved = json.loads(open(os.path.join(runs[0], "eval", "seq_matrix_seeds.json")).read())
    assert saved["score"]["matrix"][1][0] == [pytest.approx(0.6), pytest.approx(0.1), 3]
    with pytest.raises(UsageError, match="no accuracy matrix"):
        report.across_seeds(runs + [str(tmp_path / "nothing")])
