"""Model merging (MM), the parameter-space consolidator: task vectors tau_k = theta_k - theta_0 of the stage
checkpoints are added back onto the base, theta_merge = theta_0 + sum_k lambda_k tau_k, one tensor at a time.

    python merge.py --base runs/tiny/base --models runs/tiny/seq/{1-math,2-search,3-ecommerce,4-if} \\
        --weights 0.25 0.25 0.25 0.25 --method task_arithmetic --out runs/tiny/merge/task_arithmetic
    python merge.py --base runs/tiny/base --models runs/tiny/seq/[0-9]-* --search grid --out runs/tiny/merge/grid
    python merge.py --base runs/tiny/base --models runs/tiny/seq/[0-9]-* --search balanced \\
        --oracles runs/tiny/oracle/{math,search,ecommerce,if} --out runs/tiny/merge/balanced

Full scale is the same command on Qwen3-8B checkpoints; it needs no GPU and no torchrun: the merge streams
over the safetensors shards and holds one tensor per input in memory, never K + 1 models (plus float32 work
space for that tensor: 3 copies for the linear methods, K + 3 for TIES's sign election).
Methods (per tensor; `density` is the fraction of a task vector kept):
  task_arithmetic  theta_0 + sum_k lambda_k tau_k
  ties             trim each tau_k to its top-density entries by magnitude, elect each entry's sign as the sign
                   of sum_k lambda_k tau_k (trimmed), and average the agreeing entries weighted by lambda_k
                   (the disjoint mean: divided by the sum of the agreeing lambda_k)
  dare_linear      drop each entry of tau_k with probability 1 - density and rescale the kept ones by
                   1 / density (seeded), then task arithmetic
  dare_ties        DARE's drop and rescale, then TIES's sign election and disjoint mean
Weight search (instead of --weights): uniform (lambda_k = 1/K); grid (a simplex grid with step --grid-step,
each candidate scored by evaluate.py on every domain's `val` tasks, never `test`; the best mean wins);
balanced (the same grid, maximising the minimum over domains of the score divided by that domain's oracle
score on the same tasks). Every candidate is printed; the winner and its lambda go into acl_meta.json.

Differences from the paper:
1. The paper merges with task arithmetic only; TIES and DARE are here to compare against.
2. The paper does not say how lambda was chosen; the three search modes are this codebase's.
"""
import argparse
import itertools
import json
import math
import os
import shutil
import sys
import time

import torch

from acl.common import (
    DTYPES,
    Parser,
    check_output,
    eta,
    identity,
    is_checkpoint,
    read_meta,
    read_tensor,
    same_tensors,
    tensor_infos,
    usage_exit,
    write_atomically,
    write_meta,
)
from envs import DOMAINS, parse_domains
from envs.base import UsageError

METHODS = ("task_arithmetic", "ties", "dare_linear", "dare_ties")
SEARCHES = ("uniform", "grid", "balanced")
SAVE_DTYPES = {"fp32": "F32", "bf16": "BF16", "base": None}
COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json")


# ----------------------------------------------------------------------------- the merge of one tensor

def trim_top(tau: torch.Tensor, density: float) -> torch.Tensor:
    """TIES's trim: keep the density fraction of entries with the largest magnitude, zero the rest."""
    k = int(density * tau.numel())
    if k >= tau.numel():
        return tau
    if k <= 0:
        return torch.zeros_like(tau)
    threshold = tau.abs().flatten().kthvalue(tau.numel() - k).values  # the (n-k)-th smallest magnitude
    return tau * (tau.abs() > threshold)


