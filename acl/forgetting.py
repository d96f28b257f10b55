"""The study's statistics on evaluate.py's records: a domain's in-domain cell, paired differences over the same tasks
with their standard errors, the accuracy matrix of a sequential run with forgetting, BWT and FWT (GEM, Lopez-Paz &
Ranzato 2017), the markdown tables and the heatmap. Nothing here trains or samples, and importing it imports no
torch: evaluate.py, report.py and analyze.py read the same numbers through it.

    from acl.forgetting import accuracy_matrix, load_results, matrix_table
    m = accuracy_matrix([("seq-1-math", "math", load_results("runs/tiny/eval/seq-1-math.json")), ...], base, DOMAINS)
    print(matrix_table(m))
"""
import json
import math
import statistics

# Full-suite benchmark -> domain, in the paper's table order.
FULL_BENCHMARKS = {"aime26": "math", "gpqa_diamond": "math", "mmlu_redux": "math",
                   "nq": "search", "triviaqa": "search", "popqa": "search", "hotpotqa": "search",
                   "2wikimultihopqa": "search", "musique": "search", "bamboogle": "search",
                   "tau_retail": "ecommerce", "tau_mock": "ecommerce", "tau_telecom": "ecommerce",
                   "ifeval": "if", "ifbench": "if"}
