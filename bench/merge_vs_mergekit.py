"""The same task-arithmetic merge with merge.py and with mergekit (mergekit-yaml), side by side: wall time, peak
RSS of each process, and the largest absolute difference between the two merged checkpoints.

    pip install mergekit==0.1.5 && python bench/merge_vs_mergekit.py                     # the tiny arena's stages
    python bench/merge_vs_mergekit.py --synthetic-mb 400 --models 4                      # 4 + 1 random 400 MB models
    python bench/merge_vs_mergekit.py --sides ours --synthetic-mb 1 --models 2 --repeats 1   # merge.py alone (tests)

With runs/tiny/seq/ present it merges the four sequential stages onto runs/tiny/base; otherwise (or with
--synthetic-mb) it writes K + 1 random Qwen3 checkpoints of about that size (float32), the task vectors being
small perturbations of the base. mergekit's task_arithmetic with normalize false and lambda 1 computes
theta_0 + sum_k w_k (theta_k - theta_0), the formula merge.py implements; both run as separate processes
(peak RSS from wait4; this process imports nothing heavy before they run), one after the other, --repeats times, and the best time of each is printed.
Target: the outputs agree within 1e-6 in float32, and merge.py is no slower and uses no more memory.
With --sides ours (or mergekit) only that side runs, so no difference or ratio is printed: merge.py's own figures
without mergekit installed.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def synthetic(root: str, k: int, megabytes: float, seed: int = 0) -> tuple:
    """K + 1 random float32 Qwen3 checkpoints of about `megabytes` each: (base, [models])."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    hidden = 256
    layers = max(1, round(megabytes * 1024 ** 2 / 4 / (12 * hidden * hidden)))
    cfg = Qwen3Config(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    base = os.path.join(root, "base")
    model.save_pretrained(base)
    models = []
    for i in range(k):
        with torch.no_grad():
            sd = {n: p + 0.01 * torch.randn_like(p) for n, p in model.state_dict().items()}
        m = Qwen3ForCausalLM(cfg)
        m.load_state_dict(sd, strict=False)
        path = os.path.join(root, f"m{i}")
        m.save_pretrained(path)
        models.append(path)
    return base, models


def run(cmd: list) -> tuple:
    """(wall seconds, peak RSS in MB) of one child process; stops on failure."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    out = proc.stdout.read().decode(errors="replace")
    if status != 0:
        sys.exit(f"error: {' '.join(cmd[:3])} ... failed:\n{out[-2000:]}")
    return time.time() - t0, usage.ru_maxrss / 1024


def max_diff(a: str, b: str) -> float:
    from safetensors import safe_open

    from acl.common import shard_files
    fa, fb = shard_files(a), shard_files(b)
    worst = 0.0
    for name, path in fa.items():
        with safe_open(path, "pt") as x, safe_open(fb[name], "pt") as y:
            worst = max(worst, (x.get_tensor(name).float() - y.get_tensor(name).float()).abs().max().item())
    return worst


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="runs/tiny", help="arena run directory whose base and seq stages are merged")
    p.add_argument("--synthetic-mb", type=float, default=0, help="use random checkpoints of this size instead")
    p.add_argument("--models", type=int, default=4, help="synthetic: number of models merged")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side; the best is printed")
    p.add_argument("--sides", default="both", choices=["both", "ours", "mergekit"],
                   help="run both sides (the comparison), or one alone: ours needs no mergekit (the tests' smoke run)")
    a = p.parse_args()
    if a.sides != "ours" and shutil.which("mergekit-yaml") is None:
        sys.exit("error: mergekit-yaml not found: pip install mergekit==0.1.5 (or --sides ours)")
    work = tempfile.mkdtemp(prefix="merge-bench-")
    try:
        stages = [os.path.join(ROOT, a.runs, "seq", s) for s in ("1-math", "2-search", "3-ecommerce", "4-if")]
        if not a.synthetic_mb and all(os.path.isdir(s) for s in stages):
            base, models = os.path.join(ROOT, a.runs, "base"), stages
            what = f"{a.runs}: base + 4 sequential stages"
        else:
            # in a child process: a forked child's peak RSS counts the parent's memory at the fork, so this
            # process stays small (no torch imported) until both sides have run
            code = f"import sys; sys.path.insert(0, {ROOT + '/bench'!r}); from merge_vs_mergekit import synthetic; " \
                   f"synthetic({work!r}, {a.models}, {a.synthetic_mb or 20})"
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
            base, models = os.path.join(work, "base"), [os.path.join(work, f"m{i}") for i in range(a.models)]
            what = f"synthetic: base + {len(models)} models of ~{a.synthetic_mb or 20:.0f} MB"
        weights = [round(1.0 / len(models), 6)] * len(models)
        config = {"merge_method": "task_arithmetic", "base_model": base, "dtype": "float32",
                  "parameters": {"normalize": False, "lambda": 1.0},
                  "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, weights)]}
        yml = os.path.join(work, "merge.yml")
        with open(yml, "w") as f:
            json.dump(config, f)   # JSON is YAML
        ours_out, theirs_out = os.path.join(work, "ours"), os.path.join(work, "mergekit")
        ours = [sys.executable, "merge.py", "--base", base, "--models", *models, "--weights",
                *map(str, weights), "--method", "task_arithmetic", "--out", ours_out]
        theirs = ["mergekit-yaml", yml, theirs_out, "--copy-tokenizer", "--allow-crimes", "--lazy-unpickle",
                  "--out-shard-size", "2B"]
        sides = {"ours": ("merge.py", ours, ours_out), "mergekit": ("mergekit", theirs, theirs_out)}
        sides = [v for k, v in sides.items() if a.sides in ("both", k)]
        best = {name: (1e9, 0) for name, _, _ in sides}
        for _ in range(a.repeats):
            for name, cmd, out in sides:
                shutil.rmtree(out, ignore_errors=True)
                t, rss = run(cmd)
                best[name] = (min(best[name][0], t), max(best[name][1], rss))
        print(f"task_arithmetic merge, {what}, best of {a.repeats}")
        print(f"{'':10s} {'wall s':>8s} {'peak RSS MB':>12s}")
        for name, (t, rss) in best.items():
            print(f"{name:10s} {t:8.2f} {rss:12.0f}")
        if len(best) < 2:
            return
        diff = max_diff(ours_out, theirs_out)
        t_ratio = best["merge.py"][0] / best["mergekit"][0]
        m_ratio = best["merge.py"][1] / best["mergekit"][1]
        print(f"ratio merge.py / mergekit: time {t_ratio:.2f}, memory {m_ratio:.2f}; max |difference| {diff:.2e} "
              f"(target: <= 1e-6, ratios <= 1)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
