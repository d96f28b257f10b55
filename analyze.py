"""Why agents forget: the paper's two diagnostic views for any set of checkpoints.

    python analyze.py                                   # the tiny arena: stages, oracles, merges, SDFT, MMOPD
    python analyze.py --base runs/tiny/base --ckpts runs/tiny/seq/[0-9]* runs/tiny/oracle/* \\
        --ref runs/tiny/seq/1-math --out runs/tiny/analysis

Model level. Each checkpoint's displacement d_i = theta_i - theta_base is never formed whole: the checkpoints
are streamed tensor by tensor (and a large tensor in chunks of rows, --chunk-mb per checkpoint), and only
the N x N Gram matrix G_ij = <d_i, d_j> is accumulated, overall and per parameter group (attention, mlp,
embeddings, norms). Everything follows from G: norms |d_i| = sqrt(G_ii); cosines G_ij / (|d_i| |d_j|);
the distance between any two checkpoints |theta_a - theta_b|^2 = G_aa + G_bb - 2 G_ab, so each stage's own
move (from its parent, split into its RFT cold start and its RL part where the -rft checkpoint exists);
and the PCA of the unit-normalised displacements u_i = d_i / |d_i|: their Gram matrix is the cosine matrix C,
the centred one is K = H C H (H = I - 11^T / N), and K's top eigenvectors scaled by the square roots of
their eigenvalues are the points' coordinates on the first principal components: exact, and N x N
whatever the parameter count.

Token level (fixed prefix). A reference checkpoint (default seq/1-math) samples answers to its domain's
prompts; every other checkpoint is teacher-forced on the same tokens. At each sampled position: is the
reference's top-1 token still the checkpoint's top-1 (consistency), the reference's predictive entropy,
and KL(reference || checkpoint). Consistency is bucketed by the reference's entropy (quantile buckets, and
a low/high split at --entropy-threshold nats), and the share of all prediction change (KL mass, and top-1
flips) carried by the high-entropy positions is reported.

The forgetting law (beyond the study; RL's Razor, Shenfeld, Pari, Agrawal 2025: forgetting follows the KL between
the policies before and after, on the new task's distribution). For every move (a checkpoint from its parent in
acl_meta.json; a stage with a -rft checkpoint also split into its cold start and its RL), on each domain's test
prompts (--kl-n): episodes sampled from the checkpoint before, both teacher-forced, KL(before || after) exact over
the vocabulary at each agent position, per agent token with its SE over episodes (kl_moves). report.py fits the
earlier domains' drops against it.

Writes runs/<preset>/analysis/: analysis.json (every number), pca.png, cosine.png, token_consistency.png.
--resume keeps an analysis.json computed from the same checkpoints (by identity), settings and code: a restarted
arena.sh does not compute it again.

Differences from the paper:
1. Consistency asks whether the reference's top-1 token is still ranked first (the reference's sampled
   token is not always its own top-1), so a checkpoint identical to the reference scores 100%.
2. The paper does not say how its PCA was computed; here it is exact, through the Gram matrix.
"""
import argparse
import glob
import json
import os
import time

import numpy as np
import torch

from acl.common import (
    Parser,
    check_writable,
    identity,
    is_checkpoint,
    pyplot,
    read_header,
    read_meta,
    read_tensor,
    run_name,
    same_tensors,
    save_figure,
    save_json,
    shard_files,
    source_files,
    source_hash,
    usage_exit,
)
from envs import DOMAINS, make_env
from envs.base import UsageError

GROUPS = ("attention", "mlp", "embeddings", "norms")
DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}   # token level: the models' dtype per device


# ----------------------------------------------------------------------------- model level

def group_of(name: str) -> str:
    if "norm" in name:
        return "norms"
    if "embed" in name or "lm_head" in name:
        return "embeddings"
    if "self_attn" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    return "other"


