"""The study's findings checked against a run's saved evaluations (runs/<preset>/eval/*.json). So far one finding,
the study's claim for MLE: the most balanced profile, i.e. the highest minimum over domains of score / oracle.

    python report.py --balance --eval-dir runs/tiny/eval --names seq-4-if sdft mmopd mle --extra mle-learned

The criterion, fixed in code before any run: for checkpoint c and domain d, r(c, d) = c's mean score on d's `test`
tasks / the d oracle's mean score on the same tasks (same sampling seeds); the balance B(c) = min over d of r(c, d).
Its spread is a paired bootstrap over tasks: every resample draws each domain's tasks with replacement, once, for all
checkpoints and the oracle alike (--boot resamples, seed 0). The claim holds when the named checkpoint (--claim, MLE
by default) has the highest B among --names and the 2.5% quantile of its bootstrap difference to the runner-up is > 0;
it does not hold when another has the highest B; first without that margin is "not shown". --extra: shown, not competed.
"""
import argparse
import os
import sys

import torch

from common import Parser, UsageError, usage_exit
from envs import DOMAINS


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


def balance_table(res: dict, names: list, claim: str, domains=DOMAINS) -> str:
    """The markdown table and the verdict on the claim."""
    lines = ["| checkpoint | " + " | ".join(f"{d} / oracle" for d in domains) + " | min (balance) ± bootstrap SE |",
             "|---" * (len(domains) + 2) + "|"]
    for n, v in res.items():
        lines.append(f"| {n} | " + " | ".join(f"{v['ratio'][d]:.2f}" for d in domains) +
                     f" | {v['min']:.2f} ± {v['boot'].std().item():.2f} |")
    ranked = sorted(names, key=lambda n: -res[n]["min"])
    if claim not in names:
        return "\n".join(lines)
    best, other = ranked[0], ranked[1] if ranked[0] == claim else ranked[0]
    diff = res[claim]["boot"] - res[other]["boot"]
    lo, hi = torch.quantile(diff, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    verdict = "does not hold" if best != claim else "holds" if lo > 0 else "not shown (first, but the interval holds 0)"
    lines.append(f"\n{claim} − {other} (balance, paired bootstrap): {res[claim]['min'] - res[other]['min']:+.2f}, 95% "
                 f"interval [{lo:+.2f}, {hi:+.2f}]. The claim (the most balanced profile): **{verdict}** here ({claim} "
                 f"ranks {ranked.index(claim) + 1} of {len(names)}).")
    return "\n".join(lines)


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--balance", action="store_true", help="the balanced-profile finding (the only one so far)")
    p.add_argument("--eval-dir", default="runs/tiny/eval", help="where evaluate.py saved the records")
    p.add_argument("--names", nargs="+", default=["seq-4-if", "sdft", "mmopd", "mle"], help="the competing checkpoints")
    p.add_argument("--extra", nargs="*", default=[], help="checkpoints shown beside them, not competed")
    p.add_argument("--claim", default="mle", help="the checkpoint the study claims is the most balanced")
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples")
    a = p.parse_args(argv)
    try:
        if not a.balance:
            raise UsageError("say what to check: --balance")
        if a.boot < 100:
            raise UsageError("--boot must be >= 100")
        res = balance(a.eval_dir, a.names + a.extra, boots=a.boot)
    except UsageError as e:
        usage_exit(e)
    print(balance_table(res, a.names, a.claim))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