# The study's search columns beside NQ (in-domain): single-hop and multi-hop averages over these benchmarks.
SEARCH_GROUPS = {"single_hop": ("triviaqa", "popqa"),
                 "multi_hop": ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle")}
# The in-domain benchmark of each domain: the accuracy matrix's columns (tiny: `<domain>/test`).
FULL_IN_DOMAIN = {"math": "aime26", "search": "nq", "ecommerce": "tau_retail", "if": "ifeval"}


def load_results(path) -> dict:
    with open(path) as f:
        return json.load(f)


def benchmarks_of(results) -> dict:
    """{benchmark: {...}} of either a saved record or evaluate_model's output."""
    return results["benchmarks"] if isinstance(results.get("benchmarks"), dict) else results


def bench_domain(name) -> str:
    """The domain of a benchmark: FULL_BENCHMARKS', or the tiny suite's `<domain>/<split>` prefix (`mixed/test`: mixed)."""
    return FULL_BENCHMARKS.get(name) or name.split("/")[0]


def group_averages(benchmarks) -> dict:
    """The study's search columns: {group: {mean, std, n, of}} for each SEARCH_GROUPS group whose benchmarks were all
    evaluated: per seed the unweighted mean of the members' scores, then mean and sample std over seeds."""
    out = {}
    for group, members in SEARCH_GROUPS.items():
        if not all(m in benchmarks for m in members):
            continue
        per_seed = [statistics.mean(vals) for vals in zip(*(benchmarks[m]["per_seed"] for m in members))]
        out[group] = {"mean": statistics.mean(per_seed), "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
                      "n": sum(benchmarks[m]["n"] for m in members), "of": list(members), "per_seed": per_seed}
    return out


def markdown_table(named_results) -> str:
    """Rows: checkpoints ({name: results}), columns: every benchmark seen, then the search groups' averages where all
    their members were evaluated (single_hop, multi_hop: group_averages), cells `mean ± std`."""
    columns = []
    for r in named_results.values():
        b = benchmarks_of(r)
        columns += [c for c in [*b, *group_averages(b)] if c not in columns]
    lines = ["| checkpoint | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, r in named_results.items():
        b = benchmarks_of(r)
        b = {**b, **group_averages(b)}
        cells = [f"{b[c]['mean']:.3f} ± {b[c]['std']:.3f}" if c in b else "–" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def domain_cell(results, domain, metric: str = "score"):
    """A domain's in-domain value in results, `<domain>/test` (tiny) or its FULL_IN_DOMAIN benchmark, as
    (mean, {task id: per-task value} or None); (None, None) if absent. metric: "score" (the sampled score) or
    "gold" (the mean gold log-likelihood per agent token, gold_likelihood)."""
    b = benchmarks_of(results or {})
    for key in (f"{domain}/test", FULL_IN_DOMAIN.get(domain)):
        if key in b:
            r = b[key]
            if metric == "gold":
                g = r.get("gold")
                return (g["loglik"], dict(zip(g["task_ids"], g["per_task_loglik"]))) if g else (None, None)
            per = dict(zip(r["task_ids"], r["per_task"])) if r.get("per_task") and r.get("task_ids") else None
            return r["mean"], per
    return None, None


def standard_error(values):
    """The standard error of a mean over `values` (per-task scores or paired differences); None for fewer than 2."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def paired_difference(x, y):
    """y - x for two domain_cell values of the same benchmark, paired: per task (the same tasks, and for sampled
    scores the same sampling seeds), then the mean and its standard error over tasks.
    -> (difference, standard error); the SE is None without per-task values on the same tasks."""
    if x[0] is None or y[0] is None:
        return None, None
    if x[1] and y[1] and set(x[1]) == set(y[1]):
        d = [y[1][t] - x[1][t] for t in x[1]]
        return statistics.mean(d), standard_error(d)
    return y[0] - x[0], None


def _mean_se(pairs):
    """Mean of independent differences [(d, se)] and its SE (None if any SE is unknown)."""
    pairs = [p for p in pairs if p[0] is not None]
    if not pairs:
        return None, None
    se = None if any(p[1] is None for p in pairs) else math.sqrt(sum(p[1] ** 2 for p in pairs)) / len(pairs)
    return sum(p[0] for p in pairs) / len(pairs), se


def accuracy_matrix(stage_results, base_results, domains, metric: str = "score") -> dict:
    """The accuracy matrix of a sequential run and its continual-learning measures (GEM, Lopez-Paz & Ranzato 2017).

    stage_results: [(row name, learned domain, results), ...] in curriculum order, e.g. ("seq-1-math", "math", r);
    base_results: the base's results (None if unknown); domains: the columns; metric: "score" (sampled) or "gold"
    (gold log-likelihood per agent token, domain_cell). Rows r = 0 (base), 1..T (stages); a[r, j] is domain j's
    in-domain value after row r (None where missing); t_j is the row that learned domain j. Missing values are
    left out of every mean. For each learned domain j in the columns:
        gain_j       = a[t_j, j] - a[t_j - 1, j]                      (what its own stage did)
        forgetting_j = max_{t_j <= r <= T} a[r, j] - a[T, j]          (0 for the domain learned last)
        BWT          = mean over j with t_j < T      of  a[T, j] - a[t_j, j]
        FWT          = mean over j with t_j > 1      of  a[t_j - 1, j] - a[0, j]
    forgetting_mean is the mean of forgetting_j over j with t_j < T. BWT < 0 means later stages forgot; FWT > 0
    means earlier stages helped a domain before it was trained (measured against the base, not a random model).
    Every difference is paired over the same tasks (paired_difference) and comes with its standard error (None
    without per-task values); a mean of differences over domains has the root-sum-square SE over their count.
    Forgetting's peak is the highest row, so it leans upward by chance: compare it with its SE.
    Returns {metric, rows, domains, learned, matrix, se, gain, forgetting, forgetting_se, forgetting_mean,
    forgetting_mean_se, bwt, bwt_se, fwt, fwt_se}."""
    learned = [d for _, d, _ in stage_results]
    if len(set(learned)) != len(learned):
        raise ValueError(f"a domain is learned twice in {learned}: forgetting and transfer are undefined")
    rows = ["base"] + [name for name, _, _ in stage_results]
    cells = [[domain_cell(r, d, metric) for d in domains] for r in [base_results] + [r for _, _, r in stage_results]]
    a = [[c[0] for c in row] for row in cells]
    se = [[standard_error(list(c[1].values())) if c[1] else None for c in row] for row in cells]
    T = len(rows) - 1
    t = {d: i + 1 for i, d in enumerate(learned) if d in domains}
    gain, forgetting, forgetting_se, bwt, fwt, fmean = {}, {}, {}, [], [], []
    for d, tj in t.items():
        j = domains.index(d)
        gain[d] = paired_difference(cells[tj - 1][j], cells[tj][j])
        after = [r for r in range(tj, T + 1) if a[r][j] is not None]
        if after and a[T][j] is not None:
            peak = max(after, key=lambda r: a[r][j])
            forgetting[d], forgetting_se[d] = paired_difference(cells[T][j], cells[peak][j]) if peak != T else (0.0, 0.0)
            if tj < T:
                fmean.append((forgetting[d], forgetting_se[d]))
        else:
            forgetting[d], forgetting_se[d] = None, None
        if tj < T:
            bwt.append(paired_difference(cells[tj][j], cells[T][j]))
        if tj > 1:
            fwt.append(paired_difference(cells[0][j], cells[tj - 1][j]))
    (fm, fm_se), (b, b_se), (f, f_se) = _mean_se(fmean), _mean_se(bwt), _mean_se(fwt)
    return {"metric": metric, "rows": rows, "domains": list(domains), "learned": {d: rows[tj] for d, tj in t.items()},
            "matrix": a, "se": se, "gain": gain, "forgetting": forgetting, "forgetting_se": forgetting_se,
            "forgetting_mean": fm, "forgetting_mean_se": fm_se, "bwt": b, "bwt_se": b_se, "fwt": f, "fwt_se": f_se}


def _fmt(x, se=None):
    return "–" if x is None else f"{x:.3f}" + ("" if se is None else f" ± {se:.3f}")

METRIC_NAMES = {"score": "sampled score", "gold": "gold log-likelihood per agent token"}


def matrix_table(m) -> str:
    """The accuracy matrix as markdown (value ± SE where per-task values exist), the forgetting row, each stage's
    gain on its own domain, and a BWT/FWT line."""
    se = m.get("se") or [[None] * len(m["domains"]) for _ in m["rows"]]
    fse = m.get("forgetting_se", {})
    lines = [f"{METRIC_NAMES.get(m.get('metric', 'score'))}:", "",
             "| after \\ on | " + " | ".join(m["domains"]) + " |", "|---" * (len(m["domains"]) + 1) + "|"]
    lines += [f"| {row} | " + " | ".join(_fmt(x, e) for x, e in zip(vals, ses)) + " |"
              for row, vals, ses in zip(m["rows"], m["matrix"], se)]
    lines.append("| forgetting | " + " | ".join(_fmt(m["forgetting"].get(d), fse.get(d)) for d in m["domains"]) + " |")
    if m.get("gain"):
        lines.append("| own-stage gain | " + " | ".join(_fmt(*m["gain"][d]) if d in m["gain"] else "–"
                                                      for d in m["domains"]) + " |")
    lines.append(f"\nBWT {_fmt(m['bwt'], m.get('bwt_se'))} | FWT {_fmt(m['fwt'], m.get('fwt_se'))} | mean forgetting "
                 f"{_fmt(m['forgetting_mean'], m.get('forgetting_mean_se'))} (± standard errors over tasks, paired)")
    src = m.get("sources", {})
    earlier = [f"{row} <- {src[row]}" for row in m["rows"] if src.get(row, "this run") != "this run"]
    if earlier:   # rows not evaluated now, with their file and task count (an in-run record has fewer tasks)
        lines.append("rows from saved results: " + ", ".join(earlier))
    return "\n".join(lines)


def plot_matrix(m, path, title="accuracy after each stage"):
    """A heatmap PNG of accuracy_matrix()'s matrix (rows: base then stages, columns: domains), values written in."""
    import numpy as np

    from acl.common import pyplot, save_figure  # (the file-only backend, the atomic write; acl.common imports torch)
    plt = pyplot()
    data = np.array([[np.nan if x is None else x for x in row] for row in m["matrix"]], dtype=float)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(m["domains"]), 1.2 + 0.5 * len(m["rows"])))
    # tiny-arena scores sit far below 1: scale the colours to the largest score so differences show; a
    # log-likelihood (negative) spans its own range
    values = [x for row in m["matrix"] for x in row if x is not None]
    low = 0.0 if m.get("metric", "score") == "score" else min(values + [-1.0])
    top = max(values + [low + 0.05])
    im = ax.imshow(data, cmap="viridis", vmin=low, vmax=top, aspect="auto")
    ax.set_xticks(range(len(m["domains"])), m["domains"])
    ax.set_yticks(range(len(m["rows"])), m["rows"])
    ax.set_xlabel(f"{METRIC_NAMES.get(m.get('metric', 'score'))} on in-domain test")
    ax.set_ylabel("after stage")
    for r, row in enumerate(m["matrix"]):
        for j, x in enumerate(row):
            ax.text(j, r, _fmt(x), ha="center", va="center", color="k" if x is None or x - low >= 0.6 * (top - low)
                    else "w", fontsize=9)
    ax.set_title(f"{title}\nBWT {_fmt(m['bwt'])}  FWT {_fmt(m['fwt'])}", fontsize=10)
    fig.colorbar(im, ax=ax)
    return save_figure(fig, path)
