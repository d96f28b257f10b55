"""The study's report for one run of the arena, generated from its saved results, never by hand: runs/<arena>/report.md.

    python report.py                                   # runs/tiny -> runs/tiny/report.md (seconds)
    python report.py --runs runs/tiny --out docs/tiny-report.md
    python report.py --balance --names seq-4-if sdft mmopd mle     # finding 6 alone, as a table

What it reads: evaluate.py's records (runs/<arena>/eval/<name>.json, 300 `test` tasks per domain), analyze.py's
analysis.json, the MMOPD checkpoint's history, arena.sh's time table. What it writes: the study's table (in-domain and
OOD score of every checkpoint, ± SE over tasks, the best of each column in bold), the same normalised by each domain's
best single checkpoint beside the study's normalised values, the accuracy matrices (sampled and gold), the plots, and
the study's nine findings, each checked by a criterion fixed in this file before any run (FINDINGS) and marked holds /
does not hold / not measurable here, with the numbers that decide it. "Significant" means beyond 2 standard errors of a
difference paired over the same tasks (evaluate.paired_difference).

The balance criterion (finding 6): for checkpoint c and domain d, r(c, d) = c's mean score on d's `test` tasks / the d
oracle's on the same tasks; B(c) = min over d of r(c, d); its spread is a paired bootstrap over tasks (every resample
draws each domain's tasks once, for all checkpoints and the oracle alike). The claim holds when the claimed checkpoint
(MLE) has the highest B and the 2.5% quantile of its bootstrap difference to the runner-up is > 0; it does not hold when
another has the highest B; first without that margin is "not shown".
"""
import argparse
import os
import platform
import statistics
import sys
import time

import torch

from common import Parser, UsageError, code_revision, read_meta, usage_exit, write_file_atomically
from envs import DOMAINS

# The study's table: its row names and this project's evaluation record of each (runs/<arena>/eval/<name>.json).
ROWS = {"Base": "base", "Seq-Math": "seq-1-math", "Seq-Search": "seq-2-search", "Seq-Ecom": "seq-3-ecommerce",
        "Seq-IF": "seq-4-if", "Oracle-Math": "oracle-math", "Oracle-Search": "oracle-search",
        "Oracle-Ecom": "oracle-ecommerce", "Oracle-IF": "oracle-if", "MM-uniform": "merge-uniform",
        "MM-grid": "merge-grid", "MM-balanced": "merge-balanced", "SDFT": "sdft", "MMOPD": "mmopd", "MLE-tag": "mle",
        "MLE-learned": "mle-learned"}
SINGLE = ("seq-1-math", "seq-2-search", "seq-3-ecommerce", "seq-4-if", "oracle-math", "oracle-search",
          "oracle-ecommerce", "oracle-if")   # the single checkpoints: each domain's best of them normalises it
CONSOLIDATORS = ("merge-uniform", "merge-grid", "merge-balanced", "sdft", "mmopd", "mle")
# The study's normalised in-domain scores (its table ÷ each domain's best single checkpoint: AIME26 25.83, NQ 49.9,
# tau3-Retail 34.0, IFEval 86.2), as read in its release (shared/ANCHORS.md); None where it gives none.
STUDY_NORMALISED = {"Seq-IF": (0.40, 0.67, 0.87, 0.98), "MMOPD": (0.82, 0.91, None, None),
                    "SDFT": (0.86, 0.97, 0.66, 0.62), "MM-uniform": (0.57, 0.78, 0.35, None),
                    "MLE-tag": (0.81, 1.00, 0.97, 0.99)}
Z = 2.0   # "significant": a paired difference beyond Z standard errors


# ----------------------------------------------------------------------------- reading the run

def load_records(eval_dir: str) -> dict:
    """{record name: evaluate.py record} for every ROWS record present in eval_dir."""
    from evaluate import load_results
    out = {}
    for name in ROWS.values():
        path = os.path.join(eval_dir, f"{name}.json")
        if os.path.isfile(path):
            out[name] = load_results(path)
    return out


def cell(rec, domain, split="test"):
    """(mean, SE over tasks, {task id: score}) of `<domain>/<split>` in a record; (None, None, None) if absent."""
    from evaluate import _se
    b = ((rec or {}).get("benchmarks") or {}).get(f"{domain}/{split}")
    if not b:
        return None, None, None
    per = dict(zip(b["task_ids"], b["per_task"])) if b.get("per_task") else None
    return b["mean"], _se(list(per.values())) if per else None, per


