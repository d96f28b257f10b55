"""analyze.py: PCA and cosines against numpy, streaming = in memory, the token-level statistics by hand, and
the CLI end to end (an identical checkpoint: 100% consistent, zero KL)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import analyze
from acl.common import read_tensor, save_checkpoint, shard_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- model level, by hand

def test_cosine_and_pca_from_gram_match_numpy():
    rng = np.random.default_rng(0)
    d = rng.normal(size=(5, 40)) * rng.uniform(0.5, 3, size=(5, 1))   # 5 displacements, different norms
    G = d @ d.T
    u = d / np.linalg.norm(d, axis=1, keepdims=True)
    assert np.allclose(analyze.cosine_from_gram(G), u @ u.T)
    coords, explained = analyze.pca_from_gram(analyze.cosine_from_gram(G), 2)
    uc = u - u.mean(0)                                                   # numpy PCA of the unit vectors
    U, S, _ = np.linalg.svd(uc, full_matrices=False)
    want = U[:, :2] * S[:2]
    for j in range(2):   # a component's sign is arbitrary
        assert np.allclose(coords[:, j], want[:, j]) or np.allclose(coords[:, j], -want[:, j])
    assert np.allclose(explained, S[:2] ** 2 / (S ** 2).sum())


def test_distances_from_gram():
    d = np.array([[1.0, 0.0], [1.0, 2.0], [-1.0, 1.0]])
    G = d @ d.T
    assert analyze.distance(G, 0, 1) == pytest.approx(2.0)
    assert analyze.distance(G, 2, None) == pytest.approx(np.sqrt(2))
    assert analyze.distance(G, 0, 2) == pytest.approx(np.sqrt(5))


def test_lr_steps_count_the_updates_that_made_a_checkpoint(tmp_path):
    """Finding 9's normaliser: the cold start's SFT updates (a metrics row each) at rft_lr, the GRPO steps that kept a
    group (an update each, --minibatches of them) at lr; None without metrics."""
    def ckpt(name, recipe, rows):
        d = tmp_path / name
        d.mkdir()
        (d / "acl_meta.json").write_text(json.dumps({"recipe": recipe}))
        if rows is not None:
            (tmp_path / f"{name}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(d)
    rft = ckpt("2-search-rft", {"lr": 2e-4, "rft_lr": 1e-3}, [{"step": i, "nll": 0.1} for i in range(16)])
    rl = ckpt("2-search", {"lr": 2e-4, "rft_lr": 1e-3, "minibatches": 2},
              [{"step": i, "kept_groups": 0 if i in (3, 7) else 4} for i in range(10)])
    assert analyze.lr_steps(rft) == pytest.approx(16 * 1e-3)
    assert analyze.lr_steps(rl) == pytest.approx(8 * 2 * 2e-4)
    assert analyze.lr_steps(ckpt("none", {"lr": 2e-4}, None)) is None


def test_group_of():
    assert analyze.group_of("model.layers.0.self_attn.q_proj.weight") == "attention"
    assert analyze.group_of("model.layers.0.self_attn.q_norm.weight") == "norms"
    assert analyze.group_of("model.layers.1.mlp.down_proj.weight") == "mlp"
    assert analyze.group_of("model.embed_tokens.weight") == "embeddings"
    assert analyze.group_of("model.norm.weight") == "norms"


@pytest.fixture(scope="module")
def ckpts(micro, tmp_path_factory):
    model, tok = micro
    root = tmp_path_factory.mktemp("analyze")
    base_sd = {k: v.clone() for k, v in model.state_dict().items()}
    base = save_checkpoint(str(root / "base"), model, tok, {"method": "base"})
    paths = []
    for i, scale in enumerate((0.02, 0.05, 0.0)):   # the last one equals the base
        g = torch.Generator().manual_seed(i)
        model.load_state_dict({k: v + scale * torch.randn(v.shape, generator=g) for k, v in base_sd.items()})
        paths.append(save_checkpoint(str(root / f"c{i}"), model, tok, {"method": "seq", "stage": "math",
                                                                      "parent": str(root / "base")}))
    model.load_state_dict(base_sd)
    return root, base, paths


def test_streaming_gram_equals_in_memory(ckpts):
    _, base, paths = ckpts
    # chunks of 1 KB: every matrix is read in several row slices
    grams = analyze.displacement_gram(base, paths, chunk_bytes=1024)
    sd = [{k: read_tensor(f, k, {}).double() for k, f in shard_files(p).items()} for p in [base, *paths]]
    d = np.stack([torch.cat([(s[k] - sd[0][k]).flatten() for k in sorted(sd[0])]).numpy() for s in sd[1:]])
    assert np.allclose(grams["all"], d @ d.T, rtol=1e-10, atol=1e-12)
    by_group = sum(g for name, g in grams.items() if name != "all")
    assert np.allclose(by_group, grams["all"]) and {"attention", "mlp", "embeddings", "norms"} <= set(grams)
    assert grams["all"][2, 2] == 0 and grams["all"][1, 1] > grams["all"][0, 0] > 0


def test_row_slices_read_the_same_bytes(ckpts):
    _, base, _ = ckpts
    files = shard_files(base)
    name = next(k for k in files if k.endswith("mlp.up_proj.weight"))
    whole = read_tensor(files[name], name, {})
    assert torch.equal(read_tensor(files[name], name, {}, (3, 7)), whole[3:7])


# ----------------------------------------------------------------------------- token level, by hand

def test_token_stats_and_buckets_by_hand():
    # position 0: the reference is sure (entropy ~0), the other agrees; position 1: uniform reference over
    # 2 tokens (entropy ln 2), the other prefers the second; position 2: a sure reference the other flips
    big = 30.0
    ref = torch.tensor([[big, 0.0], [0.0, 0.0], [big, 0.0]])
    other = torch.tensor([[big, 0.0], [0.0, 1.0], [0.0, big]])
    same, ent, kl = analyze.token_stats(ref, other)
    assert same.tolist() == [True, False, False]   # position 1: argmax of a tie is the first token
    assert ent[0] == pytest.approx(0, abs=1e-9) and ent[1] == pytest.approx(np.log(2))
    q = torch.log_softmax(torch.tensor([0.0, 1.0]), -1)
    assert kl[1] == pytest.approx(float(0.5 * (np.log(0.5) - q[0]) + 0.5 * (np.log(0.5) - q[1])))
    assert kl[0] == pytest.approx(0, abs=1e-9) and kl[2] == pytest.approx(big, rel=1e-3)
    rep = analyze.bucket_report(np.array([1, 0, 1, 1, 0, 1], bool), np.array([0.0, 0.1, 0.2, 1.0, 2.0, 3.0]),
                                np.array([0.0, 1.0, 0.0, 0.0, 3.0, 0.0]), n_buckets=2, threshold=0.5)
    assert [b["n"] for b in rep["buckets"]] == [3, 3]
    assert [b["consistency"] for b in rep["buckets"]] == pytest.approx([2 / 3, 2 / 3])
    assert rep["low_consistency"] == pytest.approx(2 / 3) and rep["high_consistency"] == pytest.approx(2 / 3)
    assert rep["high_kl_share"] == pytest.approx(3 / 4) and rep["high_flip_share"] == pytest.approx(1 / 2)
    assert rep["high_fraction"] == pytest.approx(0.5) and rep["consistency"] == pytest.approx(4 / 6)


# ----------------------------------------------------------------------------- command line

def test_cli_end_to_end_and_an_identical_checkpoint(ckpts, tmp_path):
    _, base, paths = ckpts
    identical = paths[0] + "-copy"
    if not os.path.exists(identical):
        import shutil
        shutil.copytree(paths[0], identical)
    r = subprocess.run([sys.executable, "analyze.py", "--base", base, "--ckpts", *paths, identical, "--ref", paths[0],
                        "--n", "4", "--batch", "4", "--buckets", "2", "--out", str(tmp_path / "a"), "--threads", "1", "--kl-n", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert {f for f in os.listdir(tmp_path / "a")} >= {"analysis.json", "pca.png", "cosine.png", "token_consistency.png"}
    labels = out["checkpoints"]
    same = out["token"]["checkpoints"][labels[-1]]
    assert same["consistency"] == 1.0 and same["mean_kl"] == pytest.approx(0, abs=1e-6)
    assert out["token"]["n_positions"] > 0 and len(out["token"]["checkpoints"]) == 3   # the reference itself is not compared
    assert out["norms"][labels[2]] == 0 and out["cosine"]["all"][0][3] == pytest.approx(1.0)
    assert [m["checkpoint"] for m in out["stage_moves"]] == labels   # each from the base, its parent
    kl = {(m["after"], m["domain"]): m for m in out["kl_moves"]}         # the forgetting law's KL, every domain
    assert len(kl) == 4 * 4 and all(m["before"] == "base" and m["episodes"] > 0 for m in out["kl_moves"])
    assert kl[labels[2], "math"]["kl"] == pytest.approx(0, abs=1e-6) and kl[labels[1], "math"]["kl"] > 0


def test_resume_keeps_an_analysis_of_the_same_inputs_and_redoes_one_of_others(ckpts, tmp_path):
    """--resume (a restarted arena.sh): the same checkpoints, settings and code keep analysis.json as it is; a
    checkpoint replaced under its path (another identity) or another setting computes it again."""
    import shutil
    _, base, paths = ckpts
    moved = str(tmp_path / "c1")
    shutil.copytree(paths[1], moved)
    out = tmp_path / "a"

    def run(*extra):
        r = subprocess.run([sys.executable, "analyze.py", "--base", base, "--ckpts", paths[0], moved, "--no-tokens",
                            "--kl-n", "0", "--out", str(out), "--threads", "1", *extra], cwd=ROOT, capture_output=True,
                           text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    assert "kept" not in run("--resume")   # nothing there yet
    first = (out / "analysis.json").read_text()
    assert "inputs" in json.loads(first)
    assert "computed before from these checkpoints, settings and code: kept" in run("--resume")
    assert (out / "analysis.json").read_text() == first
    assert "kept" not in run()              # without --resume: computed again
    assert "kept" not in run("--resume", "--seed", "1")   # another setting
    meta = os.path.join(moved, "acl_meta.json")
    m = json.load(open(meta))
    m["saved_at"] = "replaced"              # the same path, another checkpoint
    json.dump(m, open(meta, "w"))
    assert "kept" not in run("--resume", "--seed", "1")


def test_the_kl_estimator_against_the_exact_kl_by_enumeration(ckpts):
    """KL(before || after) between two micro models' distributions over 2-token continuations of a prompt, exactly by
    enumerating the first token (the second's KL is exact given it): the estimator on continuations sampled from
    `before` (episode_kls, per_token) lands within 4 of its standard errors, and is exactly 0 for a model against
    itself."""
    from transformers import AutoModelForCausalLM
    _, _, paths = ckpts
    before, after = (AutoModelForCausalLM.from_pretrained(p).eval() for p in paths[:2])
    prompt = [5, 17, 33, 2]
    with torch.no_grad():
        lb, la = (torch.log_softmax(m(input_ids=torch.tensor([prompt])).logits[0, -1], -1) for m in (before, after))
        V = lb.numel()
        second = torch.tensor([prompt + [y] for y in range(V)])
        lb2, la2 = (torch.log_softmax(m(input_ids=second).logits[:, -1], -1) for m in (before, after))
    kl1 = (lb.exp() * (lb - la)).sum()
    kl2 = (lb2.exp() * (lb2 - la2)).sum(-1)                     # given each first token
    exact = float(kl1 + (lb.exp() * kl2).sum()) / 2             # per agent token: every continuation has two
    g = torch.Generator().manual_seed(0)
    eps = []
    for _ in range(300):
        y1 = int(torch.multinomial(lb.exp(), 1, generator=g))
        y2 = int(torch.multinomial(lb2[y1].exp(), 1, generator=g))
        eps.append((prompt + [y1, y2], [len(prompt), len(prompt) + 1]))
    est = analyze.per_token(analyze.episode_kls(before, after, eps, 0, 64))
    assert est["tokens"] == 600 and est["episodes"] == 300
    assert abs(est["kl"] - exact) < 4 * est["se"], (est, exact)
    assert est["se"] < 0.2 * exact                                # the check has power
    assert analyze.per_token(analyze.episode_kls(before, before, eps, 0, 64))["kl"] == pytest.approx(0, abs=1e-6)


def test_moves_split_a_stage_into_its_cold_start_and_its_rl(tmp_path, micro):
    model, tok = micro
    base = save_checkpoint(str(tmp_path / "base"), model, tok, {"method": "base"})
    s1 = save_checkpoint(str(tmp_path / "1-math"), model, tok, {"method": "seq", "parent": base})
    save_checkpoint(str(tmp_path / "2-search-rft"), model, tok, {"method": "seq", "parent": s1})
    s2 = save_checkpoint(str(tmp_path / "2-search"), model, tok, {"method": "seq", "parent": s1})
    rft = s2 + "-rft"
    assert analyze.moves_of([s1, rft, s2], base) == [(base, s1), (s1, rft), (rft, s2), (s1, s2)]


def test_bad_input_stops_with_one_line(ckpts, tmp_path):
    _, base, paths = ckpts
    r = subprocess.run([sys.executable, "analyze.py", "--base", base, "--ckpts", paths[0], str(tmp_path / "nope"),
                        "--out", str(tmp_path / "a")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: not a checkpoint directory")
    assert not (tmp_path / "a").exists()