def displacement_gram(base: str, ckpts: list, chunk_bytes: int = 64 * 1024 ** 2) -> dict:
    """{group: G (N x N float64 numpy)} with G_ij = <theta_i - theta_base, theta_j - theta_base> summed over
    the group's tensors ("all": every tensor). Streams tensor by tensor, a big tensor in row chunks of about
    chunk_bytes per checkpoint: memory holds one chunk per checkpoint."""
    files = same_tensors(base, ckpts)
    headers = {}
    names = sorted(files[base])
    n = len(ckpts)
    grams = {g: np.zeros((n, n)) for g in ("all", *GROUPS, "other")}
    for name in names:
        path = files[base][name]
        if path not in headers:
            headers[path] = read_header(path)
        shape = headers[path][0][name]["shape"]
        rows = shape[0] if shape else 1
        row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4 if shape else 4)
        step = max(1, chunk_bytes // row_bytes)
        for r0 in range(0, rows, step):
            sl = (r0, min(rows, r0 + step)) if shape else None
            b = read_tensor(path, name, headers, sl).double().flatten()
            d = torch.stack([read_tensor(files[c][name], name, headers, sl).double().flatten() - b
                             for c in ckpts])                                    # (N, chunk)
            g = (d @ d.T).numpy()                                                 # (N, N)
            grams["all"] += g
            grams[group_of(name)] += g
    return {k: v for k, v in grams.items() if k == "all" or v.any()}


def cosine_from_gram(G: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.clip(np.diag(G), 0, None))
    denom = np.outer(norms, norms)
    return np.divide(G, denom, out=np.zeros_like(G), where=denom > 0)


def pca_from_gram(C: np.ndarray, k: int = 2) -> tuple:
    """(coordinates N x k, explained variance ratios) of N vectors whose Gram matrix is C (kernel PCA of the
    centred vectors; exact). Each component's sign is fixed so that its largest |coordinate| is positive."""
    n = len(C)
    H = np.eye(n) - np.ones((n, n)) / n
    vals, vecs = np.linalg.eigh(H @ C @ H)
    order = np.argsort(vals)[::-1]
    vals, vecs = np.clip(vals[order], 0, None), vecs[:, order]
    coords = vecs[:, :k] * np.sqrt(vals[:k])
    for j in range(coords.shape[1]):
        if coords[np.argmax(np.abs(coords[:, j])), j] < 0:
            coords[:, j] *= -1
    total = vals.sum()
    return coords, (vals[:k] / total if total > 0 else np.zeros(k))


def distance(G: np.ndarray, i: int | None, j: int | None) -> float:
    """|theta_i - theta_j| from the Gram matrix (None: the base)."""
    gii = G[i, i] if i is not None else 0.0
    gjj = G[j, j] if j is not None else 0.0
    gij = G[i, j] if i is not None and j is not None else 0.0
    return float(np.sqrt(max(gii + gjj - 2 * gij, 0.0)))


def lr_steps(ckpt: str) -> float | None:
    """The sum of the learning rate over the optimizer updates that made `ckpt` from its parent, read from its
    metrics (<ckpt>.metrics.jsonl: an SFT cold start logs a row per update, a GRPO stage a row per step, with an update
    when it kept a group, --minibatches updates then) and its recipe's learning rate (constant in both). With AdamW
    every update moves each weight by about lr whatever the gradient's scale, so |move| / lr_steps is near 1 for
    updates that all point one way and near 1 / sqrt(updates) for directions as random as a walk: the directional
    consistency finding 9 compares. None when the metrics or the learning rate are missing."""
    rec = read_meta(ckpt).get("recipe") or {}
    path = os.path.abspath(ckpt) + ".metrics.jsonl"
    if not os.path.isfile(path):
        return None
    import json
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if ckpt.rstrip(os.sep).endswith("-rft"):
        lr, updates = rec.get("rft_lr"), sum("nll" in r for r in rows)
    else:
        lr, updates = rec.get("lr"), sum(r.get("kept_groups", 0) > 0 for r in rows) * rec.get("minibatches", 1)
    return lr * updates if lr else None


def stage_moves(labels: list, paths: list, G: np.ndarray, base: str) -> list:
    """Each checkpoint's move from its parent (acl_meta.json), split into RFT and RL where <dir>-rft exists, with each
    part's lr_steps."""
    index = {os.path.abspath(p): i for i, p in enumerate(paths)}
    out = []
    for i, p in enumerate(paths):
        if p.endswith("-rft"):
            continue
        parent = read_meta(p).get("parent")
        parent = os.path.abspath(parent) if parent else None
        if parent != os.path.abspath(base) and parent not in index:
            continue
        j = index.get(parent)
        row = {"checkpoint": labels[i], "total": distance(G, i, j)}
        rft = index.get(os.path.abspath(p) + "-rft")
        if rft is not None:
            row["rft"], row["rl"] = distance(G, rft, j), distance(G, i, rft)
            row["rft_lr_steps"], row["rl_lr_steps"] = lr_steps(paths[rft]), lr_steps(p)
        out.append(row)
    return out


# ----------------------------------------------------------------------------- token level

def token_stats(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple:
    """Per position (rows of (P, V) logits): (same top-1, the reference's entropy, KL(reference || other))."""
    p = torch.log_softmax(ref_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    entropy = -(p.exp() * p).sum(-1)
    kl = (p.exp() * (p - q)).sum(-1).clamp(min=0)
    return ref_logits.argmax(-1) == logits.argmax(-1), entropy, kl


def bucket_report(same: np.ndarray, entropy: np.ndarray, kl: np.ndarray, n_buckets: int, threshold: float) -> dict:
    """Consistency by quantile bucket of the reference's entropy, and the low/high split at `threshold`."""
    edges = np.quantile(entropy, np.linspace(0, 1, n_buckets + 1))
    which = np.clip(np.searchsorted(edges, entropy, side="right") - 1, 0, n_buckets - 1)
    buckets = []
    for b in range(n_buckets):
        m = which == b
        buckets.append({"entropy_lo": float(edges[b]), "entropy_hi": float(edges[b + 1]), "n": int(m.sum()),
                        "consistency": float(same[m].mean()) if m.any() else None,
                        "kl": float(kl[m].mean()) if m.any() else None})
    high = entropy > threshold
    flips = ~same
    return {"buckets": buckets, "threshold": threshold, "n": int(len(same)), "high_fraction": float(high.mean()),
            "consistency": float(same.mean()),
            "low_consistency": float(same[~high].mean()) if (~high).any() else None,
            "high_consistency": float(same[high].mean()) if high.any() else None,
            "high_kl_share": float(kl[high].sum() / kl.sum()) if kl.sum() > 0 else None,
            "high_flip_share": float((flips & high).sum() / flips.sum()) if flips.any() else None,
            "mean_kl": float(kl.mean())}


def sample_reference(ref: str, domain: str, n: int, batch: int, seed: int, device: str = "cpu") -> tuple:
    """The reference's episodes on its domain's test prompts: ([(token_ids, sampled positions)], tokenizer,
    the reference model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from acl.engine import HFBackend
    from envs.rollout import rollout
    tok = AutoTokenizer.from_pretrained(ref)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=DTYPE[device]).to(device).eval()
    env = make_env(domain)
    eps = rollout(HFBackend(model, tok, batch), tok, [(env, t) for t in env.tasks("test", n=n)], 1, 1.0, seed=seed)
    return [(e.token_ids, [t for t, m in enumerate(e.loss_mask) if m]) for e in eps], tok, model


@torch.no_grad()
def position_logits(model, episodes, pad_id: int, batch: int):
    """Yields the (P, V) logits predicting each sampled token, batch by batch (teacher forcing)."""
    for s in range(0, len(episodes), batch):
        chunk = episodes[s:s + batch]
        T = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), T), pad_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), T), dtype=torch.long)
        for i, (x, _) in enumerate(chunk):
            ids[i, :len(x)], attn[i, :len(x)] = torch.tensor(x), 1
        dev = next(model.parameters()).device
        logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev)).logits.float().cpu()  # (B, T, V)
        yield torch.cat([logits[i, [t - 1 for t in pos]] for i, (_, pos) in enumerate(chunk) if pos])


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def token_level(ref: str, ckpts: list, labels: list, a) -> dict:
    from transformers import AutoModelForCausalLM
    domain = reference_domain(ref, a.domain)
    episodes, tok, ref_model = sample_reference(ref, domain, a.n, a.batch, a.seed, a.device)
    out = {"reference": ref, "domain": domain, "n_prompts": len(episodes),
           "n_positions": sum(len(p) for _, p in episodes), "checkpoints": {}}
    for path, label in zip(ckpts, labels):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE[a.device]).to(a.device).eval()
        same, ent, kl = [], [], []
        for r, c in zip(position_logits(ref_model, episodes, tok.pad_token_id, a.batch),
                        position_logits(model, episodes, tok.pad_token_id, a.batch)):
            s, e, k = token_stats(r, c)
            same.append(s), ent.append(e), kl.append(k)
        rep = bucket_report(torch.cat(same).numpy(), torch.cat(ent).numpy(), torch.cat(kl).numpy(), a.buckets,
                            a.entropy_threshold)
        out["checkpoints"][label] = rep
        del model   # one compared model at a time beside the reference
        print(f"[token] {label}: consistency {_pct(rep['consistency'])} | low-entropy {_pct(rep['low_consistency'])} "
              f"| high-entropy {_pct(rep['high_consistency'])} | mean KL {rep['mean_kl']:.4f}", flush=True)
    return out


# ----------------------------------------------------------------------------- the forgetting law
# RL's Razor (Shenfeld, Pari, Agrawal 2025): forgetting is predicted by KL(pi_before || pi_after) measured on the new
# task's distribution. Each move (a stage from its parent, split into its cold start and its RL where the -rft
# checkpoint exists; an oracle, a merge, a consolidator from where it started) is measured on every domain.

def episode_kls(before, after, episodes, pad_id: int, batch: int, before_logits=None) -> list:
    """[(sum over the episode's agent positions of KL(before || after), agent positions)] for episodes sampled from
    `before` (token ids, agent positions): at each position the exact KL of the two next-token distributions over
    the vocabulary (token_stats). By the chain rule an episode's sum is the KL between the two policies' episodes
    (the environment's tokens are the same under both and cancel); the exact per-position form has less variance
    than log p_before(y) - log p_after(y) of the sampled token alone. before_logits: position_logits(before, ...) of
    the same episodes, computed once for all the moves from one checkpoint."""
    eps, out = [e for e in episodes if e[1]], []
    b_chunks = before_logits if before_logits is not None else position_logits(before, eps, pad_id, batch)
    for s, b, a in zip(range(0, len(eps), batch), b_chunks, position_logits(after, eps, pad_id, batch)):
        chunk = eps[s:s + batch]
        for part, (_, pos) in zip(token_stats(b, a)[2].split([len(p) for _, p in chunk]), chunk):
            out.append((float(part.sum()), len(pos)))
    return out


def per_token(kls: list) -> dict:
    """The KL per agent token (sum over episodes / their tokens) with its standard error over episodes (the ratio
    estimator's linearisation)."""
    s, n = np.array([k for k, _ in kls]), np.array([m for _, m in kls], dtype=float)
    r = s.sum() / n.sum()
    se = float(np.sqrt(((s - r * n) ** 2).sum() * len(s) / max(len(s) - 1, 1)) / n.sum()) if len(s) > 1 else None
    return {"kl": float(r), "se": se, "tokens": int(n.sum()), "episodes": len(s)}


def moves_of(ckpts: list, base: str) -> list:
    """(before, after) pairs: each checkpoint from its parent (acl_meta.json), a stage with a -rft sibling split into
    parent -> -rft (the cold start) and -rft -> stage (the RL)."""
    pairs = []
    for p in ckpts:
        parent = read_meta(p).get("parent")
        if p.endswith("-rft") or not parent or not is_checkpoint(parent):
            continue
        rft = p.rstrip(os.sep) + "-rft"
        pairs += [(parent, rft), (rft, p)] if is_checkpoint(rft) else []
        pairs.append((parent, p))
    return pairs


def kl_moves(ckpts: list, base: str, a) -> list:
    """KL(before || after) per agent token on every domain's `test` prompts (--kl-n each, one sample from `before`)
    for every move of moves_of: [{before, after, domain, kl, se, tokens, episodes}]. Samples of one `before` are drawn
    once and shared by its moves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from acl.engine import HFBackend
    from envs.rollout import rollout
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=DTYPE[a.device]).to(a.device).eval()  # noqa: E731
    out, samples, loaded = [], {}, None
    for before, after in moves_of(ckpts, base):
        if before != loaded:   # consecutive moves from one checkpoint (the oracles from the base) load it once
            tok, m_before, loaded = AutoTokenizer.from_pretrained(before), load(before), before
        m_after = load(after)
        for d in DOMAINS:
            if (before, d) not in samples:   # its episodes and its logits at their agent positions, once
                env = make_env(d)
                eps = rollout(HFBackend(m_before, tok, a.batch), tok, [(env, t) for t in env.tasks("test", n=a.kl_n)],
                              1, 1.0, seed=a.seed)
                eps = [(e.token_ids, [t for t, m in enumerate(e.loss_mask) if m]) for e in eps]
                eps = [e for e in eps if e[1]]
                samples[before, d] = eps, list(position_logits(m_before, eps, tok.pad_token_id, a.batch))
            eps, logits = samples[before, d]
            row = per_token(episode_kls(m_before, m_after, eps, tok.pad_token_id, a.batch, logits))
            out.append(dict(before=label_of(before), after=label_of(after), domain=d, **row))
        print(f"[kl] {label_of(before)} -> {label_of(after)}: " + " | ".join(
            f"{r['domain']} {r['kl']:.4f}" for r in out[-len(DOMAINS):]), flush=True)
    return out


# ----------------------------------------------------------------------------- plots

def plot_pca(coords, labels, explained, moving, path):
    """The checkpoints that moved off the base (a zero displacement has no direction), the sequential
    stages joined in curriculum order."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 5.5))
    seq = [i for i, lab in enumerate(labels) if lab.startswith("seq-") and not lab.endswith("-rft") and moving[i]]
    ax.plot([coords[i, 0] for i in seq], [coords[i, 1] for i in seq], "-", color="C0", label="sequential stages, in order")
    for i, lab in enumerate(labels):
        if not moving[i]:
            continue
        kind = lab.split("-")[0]
        color = {"seq": "C0", "oracle": "C1", "merge": "C2"}.get(kind, "C3")
        ax.scatter(coords[i, 0], coords[i, 1], color=color, marker="x" if lab.endswith("-rft") else "o", zorder=3)
        ax.annotate(lab, (coords[i, 0], coords[i, 1]), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(f"PC1 ({explained[0]:.0%})")
    ax.set_ylabel(f"PC2 ({explained[1]:.0%})" if len(explained) > 1 else "PC2")
    ax.set_title("unit-normalised displacements from the base, first two principal components", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_cosine(C, labels, path):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(1.5 + 0.55 * len(labels), 1.2 + 0.5 * len(labels)))
    im = ax.imshow(C, cmap="coolwarm", vmin=-1, vmax=1)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    for i in range(len(labels)):
        for j in range(len(labels)):
            ax.text(j, i, f"{C[i, j]:.2f}", ha="center", va="center", fontsize=6)
    ax.set_title("cosine similarity of task vectors (all parameters)", fontsize=10)
    fig.colorbar(im, ax=ax)
    return save_figure(fig, path)


def plot_consistency(tok: dict, path):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rep in tok["checkpoints"].items():
        ys = [b["consistency"] for b in rep["buckets"]]
        ax.plot(range(1, len(ys) + 1), ys, "-o", label=label)
    ax.set_xlabel("reference entropy bucket (quantiles, low to high)")
    ax.set_ylabel("top-1 consistency with the reference")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"fixed prefix: {tok['reference']} on {tok['domain']}", fontsize=10)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- command line

def default_ckpts(runs: str) -> list:
    """The tiny arena's checkpoints that exist: sequential stages (with their -rft cold starts), oracles, merges,
    the SDFT and MMOPD consolidators, and MLE's experts merged into full checkpoints (mle.py --export merged)."""
    out = sorted(glob.glob(os.path.join(runs, "seq", "[0-9]-*")))
    out += sorted(glob.glob(os.path.join(runs, "oracle", "*"))) + sorted(glob.glob(os.path.join(runs, "merge", "*")))
    out += [os.path.join(runs, m) for m in ("sdft", "mmopd")] + sorted(glob.glob(os.path.join(runs, "mle-merged", "*")))
    return [p for p in out if is_checkpoint(p)]


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="runs/tiny", help="run directory: defaults for the flags below")
    p.add_argument("--base", default=None, help="theta_base (default <runs>/base)")
    p.add_argument("--ckpts", nargs="+", default=None, help="checkpoints (default: every stage, oracle, merge, SDFT and MMOPD in --runs)")
    p.add_argument("--ref", default=None, help="token level: the reference (default <runs>/seq/1-math)")
    p.add_argument("--domain", default=None, help="token level: the reference's domain (default: the stage its "
                                                  "acl_meta.json names)")
    p.add_argument("--n", type=int, default=100, help="token level: prompts the reference answers")
    p.add_argument("--batch", type=int, default=32, help="token level: sequences per forward pass")
    p.add_argument("--buckets", type=int, default=5, help="token level: quantile buckets of the reference's entropy")
    p.add_argument("--entropy-threshold", type=float, default=0.5, help="token level: nats above which a position is high-entropy")
    p.add_argument("--chunk-mb", type=float, default=64, help="model level: rows of a tensor read at once, per checkpoint")
    p.add_argument("--no-tokens", action="store_true", help="skip the token level")
    p.add_argument("--kl-n", type=int, default=50, help="the forgetting law: test prompts per domain on which each "
                   "move's KL(before || after) is measured (0: skip it)")
    p.add_argument("--out", default=None, help="output directory (default <runs>/analysis)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the reference")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--resume", action="store_true", help="keep --out's analysis.json (and its plots) when it was "
                   "computed from these checkpoints (by identity), settings and analysis code (arena.sh restarted)")
    p.add_argument("--device", choices=sorted(DTYPE), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="token level: where the models run (one at a time beside the reference)")
    a = p.parse_args(argv)
    a.base = a.base or os.path.join(a.runs, "base")
    a.ckpts = a.ckpts or default_ckpts(a.runs)
    a.ref = a.ref or os.path.join(a.runs, "seq", "1-math")
    a.out = a.out or os.path.join(a.runs, "analysis")
    try:
        if a.kl_n < 0:
            raise UsageError("--kl-n must be >= 0")
        if a.n < 1 or a.batch < 1 or a.buckets < 1 or not a.chunk_mb > 0 or (a.threads is not None and a.threads < 1):
            raise UsageError("need --n, --batch, --buckets, --threads >= 1 and --chunk-mb > 0")
        if not a.entropy_threshold >= 0 or a.entropy_threshold == float("inf"):
            raise UsageError(f"--entropy-threshold must be a finite number of nats >= 0, got {a.entropy_threshold}")
        if len(a.ckpts) < 2:
            raise UsageError(f"need at least 2 checkpoints to compare, found {len(a.ckpts)} (pass --ckpts)")
        for c in [a.base, *a.ckpts] + ([] if a.no_tokens else [a.ref]):
            if not is_checkpoint(c):
                raise UsageError(f"not a checkpoint directory (no config.json): {c}")
            shard_files(c)
        if not a.no_tokens:
            a.domain = reference_domain(a.ref, a.domain)
        check_writable(a.out, "--out")
    except UsageError as e:
        usage_exit(e)
    return a


def reference_domain(ref: str, flag: str | None) -> str:
    """The token level's domain: --domain when given, else the stage the reference's acl_meta.json names."""
    domain = flag or read_meta(ref).get("stage")
    if domain not in DOMAINS:
        raise UsageError(f"--domain {flag!r} is not a domain ({', '.join(DOMAINS)})" if flag else
                         f"cannot tell the reference's domain from {ref}/acl_meta.json: pass --domain")
    return domain


def inputs_of(a) -> dict:
    """What analysis.json's numbers are computed from: the checkpoints by identity (one replaced in place is another),
    the settings that change a number, and the code that computes them (this file, acl/, envs/). --resume keeps an
    analysis.json whose recorded inputs equal these."""
    settings = {k: getattr(a, k) for k in ("n", "batch", "buckets", "entropy_threshold", "no_tokens", "kl_n", "seed",
                                           "domain", "device")}
    return {"base": identity(a.base), "ckpts": [[c, identity(c)] for c in a.ckpts],
            "ref": None if a.no_tokens else identity(a.ref), "settings": settings,
            "code": source_hash(source_files("analyze.py", "acl/*.py", "envs/*.py"))}


def kept_analysis(a, inputs: dict) -> bool:
    """--resume: --out's analysis.json has these inputs and every plot it made is there."""
    path = os.path.join(a.out, "analysis.json")
    if not a.resume or not os.path.isfile(path):
        return False
    with open(path) as f:
        done = json.load(f)
    plots = ["pca.png", "cosine.png"] + ([] if a.no_tokens else ["token_consistency.png"])
    return done.get("inputs") == json.loads(json.dumps(inputs)) and \
        all(os.path.isfile(os.path.join(a.out, p)) for p in plots)


def label_of(path: str) -> str:
    return run_name(path)[1]


def main(argv=None):
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    inputs = inputs_of(a)
    if kept_analysis(a, inputs):
        print(f"{a.out}/analysis.json: computed before from these checkpoints, settings and code: kept")
        return
    labels = [label_of(c) for c in a.ckpts]
    try:
        grams = displacement_gram(a.base, a.ckpts, int(a.chunk_mb * 1024 ** 2))
    except UsageError as e:
        usage_exit(e)
    G = grams["all"]
    norms = np.sqrt(np.clip(np.diag(G), 0, None))
    cos = {g: cosine_from_gram(Gg) for g, Gg in grams.items()}
    moving = norms > 0
    coords = np.zeros((len(labels), 2))
    explained = np.zeros(2)
    if moving.sum() >= 2:   # a checkpoint equal to the base has no direction: left at the origin
        sub, explained = pca_from_gram(cos["all"][np.ix_(moving, moving)], 2)
        coords[moving, :sub.shape[1]] = sub
    moves = stage_moves(labels, a.ckpts, G, a.base)
    result = {"base": a.base, "checkpoints": labels, "paths": a.ckpts, "norms": dict(zip(labels, norms.tolist())),
              "cosine": {g: c.tolist() for g, c in cos.items()}, "pca": dict(zip(labels, coords.tolist())),
              "pca_explained": explained.tolist(), "stage_moves": moves,
              "pca_method": "exact kernel PCA of the unit-normalised displacements through their N x N Gram matrix",
              "inputs": inputs}
    print(f"model level: {len(labels)} checkpoints against {a.base} in {time.time() - t0:.1f}s")
    print("| displacement from base | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for i, lab in enumerate(labels):
        print(f"| {lab} (norm {norms[i]:.3f}) | " + " | ".join(f"{x:.2f}" for x in cos["all"][i]) + " |")
    for m in moves:
        split = f" (RFT {m['rft']:.3f}, RL {m['rl']:.3f})" if "rft" in m else ""
        print(f"move of {m['checkpoint']} from its parent: {m['total']:.3f}{split}")
    os.makedirs(a.out, exist_ok=True)
    plot_pca(coords, labels, explained, moving, os.path.join(a.out, "pca.png"))
    plot_cosine(cos["all"], labels, os.path.join(a.out, "cosine.png"))
    if not a.no_tokens:
        ref = os.path.abspath(a.ref)
        later = [(c, lab) for c, lab in zip(a.ckpts, labels) if os.path.abspath(c) != ref and not c.endswith("-rft")]
        try:
            result["token"] = token_level(a.ref, [c for c, _ in later], [lab for _, lab in later], a)
        except UsageError as e:
            usage_exit(e)
        plot_consistency(result["token"], os.path.join(a.out, "token_consistency.png"))
        for lab, rep in result["token"]["checkpoints"].items():
            print(f"{lab}: {_pct(rep['low_consistency'])} of low-entropy tokens (H <= {a.entropy_threshold}) keep the "
                  f"reference's top-1; high-entropy tokens ({_pct(rep['high_fraction'])} of positions) carry "
                  f"{_pct(rep['high_kl_share'])} of the KL and {_pct(rep['high_flip_share'])} of the top-1 flips")
    if a.kl_n:
        try:
            result["kl_moves"] = kl_moves(a.ckpts, a.base, a)
        except UsageError as e:
            usage_exit(e)
    save_json(os.path.join(a.out, "analysis.json"), result)
    print(f"wrote {a.out}/analysis.json, pca.png, cosine.png{'' if a.no_tokens else ', token_consistency.png'} "
          f"in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