def dare_drop(tau: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: drop each entry with probability 1 - density, rescale the survivors by 1 / density."""
    if density >= 1:
        return tau
    keep = torch.rand(tau.shape, generator=generator) < density
    return tau * keep / density


def merge_tensor(base: torch.Tensor, models: list, weights: list, method: str, density: float = 1.0,
                 generator: torch.Generator | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """theta_0 plus the merged task vectors of one tensor, computed in float32, returned in `dtype` (default: base's)."""
    theta0, dtype = base.float(), dtype or base.dtype
    if method in ("task_arithmetic", "dare_linear"):  # linear: one float32 task vector at a time
        delta = torch.zeros_like(theta0)
        for m, wk in zip(models, weights):
            tau = m.float() - theta0
            delta += wk * (dare_drop(tau, density, generator) if method == "dare_linear" else tau)
        return (theta0 + delta).to(dtype)
    # TIES: the sign election needs every task vector of this tensor at once
    taus = [m.float() - theta0 for m in models]                       # K x (tensor shape)
    taus = [trim_top(t, density) if method == "ties" else dare_drop(t, density, generator) for t in taus]
    w = torch.tensor(weights, dtype=torch.float32).view(-1, *[1] * theta0.dim())  # (K, 1, ...)
    weighted = torch.stack(taus) * w                                  # (K, ...)
    sign = torch.where(weighted.sum(0) >= 0, 1.0, -1.0)               # the elected sign per entry
    agree = (torch.sign(weighted) == sign).float()                    # (K, ...): zeros never agree
    divisor = (w * agree).sum(0)
    merged = (weighted * agree).sum(0) / torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    return (theta0 + merged).to(dtype)


# ----------------------------------------------------------------------------- streaming over checkpoints
def check_inputs(base: str, models: list) -> dict:
    """Stop with one clear line unless every checkpoint exists and has the base's architecture and tensors.
    Returns {checkpoint: {tensor name: file}}."""
    for ckpt in [base, *models]:
        if not is_checkpoint(ckpt):
            raise UsageError(f"not a checkpoint directory (no config.json): {ckpt}")
    with open(os.path.join(base, "config.json")) as f:
        cfg0 = json.load(f)
    for m in models:
        with open(os.path.join(m, "config.json")) as f:
            cfg = json.load(f)
        for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings"):
            if cfg.get(key) != cfg0.get(key):
                raise UsageError(f"mismatched architectures: {m} has {key}={cfg.get(key)!r}, the base {cfg0.get(key)!r}")
    return same_tensors(base, models)


def plan_shards(infos: dict, shard_bytes: int) -> list:
    """[[name, ...], ...]: the output tensors in name order, cut into shards of about shard_bytes."""
    shards, size = [[]], 0
    for name in sorted(infos):
        start, end = infos[name]["data_offsets"]
        if shards[-1] and size + end - start > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += end - start
    return shards


def stream_merge(base: str, models: list, weights: list, method: str, out_dir: str, density: float = 1.0,
                 seed: int = 0, shard_bytes: int = 2 * 1024 ** 3, files: dict | None = None, dtype: str = "F32") -> dict:
    """Merge tensor by tensor into out_dir's safetensors (weights only; write_merge makes the whole
    checkpoint). dtype: the floating-point tensors' safetensors dtype (F32: a merge of bf16 inputs keeps what
    lambda = 1/4 of a one-bf16-step task vector adds, which a bf16 output would round away; None: the base's).
    Returns {tensor name: file}."""
    files = files or check_inputs(base, models)
    infos = {}
    for name, info in tensor_infos(files[base]).items():   # the output's dtype and byte size per tensor
        out = dtype if dtype and DTYPES[info["dtype"]].is_floating_point else info["dtype"]
        size = math.prod(info["shape"]) * DTYPES[out].itemsize
        infos[name] = dict(info, dtype=out, data_offsets=[0, size])
    headers = {}
    generator = torch.Generator().manual_seed(seed)   # DARE's drops: one stream, tensors in name order
    shards = plan_shards(infos, shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            start, end = infos[name]["data_offsets"]
            header[name] = {"dtype": infos[name]["dtype"], "shape": infos[name]["shape"],
                            "data_offsets": [offset, offset + end - start]}
            offset += end - start
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)   # the data section starts 8-byte aligned
        with open(os.path.join(out_dir, file), "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name in names:
                t = merge_tensor(read_tensor(files[base][name], name, headers),
                                 [read_tensor(files[m][name], name, headers) for m in models],
                                 weights, method, density, generator, DTYPES[infos[name]["dtype"]])
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                weight_map[name] = file
    if len(shards) > 1:
        total = sum(e - s for s, e in (infos[n]["data_offsets"] for n in infos))
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return weight_map


def write_merge(base, models, weights, method, out, density=1.0, seed=0, meta=None, shard_bytes=2 * 1024 ** 3,
                files=None, dtype="F32") -> str:
    """A whole merged checkpoint at `out`: streamed weights (in `dtype`, see stream_merge), the first model's config
    (its dtype set to the output's, so that vLLM and dtype="auto" load it as written) and tokenizer files,
    acl_meta.json; written to a temporary directory and renamed into place."""
    def write(tmp):
        stream_merge(base, models, weights, method, tmp, density, seed, shard_bytes, files, dtype)
        for name in COPY_FILES:
            if os.path.isfile(os.path.join(models[0], name)):
                shutil.copy(os.path.join(models[0], name), os.path.join(tmp, name))
        if dtype and os.path.isfile(os.path.join(tmp, "config.json")):
            with open(os.path.join(tmp, "config.json")) as f:
                cfg = json.load(f)
            cfg["dtype"] = str(DTYPES[dtype]).removeprefix("torch.")
            cfg.pop("torch_dtype", None)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
        write_meta(tmp, dict(meta or {}, method="merge", stage=f"merge-{method}", parent=os.path.abspath(base),
                             merge=dict(method=method, models=[os.path.abspath(m) for m in models],
                                        weights=list(weights), density=density, seed=seed)))
    return write_atomically(out, write)


# ----------------------------------------------------------------------------- weight search

def simplex_grid(k: int, step: float) -> list:
    """Every lambda in the simplex (lambda_k >= 0, sum 1) on a grid of the given step, uniform first."""
    n = round(1 / step)
    points = [tuple(c / n for c in combo) for combo in itertools.product(range(n + 1), repeat=k) if sum(combo) == n]
    uniform = tuple([1.0 / k] * k)
    return [uniform] + [p for p in points if max(abs(a - b) for a, b in zip(p, uniform)) > 1e-9]


def val_scores(ckpt: str, tasks: dict, domains: list, batch: int) -> dict:
    """{domain: score} of a checkpoint on the search's validation tasks (evaluate.py, one seed)."""
    from evaluate import evaluate_ckpt
    res = evaluate_ckpt(ckpt, tasks=tasks, seeds=[0], batch=batch, label=f"[{os.path.basename(ckpt)}] ")["benchmarks"]
    return {d: res[f"{d}/val"]["mean"] for d in domains}


def objective(scores: dict, mode: str, oracle: dict | None) -> float:
    """grid: the mean over domains; balanced: the minimum over domains of score / oracle score, over the
    domains whose oracle scores above zero (a zero oracle cannot be normalised by)."""
    if mode != "balanced":
        return sum(scores.values()) / len(scores)
    ratios = [scores[d] / oracle[d] for d in scores if oracle[d] > 0]
    return min(ratios) if ratios else 0.0


def search_weights(a, files) -> tuple:
    """-> (the winning lambda, every candidate as (lambda, scores, objective), the oracles' val scores or None)
    for --search grid|balanced."""
    from evaluate import load_benchmarks
    tasks = load_benchmarks("tiny", a.domains, ("val",), a.search_n)
    oracle = None
    if a.search == "balanced":
        oracle = {}
        for d, ckpt in zip(a.domains, a.oracles):
            oracle[d] = val_scores(ckpt, {f"{d}/val": tasks[f"{d}/val"]}, [d], a.batch)[d]
        print(f"oracle val scores: {json.dumps(oracle)}", flush=True)
        if not any(v > 0 for v in oracle.values()):
            raise UsageError("balanced search: every oracle scores 0 on its val tasks; nothing to normalise by")
        skipped = [d for d, v in oracle.items() if v <= 0]
        if skipped:
            print(f"balanced search: oracle score 0 on {', '.join(skipped)}; those domains are left out of the min")
    tried = reused_candidates(a, oracle) if a.scores_from else []
    scratch = os.path.join(os.path.dirname(os.path.abspath(a.out)), f".search-{os.path.basename(a.out)}-{os.getpid()}")
    try:
        grid, start = [] if tried else simplex_grid(len(a.models), a.grid_step), time.time()
        for i, lam in enumerate(grid, 1):
            t0 = time.time()
            write_merge(a.base, a.models, lam, a.method, scratch, a.density, a.seed, files=files)
            scores = val_scores(scratch, tasks, a.domains, a.batch)
            obj = objective(scores, a.search, oracle)
            tried.append((lam, scores, obj))
            print(f"candidate {i}/{len(grid)}: lambda {' '.join(f'{x:.3f}' for x in lam)} | "
                  + " ".join(f"{d} {s:.3f}" for d, s in scores.items())
                  + f" | {a.search} {obj:.4f} | {time.time() - t0:.1f}s | {eta(start, i, len(grid) - i)}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # ties go to the first candidate (uniform), also when float rounding of the sums splits them:
    # 0.1 + 0.16 + 0.08 + 0.12 sums above 0.06 + 0.24 + 0.04 + 0.12
    top = max(obj for _, _, obj in tried)
    best = next(x for x in tried if x[2] >= top - 1e-9)
    return list(best[0]), tried, oracle


# The settings that decide a candidate's val scores: a merge searched with the same ones scored the same candidates.
SCORE_SETTINGS = ("base", "models", "method", "density", "seed", "grid_step", "search_n", "batch", "domains")


def check_scores_from(a):
    """--scores-from DIR: UsageError (before any work) unless DIR is a searched merge (grid or balanced) whose
    candidates were scored with this search's SCORE_SETTINGS."""
    meta = read_meta(a.scores_from)
    if a.search not in ("grid", "balanced") or not meta.get("candidates"):
        raise UsageError(f"--scores-from {a.scores_from}: needs --search grid|balanced and a searched merge there "
                         f"(candidates in its acl_meta.json)")
    cfg, mine = meta.get("config") or {}, vars(a)
    norm = lambda k, v: [os.path.abspath(x) for x in v] if k == "models" else os.path.abspath(v) if k == "base" else v  # noqa: E731
    diff = [k for k in SCORE_SETTINGS if norm(k, cfg.get(k)) != norm(k, mine.get(k))]
    if diff:
        raise UsageError(f"--scores-from {a.scores_from} was searched with other {', '.join(diff)}: its scores are not "
                         f"this search's")


def reused_candidates(a, oracle) -> list:
    """--scores-from DIR: the candidates the search in DIR scored, re-ranked by this search's objective: the grid and
    balanced searches score the same candidates on the same val tasks and seeds (check_scores_from checked the
    settings), so the second needs none of its own."""
    out = [(c["weights"], c["scores"], objective(c["scores"], a.search, oracle))
           for c in read_meta(a.scores_from)["candidates"]]
    print(f"{len(out)} candidates' val scores reused from {a.scores_from}", flush=True)
    return out


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="theta_0: the checkpoint the task vectors are taken against")
    p.add_argument("--models", nargs="+", required=True, help="the checkpoints to merge (task vectors)")
    p.add_argument("--weights", nargs="+", type=float, default=None, help="lambda_k, one per model")
    p.add_argument("--search", choices=SEARCHES, default=None, help="choose lambda instead of --weights")
    p.add_argument("--method", choices=METHODS, default="task_arithmetic", help="merge method")
    p.add_argument("--density", type=float, default=None,
                   help="fraction of each task vector kept (ties/dare; default 0.5 for them, 1 otherwise)")
    p.add_argument("--seed", type=int, default=0, help="seed of DARE's drops")
    p.add_argument("--out", required=True, help="merged checkpoint directory to write (a new one, or a merge this "
                                                "project wrote, with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it is a merged checkpoint already")
    p.add_argument("--domains", default=",".join(DOMAINS),
                   help="search: the domains scored, in the order of --models' stages")
    p.add_argument("--oracles", nargs="+", default=None, help="balanced search: one oracle checkpoint per domain")
    p.add_argument("--grid-step", type=float, default=0.25, help="grid/balanced search: simplex grid step")
    p.add_argument("--search-n", type=int, default=50, help="grid/balanced search: val tasks per domain")
    p.add_argument("--scores-from", default=None, metavar="DIR", help="grid/balanced search: reuse the candidates' val "
                   "scores of the merge in DIR, searched with the same settings (arena.sh: balanced reuses grid's)")
    p.add_argument("--batch", type=int, default=64, help="search: rollout batch size")
    p.add_argument("--shard-gb", type=float, default=2.0, help="output shard size in GB")
    p.add_argument("--save-dtype", choices=list(SAVE_DTYPES), default="fp32", help="the merge's floating-point "
                   "weights: fp32 (default: an 8B merge of bf16 inputs keeps its small task vectors; 33 GB on disk), "
                   "bf16 (16 GB) or base (the base's dtype)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a = p.parse_args(argv)
    try:
        a.domains = parse_domains(a.domains)
        if (a.weights is None) == (a.search is None):
            raise UsageError("give either --weights (one per model) or --search uniform|grid|balanced")
        if a.weights is not None and len(a.weights) != len(a.models):
            raise UsageError(f"{len(a.weights)} weights for {len(a.models)} models: give one weight per model")
        if a.weights is not None and not all(math.isfinite(w) for w in a.weights):
            raise UsageError(f"--weights must be finite numbers, got {' '.join(map(str, a.weights))}")
        if not (a.shard_gb > 0 and math.isfinite(a.shard_gb)) or a.batch < 1 or (a.threads is not None and a.threads < 1):
            raise UsageError("need --shard-gb > 0, --batch >= 1 and --threads >= 1")
        a.density = a.density if a.density is not None else (1.0 if a.method == "task_arithmetic" else 0.5)
        if not 0 < a.density <= 1:
            raise UsageError(f"--density must be in (0, 1], got {a.density}")
        if not 0 < a.grid_step <= 1 or abs(round(1 / a.grid_step) * a.grid_step - 1) > 1e-9:
            raise UsageError(f"--grid-step must divide 1 (0.5, 0.25, 0.2, ...), got {a.grid_step}")
        if a.search in ("grid", "balanced"):
            if len(a.domains) != len(a.models):
                raise UsageError(f"{len(a.models)} models but {len(a.domains)} --domains: the search scores one "
                               "domain per model")
            if a.search_n < 1:
                raise UsageError("--search-n must be >= 1")
        if a.search == "balanced" and (not a.oracles or len(a.oracles) != len(a.domains)):
            raise UsageError("--search balanced needs --oracles, one checkpoint per domain")
        if a.scores_from:
            check_scores_from(a)
        a.files = check_inputs(a.base, a.models)
        for ckpt in a.oracles or []:
            if not is_checkpoint(ckpt):
                raise UsageError(f"not a checkpoint directory (no config.json): {ckpt}")
        done = read_meta(a.out)
        a.done = done.get("method") == "merge" and done.get("recipe") == recipe(a)
        if not a.done:
            check_output(a.out, "merge", inputs=[a.base, *a.models, *(a.oracles or [])], overwrite=a.overwrite)
    except UsageError as e:
        usage_exit(e)
    return a


def recipe(a) -> dict:
    """What a merge depends on: its settings and its inputs by identity (common.identity), so that a rerun keeps a
    merge made from the same checkpoints and replaces (with --overwrite) one whose inputs were replaced since."""
    keys = ("search", "weights", "method", "density", "seed", "domains", "grid_step", "search_n", "batch", "save_dtype")
    return dict({k: getattr(a, k) for k in keys}, inputs={p: identity(p) for p in [a.base, *a.models,
                                                                               *(a.oracles or []), a.scores_from] if p})


def main(argv=None):
    a = parse_args(argv)
    if a.done:
        print(f"{a.out}: merged before with this recipe from the same checkpoints, nothing to do", flush=True)
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    tried, oracle = None, None
    if a.weights is not None:
        weights = a.weights
    elif a.search == "uniform":
        weights = [1.0 / len(a.models)] * len(a.models)
    else:
        try:
            weights, tried, oracle = search_weights(a, a.files)
        except UsageError as e:
            usage_exit(e)
    config = {k: v for k, v in vars(a).items() if k != "files"}
    meta = dict(seed=a.seed, config=config, recipe=recipe(a), search=a.search, weights=weights, curriculum_position=None, step=None,
                candidates=[dict(weights=list(w), scores=s, objective=o) for w, s, o in tried] if tried else None,
                oracle_val=oracle)
    try:
        out = write_merge(a.base, a.models, weights, a.method, a.out, a.density, a.seed, meta,
                          int(a.shard_gb * 1024 ** 3), a.files, SAVE_DTYPES[a.save_dtype])
    except OSError as e:   # a full disk, a lost mount: one line; write_atomically has removed its partial directory
        sys.exit(f"error: writing {a.out} failed: {e}")
    print(f"merged {len(a.models)} models ({a.method}, lambda {' '.join(f'{w:.3f}' for w in weights)}) -> {out} "
          f"in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