def diff(recs, a, b, domain):
    """b - a on `<domain>/test`, paired over tasks: (difference, SE) or (None, None) when either is missing."""
    from evaluate import paired_difference
    x, y = cell(recs.get(a), domain), cell(recs.get(b), domain)
    return paired_difference((x[0], x[2]), (y[0], y[2]))


def fmt(x, se=None, nd=3):
    return "–" if x is None else f"{x:.{nd}f}" + ("" if se is None else f" ± {se:.{nd}f}")


def sig(d, se, sign=+1):
    """True when the paired difference d is beyond Z SEs in the direction `sign`; None when it cannot be told."""
    if d is None or se is None:
        return None
    return sign * d > Z * se


# ----------------------------------------------------------------------------- the tables

def over_seeds(values):
    """(mean, std) of one number over training seeds (None where any seed lacks it; std None with one seed)."""
    if not values or any(v is None for v in values):
        return None, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def study_table(recs_by_seed, domains=DOMAINS) -> str:
    """Rows: the study's checkpoints; columns: each domain's test (in-domain) and ood score and the mean of the
    columns; ± is the SE over tasks with one training seed, the std over training seeds with several (each seed's
    score is its mean over the same tasks); the best of each column in bold."""
    cols = [(d, s) for d in domains for s in ("test", "ood")]
    one = len(recs_by_seed) == 1
    vals = {}
    for row, name in ROWS.items():
        if not all(name in recs for recs in recs_by_seed):
            continue
        per_seed = [[cell(recs[name], d, s)[:2] for d, s in cols] for recs in recs_by_seed]
        for v in per_seed:
            means = [m for m, _ in v if m is not None]
            v.append((sum(means) / len(means) if means else None, None))
        vals[row] = per_seed[0] if one else [over_seeds([v[j][0] for v in per_seed]) for j in range(len(cols) + 1)]
    best = [max((v[j][0] for v in vals.values() if v[j][0] is not None), default=None) for j in range(len(cols) + 1)]
    head = [f"{d} {'in' if s == 'test' else 'ood'}" for d, s in cols] + ["average"]
    lines = ["| checkpoint | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for row, v in vals.items():
        cells = [("**" + fmt(m, se) + "**") if m is not None and m == best[j] else fmt(m, se) for j, (m, se) in enumerate(v)]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_single(recs, domains=DOMAINS) -> dict:
    """{domain: (record name, score)} of each domain's best single checkpoint on its `test` tasks."""
    out = {}
    for d in domains:
        scored = [(cell(recs.get(n), d)[0], n) for n in SINGLE if cell(recs.get(n), d)[0] is not None]
        if scored:
            s, n = max(scored)
            out[d] = (n, s)
    return out


def normalised_table(recs_by_seed, domains=DOMAINS) -> str:
    """Each in-domain score ÷ that domain's best single checkpoint of the same training seed (the scale-free form in
    which tiny and 8B numbers compare; with several seeds, mean ± std of the seeds' ratios), with the study's
    normalised values as a reference row under each row it reports."""
    tops = [best_single(recs, domains) for recs in recs_by_seed]
    top = tops[0]
    lines = ["| checkpoint | " + " | ".join(f"{d} (÷ {fmt(top[d][1]) if d in top else '–'}, {top[d][0] if d in top else '–'})"
                                           for d in domains) + " |", "|---" * (len(domains) + 1) + "|"]
    if len(recs_by_seed) > 1:
        lines[0] = "| checkpoint | " + " | ".join(f"{d} (÷ each seed's best single)" for d in domains) + " |"
    for row, name in ROWS.items():
        if not all(name in recs for recs in recs_by_seed):
            continue
        ratios = [[(x / t[d][1]) if x is not None and d in t and t[d][1] > 0 else None
                   for x, d in zip((cell(recs[name], d)[0] for d in domains), domains)]
                  for recs, t in zip(recs_by_seed, tops)]
        lines.append(f"| {row} | " + " | ".join(fmt(*over_seeds([r[j] for r in ratios]), nd=2)
                                                for j in range(len(domains))) + " |")
        if row in STUDY_NORMALISED:
            lines.append(f"| *{row}, the study* | " + " | ".join(fmt(x, nd=2) for x in STUDY_NORMALISED[row]) + " |")
    return "\n".join(lines)


def matrices(recs, domains=DOMAINS):
    """evaluate.accuracy_matrix of the sequential run, sampled score and gold log-likelihood (None without stages)."""
    from evaluate import accuracy_matrix
    stages = [(n, n.split("-", 2)[2], recs[n]) for n in ("seq-1-math", "seq-2-search", "seq-3-ecommerce", "seq-4-if")
              if n in recs]
    if not stages:
        return None, None
    return (accuracy_matrix(stages, recs.get("base"), list(domains)),
            accuracy_matrix(stages, recs.get("base"), list(domains), metric="gold"))


# ----------------------------------------------------------------------------- the findings, criteria fixed here

def verdict(ok) -> str:
    """True, False, None -> holds, does not hold, not measurable here; a finding's own word (finding 6's "not
    shown": first, but not by a significant margin) is kept as it is."""
    return ok if isinstance(ok, str) else {True: "holds", False: "does not hold", None: "not measurable here"}[ok]


def f1_forgetting(recs, m):
    """1. Seq-Final sits below the earlier peaks of math and search. Criterion: for math and for search, the forgetting
    (the highest score from its stage on, minus Seq-Final's, paired over tasks) is significant."""
    if m is None:
        return None, "no sequential run"
    parts, oks = [], []
    for d in ("math", "search"):
        f, se = m["forgetting"].get(d), m["forgetting_se"].get(d)
        oks.append(sig(f, se))
        parts.append(f"{d} forgetting {fmt(f, se)}")
    return (None if None in oks else all(oks)), "; ".join(parts)


def f2_non_monotonic(recs, m):
    """2. Sequential training is non-monotonic: a domain falls after a later stage and partly recovers. Criterion: some
    domain learned before the last stage has a significant fall from one row to the next after its own stage, followed
    by a significant rise at a later row."""
    if m is None:
        return None, "no sequential run"
    rows, found, parts = m["rows"], [], []
    for d, row in m["learned"].items():
        t = rows.index(row)
        if t == len(rows) - 1:
            continue
        steps = [(rows[r], diff(recs, rows[r - 1], rows[r], d)) for r in range(t + 1, len(rows))]
        falls = [i for i, (_, (x, se)) in enumerate(steps) if sig(x, se, -1)]
        rises = [i for i, (_, (x, se)) in enumerate(steps) if sig(x, se, +1)]
        parts.append(f"{d}: " + ", ".join(f"{r} {fmt(x, se)}" for r, (x, se) in steps))
        if falls and any(i > falls[0] for i in rises):
            found.append(d)
    return bool(found), "; ".join(parts) + (f" (fall then recovery: {', '.join(found)})" if found else "")


def f3_recovery(recs, m):
    """3. MMOPD and SDFT recover most of the forgotten math and search. Criterion: each of them scores at least 0.8 of
    the domain's peak in the sequential run on math and on search; not measurable when finding 1 finds no significant
    forgetting in either (there is nothing to recover)."""
    if m is None:
        return None, "no sequential run"
    parts, oks = [], []
    for c in ("mmopd", "sdft"):
        for d in ("math", "search"):
            j = m["domains"].index(d)
            peak = max((x[j] for x in m["matrix"][m["rows"].index(m["learned"][d]):] if x[j] is not None), default=None)
            s = cell(recs.get(c), d)[0]
            r = s / peak if s is not None and peak else None
            oks.append(None if r is None else r >= 0.8)
            parts.append(f"{c} {d} {fmt(s)} / peak {fmt(peak)} = {fmt(r, nd=2)}")
    forgot = [sig(m["forgetting"].get(d), m["forgetting_se"].get(d)) for d in ("math", "search")]
    if not any(forgot):
        return None, "; ".join(parts) + " (no significant forgetting of math or search to recover)"
    return (None if None in oks else all(oks)), "; ".join(parts)


def f4_sdft_cost(recs, m):
    """4. SDFT pays on the skills learned last. Criterion: SDFT minus Seq-Final is significantly negative on IF and on
    e-commerce."""
    parts, oks = [], []
    for d in ("if", "ecommerce"):
        x, se = diff(recs, "seq-4-if", "sdft", d)
        oks.append(sig(x, se, -1))
        parts.append(f"SDFT − Seq-Final on {d} {fmt(x, se)}")
    return (None if None in oks else all(oks)), "; ".join(parts)


def f5_uniform_merge(recs, m):
    """5. Uniform merging keeps early skills and loses the last agentic one; it is the weakest consolidator on agentic
    tasks. Criterion, all three: MM-uniform scores at least 0.8 of Seq-Math on math and of Seq-Search on search; it is
    significantly below Seq-Ecom on e-commerce; its mean of search and e-commerce is the lowest of the consolidators."""
    if "merge-uniform" not in recs:
        return None, "no uniform merge"
    keep = [(d, cell(recs["merge-uniform"], d)[0], cell(recs.get(s), d)[0])
            for d, s in (("math", "seq-1-math"), ("search", "seq-2-search"))]
    kept = [None if u is None or not s else u / s >= 0.8 for _, u, s in keep]
    lost = diff(recs, "seq-3-ecommerce", "merge-uniform", "ecommerce")
    agentic = {c: (cell(recs[c], "search")[0] + cell(recs[c], "ecommerce")[0]) / 2 for c in CONSOLIDATORS
               if c in recs and None not in (cell(recs[c], "search")[0], cell(recs[c], "ecommerce")[0])}
    weakest = min(agentic, key=agentic.get) if agentic else None
    oks = kept + [sig(*lost, sign=-1), None if weakest is None else weakest == "merge-uniform"]
    text = "; ".join(f"{d} {fmt(u)} vs its stage {fmt(s)}" for d, u, s in keep) + \
        f"; e-commerce − Seq-Ecom {fmt(*lost)}; agentic mean: " + \
        ", ".join(f"{c} {fmt(v)}" for c, v in sorted(agentic.items(), key=lambda kv: kv[1]))
    return (None if None in oks else all(oks)), text


def f6_balance(recs, eval_dir, names=("seq-4-if", "sdft", "mmopd", "mle"), claim="mle"):
    """6. MLE has the most balanced profile (the module docstring's criterion)."""
    if not all(n in recs for n in names) or not all(f"oracle-{d}" in recs for d in DOMAINS):
        return None, "needs Seq-Final, SDFT, MMOPD, MLE and the four oracles"
    zero = [d for d in DOMAINS if not cell(recs[f"oracle-{d}"], d)[0]]
    if zero:
        return None, f"the {', '.join(zero)} oracle scores 0 on its own tasks: no ratio to it"
    res = balance(eval_dir, list(names))
    v = balance_verdict(res, list(names), claim)[0]
    ok = {"holds": True, "does not hold": False}.get(v, "not shown")
    return ok, ", ".join(
        f"{n} {res[n]['min']:.2f} ± {res[n]['boot'].std().item():.2f}" for n in names)


def f7_oracles(recs, m):
    """7. Oracles specialise and do not transfer. Criterion: every oracle is significantly above the base on its own
    domain, and no oracle is significantly above the base on another domain."""
    own, transfer, parts = [], [], []
    for d in DOMAINS:
        o = f"oracle-{d}"
        if o not in recs or "base" not in recs:
            return None, "needs the base and the four oracles"
        x, se = diff(recs, "base", o, d)
        own.append(sig(x, se))
        gains = {e: diff(recs, "base", o, e) for e in DOMAINS if e != d}
        transfer += [e for e, (y, s) in gains.items() if sig(y, s)]
        parts.append(f"{o}: own {fmt(x, se)}, others " + ", ".join(f"{e} {fmt(*g)}" for e, g in gains.items()))
    ok = None if None in own else all(own) and not transfer
    return ok, "; ".join(parts) + (f" (significant transfer to: {', '.join(transfer)})" if transfer else "")


def f8_tokens(analysis):
    """8. Low-entropy tokens stay >= 90% stable across stages; the change is carried by high-entropy tokens. Criterion:
    for every later checkpoint, at least 0.90 of the low-entropy positions keep the reference's top-1, and the
    high-entropy positions' share of the top-1 flips exceeds their share of positions (analyze.py's token report)."""
    tok = (analysis or {}).get("token", {}).get("checkpoints")
    if not tok:
        return None, "no token-level analysis (analyze.py)"
    oks, parts = [], []
    for lab, r in tok.items():
        if r.get("low_consistency") is None or r.get("high_flip_share") is None:
            continue
        oks.append(r["low_consistency"] >= 0.9 and r["high_flip_share"] > r["high_fraction"])
        parts.append(f"{lab} low {r['low_consistency']:.2f}, flips in high {r['high_flip_share']:.2f} "
                     f"(positions {r['high_fraction']:.2f})")
    return (all(oks) if oks else None), "; ".join(parts)


def f9_sft_moves_more(analysis):
    """9. SFT moves the weights several times more than RL does. Criterion: in every stage with a cold start, the SFT
    part's move (the -rft checkpoint from the stage's parent) is at least 2x the RL part's (the stage from -rft)."""
    moves = [m for m in (analysis or {}).get("stage_moves", []) if "rft" in m]
    if not moves:
        return None, "no stage with a cold start in analyze.py's stage moves"
    ratios = {m["checkpoint"]: m["rft"] / m["rl"] if m["rl"] > 0 else float("inf") for m in moves}
    return all(r >= 2 for r in ratios.values()), ", ".join(
        f"{c}: SFT {m['rft']:.3f} vs RL {m['rl']:.3f} ({ratios[c]:.1f}x)" for c, m in zip(ratios, moves))


FINDINGS = [
    ("Seq-Final sits below the earlier peaks of math and search (forgetting)", f1_forgetting),
    ("Sequential training is non-monotonic: a domain falls after a later stage and partly recovers", f2_non_monotonic),
    ("MMOPD and SDFT recover most of the forgotten math and search (≥ 0.8 of the peak)", f3_recovery),
    ("SDFT pays on the skills learned last (IF and e-commerce below Seq-Final)", f4_sdft_cost),
    ("Uniform merging keeps early skills, loses the last agentic one, and is the weakest consolidator on agentic tasks",
     f5_uniform_merge),
    ("MLE has the most balanced profile (the highest minimum over domains of score ÷ oracle)", f6_balance),
    ("Oracles specialise and do not transfer", f7_oracles),
    ("Low-entropy tokens stay ≥ 90% stable across stages; the change is carried by high-entropy tokens", f8_tokens),
    ("SFT moves the weights several times more than RL does", f9_sft_moves_more),
]


def check_findings(recs, eval_dir, analysis) -> list:
    """[(number, claim, verdict, the numbers that decide it)] for the nine findings."""
    m, _ = matrices(recs)
    out = []
    for i, (claim, fn) in enumerate(FINDINGS, 1):
        if fn is f6_balance:
            ok, text = fn(recs, eval_dir)
        elif fn in (f8_tokens, f9_sft_moves_more):
            ok, text = fn(analysis)
        else:
            ok, text = fn(recs, m)
        out.append((i, claim, verdict(ok), text))
    return out


# ----------------------------------------------------------------------------- finding 6's balance

def per_task(eval_dir: str, name: str, domains) -> dict:
    """{domain: (task ids, per-task scores)} of eval_dir/<name>.json's `<domain>/test` benchmarks."""
    from evaluate import load_results
    path = os.path.join(eval_dir, f"{name}.json")
    if not os.path.isfile(path):
        raise UsageError(f"no evaluation {path}: run evaluate.py on that checkpoint first")
    bench = load_results(path).get("benchmarks", {})
    out = {}
    for d in domains:
        b = bench.get(f"{d}/test")
        if not b or "per_task" not in b:
            raise UsageError(f"{path} has no per-task {d}/test scores")
        out[d] = (b["task_ids"], b["per_task"])
    return out


def balance(eval_dir: str, names: list, domains=DOMAINS, boots: int = 2000, seed: int = 0) -> dict:
    """{name: {"ratio": {domain: r}, "min": B, "boot": tensor of B over resamples}} (the module docstring's criterion);
    the oracles are eval_dir/oracle-<domain>.json."""
    oracle = {d: per_task(eval_dir, f"oracle-{d}", [d])[d] for d in domains}
    runs = {n: per_task(eval_dir, n, domains) for n in names}
    g = torch.Generator().manual_seed(seed)
    idx = {d: torch.randint(0, len(oracle[d][0]), (boots, len(oracle[d][0])), generator=g) for d in domains}
    out = {}
    for n, r in runs.items():
        ratios, boot = {}, []
        for d in domains:
            ids, o = oracle[d]
            if r[d][0] != ids:
                raise UsageError(f"{n} and the {d} oracle were scored on different {d}/test tasks")
            x, o = torch.tensor(r[d][1], dtype=torch.float64), torch.tensor(o, dtype=torch.float64)
            ratios[d] = (x.mean() / o.mean()).item()
            boot.append(x[idx[d]].mean(1) / o[idx[d]].mean(1))                      # (boots,)
        out[n] = {"ratio": ratios, "min": min(ratios.values()), "boot": torch.stack(boot).min(0).values}
    return out


def balance_verdict(res: dict, names: list, claim: str) -> tuple:
    """The claim's verdict (the module docstring's rule) -> (verdict, the runner-up or the leader it is compared
    with, the 95% bootstrap interval of the claim's balance minus that one's, the names ranked by balance)."""
    ranked = sorted(names, key=lambda n: -res[n]["min"])
    best, other = ranked[0], ranked[1] if ranked[0] == claim else ranked[0]
    diff = res[claim]["boot"] - res[other]["boot"]
    lo, hi = torch.quantile(diff, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    verdict = "does not hold" if best != claim else "holds" if lo > 0 else "not shown (first, but the interval holds 0)"
    return verdict, other, lo, hi, ranked


def balance_table(res: dict, names: list, claim: str, domains=DOMAINS) -> str:
    """The markdown table and the verdict on the claim."""
    lines = ["| checkpoint | " + " | ".join(f"{d} / oracle" for d in domains) + " | min (balance) ± bootstrap SE |",
             "|---" * (len(domains) + 2) + "|"]
    for n, v in res.items():
        lines.append(f"| {n} | " + " | ".join(f"{v['ratio'][d]:.2f}" for d in domains) +
                     f" | {v['min']:.2f} ± {v['boot'].std().item():.2f} |")
    if claim not in names:
        return "\n".join(lines)
    verdict, other, lo, hi, ranked = balance_verdict(res, names, claim)
    lines.append(f"\n{claim} − {other} (balance, paired bootstrap): {res[claim]['min'] - res[other]['min']:+.2f}, 95% "
                 f"interval [{lo:+.2f}, {hi:+.2f}]. The claim (the most balanced profile): **{verdict}** here ({claim} "
                 f"ranks {ranked.index(claim) + 1} of {len(names)}).")
    return "\n".join(lines)


def across_seeds(run_dirs) -> str:
    """The accuracy matrices of several runs of one recipe with different training seeds (each RUNS/eval/
    seq_matrix.json, made by evaluate.py on that run's checkpoints), as mean ± std over the runs for every cell,
    own-stage gain, forgetting, BWT and FWT, for the sampled score and the gold log-likelihood. The runs must share
    rows and domains. Saved beside the first run's matrix as seq_matrix_seeds.json; returns the tables."""
    from evaluate import METRIC_NAMES, load_results, save_results
    ms = []
    for d in run_dirs:
        path = os.path.join(d, "eval", "seq_matrix.json")
        if not os.path.isfile(path):
            raise UsageError(f"no accuracy matrix at {path}: evaluate that run's base and stages first")
        ms.append(load_results(path))
    if len({(tuple(m["rows"]), tuple(m["domains"])) for m in ms}) != 1:
        raise UsageError("the runs' matrices have different rows or domains: " + "; ".join(
            f"{d}: {m['rows']} x {m['domains']}" for d, m in zip(run_dirs, ms)))
    out, tables = {"runs": [os.path.abspath(d) for d in run_dirs]}, []
    for metric in ("score", "gold"):
        got = [m if metric == "score" else m.get("gold") for m in ms]
        if any(g is None for g in got):
            continue
        rows, domains = got[0]["rows"], got[0]["domains"]

        def spread(values):   # over_seeds as the JSON keeps it: [mean, std, seeds], None where a seed lacks the value
            m, s = over_seeds(values)
            return None if m is None else [m, s or 0.0, len(values)]
        agg = {"matrix": [[spread([g["matrix"][r][j] for g in got]) for j in range(len(domains))] for r in range(len(rows))],
               "gain": {d: spread([(g.get("gain") or {}).get(d, [None])[0] for g in got]) for d in domains},
               "forgetting": {d: spread([g["forgetting"].get(d) for g in got]) for d in domains},
               **{k: spread([g.get(k) for g in got]) for k in ("bwt", "fwt", "forgetting_mean")}}
        out[metric] = agg

        def f(x):
            return "–" if x is None else f"{x[0]:.3f} ± {x[1]:.3f}"
        lines = [f"{METRIC_NAMES[metric]}, mean ± std over {len(got)} training seeds:", "",
                 "| after \\ on | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]
        lines += [f"| {row} | " + " | ".join(f(x) for x in vals) + " |" for row, vals in zip(rows, agg["matrix"])]
        lines.append("| forgetting | " + " | ".join(f(agg["forgetting"][d]) for d in domains) + " |")
        lines.append("| own-stage gain | " + " | ".join(f(agg["gain"][d]) for d in domains) + " |")
        lines.append(f"\nBWT {f(agg['bwt'])} | FWT {f(agg['fwt'])} | mean forgetting {f(agg['forgetting_mean'])}")
        tables.append("\n".join(lines))
    save_results(os.path.join(run_dirs[0], "eval", "seq_matrix_seeds.json"), out)
    return "\n\n".join(tables)


# ----------------------------------------------------------------------------- report.md

def run_seeds(run: str) -> list:
    """The training seeds recorded in a run's sequential stages (acl_meta.json)."""
    metas = [read_meta(os.path.join(run, "seq", s)) for s in ("1-math", "2-search", "3-ecommerce", "4-if")]
    return sorted({m.get("seed") for m in metas if m} - {None})


def report(runs: str, out: str, seed_runs=()) -> str:
    """Write the report of the run in `runs` to `out` (markdown; plots linked relative to it); with `seed_runs` (the
    same study with other training seeds, arena.sh SEEDS > 1) every table gives mean ± std over the seeds and each
    finding is checked in every seed. -> out."""
    import json

    from evaluate import matrix_table
    all_runs = [runs, *seed_runs]
    recs_by_seed = []
    for r in all_runs:
        recs_by_seed.append(load_records(os.path.join(r, "eval")))
        if not recs_by_seed[-1]:
            raise UsageError(f"no evaluation records in {os.path.join(r, 'eval')}: run evaluate.py (arena.sh step 8) "
                             "first")
    recs, eval_dir = recs_by_seed[0], os.path.join(runs, "eval")
    tasks = [sorted({b["n"] for x in rs.values() for k, b in x["benchmarks"].items() if k.endswith("/test")})
             for rs in recs_by_seed]
    if any(t != tasks[0] for t in tasks):
        raise UsageError("the seeds' runs were evaluated on different task counts: " + ", ".join(
            f"{r} {t}" for r, t in zip(all_runs, tasks)))
    seeds = [", ".join(map(str, run_seeds(r))) or os.path.basename(os.path.abspath(r)) for r in all_runs]
    here = os.path.dirname(os.path.abspath(out))
    rel = lambda p: os.path.relpath(p, here)   # noqa: E731
    n = len(all_runs)
    spread = "the standard error over tasks" if n == 1 else \
        f"the std over the {n} training seeds (each seed's score its mean over the same tasks)"
    lines = [f"# ACLArena report: {os.path.basename(os.path.abspath(runs))}", "",
             f"Generated by `python report.py --runs {runs}" + (f" --seed-runs {' '.join(seed_runs)}" if seed_runs
                                                                 else "") +
             f"` on {time.strftime('%Y-%m-%d %H:%M')}, commit "
             f"{code_revision()}, {platform.machine()} {platform.system()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}. Training seed(s) {'; '.join(seeds)}; "
             f"{'/'.join(map(str, tasks[0]))} `test` tasks per domain, one sampling seed; ± is {spread}. Every number "
             f"below is read from the saved results; the criteria are fixed in report.py.", ""]
    lines += ["## The study's table", "", "In-domain (`test`) and out-of-domain (`ood`) score per domain; the best "
              "value of each column in bold.", "", study_table(recs_by_seed), ""]
    lines += ["## Normalised by each domain's best single checkpoint", "", "The scale-free form in which the tiny "
              "arena and the study's 8B numbers can be compared; the study's values in italics.", "",
              normalised_table(recs_by_seed), ""]
    if n > 1:
        lines += [f"## The accuracy matrix of the sequential run, over {n} training seeds", "",
                  across_seeds(all_runs), ""]
    else:
        m, g = matrices(recs)
        if m is not None:
            lines += ["## The accuracy matrix of the sequential run", "", matrix_table(m), ""]
            if any(x is not None for row in g["matrix"] for x in row):
                lines += [matrix_table(g), ""]
    plots = [("accuracy after each stage", os.path.join(eval_dir, "seq_matrix.png")),
             ("gold log-likelihood after each stage", os.path.join(eval_dir, "seq_matrix_gold.png")),
             ("PCA of the weight displacements", os.path.join(runs, "analysis", "pca.png")),
             ("cosines of the displacements", os.path.join(runs, "analysis", "cosine.png")),
             ("token consistency by entropy", os.path.join(runs, "analysis", "token_consistency.png"))]
    if os.path.isfile(os.path.join(runs, "mmopd", "acl_meta.json")):
        import mmopd
        kl = os.path.join(runs, "analysis", "mmopd_kl.png")
        try:
            mmopd.plot([os.path.join(runs, "mmopd")], kl)
            plots.append(("MMOPD's KL to each teacher", kl))
        except UsageError:
            pass
    shown = [(t, p) for t, p in plots if os.path.isfile(p)]
    if not os.path.abspath(runs).startswith(here + os.sep) and os.path.abspath(runs) != here:
        # a report kept outside its run (docs/tiny-report.md): its plots are copied beside it (docs/tiny-report/)
        import shutil
        folder = os.path.splitext(os.path.abspath(out))[0]
        os.makedirs(folder, exist_ok=True)
        shown = [(t, shutil.copyfile(p, os.path.join(folder, os.path.basename(p)))) for t, p in shown]
    if shown:
        lines += ["## Plots" + (" (the first training seed's run)" if n > 1 else ""), ""] + \
            [f"![{t}]({rel(p)})" for t, p in shown] + [""]
    def analysis_of(run):
        path = os.path.join(run, "analysis", "analysis.json")
        return json.load(open(path)) if os.path.isfile(path) else None
    checked = [check_findings(rs, os.path.join(r, "eval"), analysis_of(r)) for r, rs in zip(all_runs, recs_by_seed)]
    lines += ["## The study's findings, checked", ""]
    if n == 1:
        lines += ["| # | the study's claim | here | the numbers that decide it |", "|---|---|---|---|"]
        lines += [f"| {i} | {claim} | **{v}** | {text} |" for i, claim, v, text in checked[0]]
    else:   # each seed checked alone by the same criterion; the count of seeds where it holds, never a pooled verdict
        lines += [f"Each finding checked in each training seed's run by the same criterion; the count says in how many "
                  f"of the {n} it holds.", "", "| # | the study's claim | holds in | " +
                  " | ".join(f"seed {s}" for s in seeds) + " |", "|---" * (n + 3) + "|"]
        for j, (i, claim, _, _) in enumerate(checked[0]):
            vs = [c[j][2] for c in checked]
            lines.append(f"| {i} | {claim} | **{sum(v == 'holds' for v in vs)} of {n}** | " + " | ".join(vs) + " |")
        lines += ["", "The numbers that decide each finding, per seed:", "", "| # | seed | the numbers |", "|---|---|---|"]
        lines += [f"| {c[j][0]} | {s} | {c[j][3]} |" for j in range(len(checked[0]))
                  for c, s in zip(checked, seeds)]
    lines += ["", "Each criterion is written in report.py (FINDINGS, one function each) and was fixed before the run."]
    times = os.path.join(runs, "arena_times.md")
    if os.path.isfile(times):
        lines += ["", "## Time per step", "", "```", open(times).read().strip(), "```"]
    text = "\n".join(lines) + "\n"

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    write_file_atomically(out, write)
    return out


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="runs/tiny", help="the arena's run directory (its eval/, analysis/, ...)")
    p.add_argument("--out", default=None, help="where report.md goes (default <runs>/report.md)")
    p.add_argument("--seed-runs", nargs="+", default=[], metavar="RUNS", help="the same study with other training "
                   "seeds (arena.sh SEEDS > 1: runs/tiny-seed1 ...): every table as mean ± std over the seeds")
    p.add_argument("--balance", action="store_true", help="print finding 6's table alone (from --eval-dir)")
    p.add_argument("--eval-dir", default=None, help="with --balance: where evaluate.py saved the records "
                                                    "(default <runs>/eval)")
    p.add_argument("--names", nargs="+", default=["seq-4-if", "sdft", "mmopd", "mle"], help="--balance: the competitors")
    p.add_argument("--extra", nargs="*", default=[], help="--balance: checkpoints shown beside them, not competed")
    p.add_argument("--claim", default="mle", help="--balance: the checkpoint the study claims is the most balanced")
    p.add_argument("--boot", type=int, default=2000, help="--balance: bootstrap resamples")
    a = p.parse_args(argv)
    try:
        if a.boot < 100:
            raise UsageError("--boot must be >= 100")
        if a.balance:
            res = balance(a.eval_dir or os.path.join(a.runs, "eval"), a.names + a.extra, boots=a.boot)
            print(balance_table(res, a.names, a.claim))
        else:
            for r in [a.runs, *a.seed_runs]:
                if not os.path.isdir(r):
                    raise UsageError(f"no run directory {r}: run arena.sh first")
            print(f"wrote {report(a.runs, a.out or os.path.join(a.runs, 'report.md'), a.seed_runs)}")
    except UsageError as e:
        usage_exit(e)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
