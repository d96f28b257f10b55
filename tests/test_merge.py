"""merge.py: the formulas (task arithmetic, TIES, DARE) by hand, streaming = in memory, bad input, the CLI
end to end with each weight search on micro checkpoints."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import merge
from acl.common import read_header, read_tensor, save_checkpoint, shard_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    return subprocess.run([sys.executable, "merge.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def ckpts(micro, tmp_path_factory):
    """A micro base and three 'stages': the base plus a different random perturbation each."""
    model, tok = micro
    root = tmp_path_factory.mktemp("merge")
    base_sd = {k: v.clone() for k, v in model.state_dict().items()}
    paths = [str(save_checkpoint(str(root / "base"), model, tok, {"method": "base"}))]
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base_sd.items()}
        model.load_state_dict(sd)
        paths.append(str(save_checkpoint(str(root / f"s{i}"), model, tok, {"method": "seq"})))
    model.load_state_dict(base_sd)
    return root, paths[0], paths[1:]


def load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def raw(path):
    """The tensors as stored (a tied lm_head is not), read the way merge.py reads them."""
    headers = {}
    return {k: read_tensor(f, k, headers) for k, f in shard_files(path).items()}


# ----------------------------------------------------------------------------- formulas by hand

def test_task_arithmetic_is_the_formula_element_by_element(ckpts, tmp_path):
    _, base, models = ckpts
    w = [0.5, -0.25, 1.5]
    merge.write_merge(base, models, w, "task_arithmetic", str(tmp_path / "out"))
    b, ms, out = load(base), [load(m) for m in models], load(str(tmp_path / "out"))
    for k in b:
        want = b[k] + sum(wk * (m[k] - b[k]) for wk, m in zip(w, ms))
        assert torch.allclose(out[k], want, atol=1e-6, rtol=0), k


def test_ties_by_hand():
    base = torch.zeros(5)
    m1 = torch.tensor([3.0, -1.0, 0.5, 2.0, -4.0])
    m2 = torch.tensor([-1.0, 2.0, 0.4, -3.0, -2.0])
    # density 0.6 keeps the top 3 magnitudes of each task vector:
    #   t1 = [3, 0, 0, 2, -4], t2 = [0, 2, 0, -3, -2]
    # weights 1, 1: elected sign of t1 + t2 = [3, 2, 0, -1, -6] -> [+, +, + (0 counts as +), -, -]
    # disjoint mean over the agreeing non-zero entries: [3/1, 2/1, 0, -3/1, (-4-2)/2]
    got = merge.merge_tensor(base, [m1, m2], [1.0, 1.0], "ties", density=0.6)
    assert torch.allclose(got, torch.tensor([3.0, 2.0, 0.0, -3.0, -3.0]))
    # weights 2, 1: weighted t = [6, 0, 0, 4, -8], [0, 2, 0, -3, -2]; sign of the sum [6, 2, 0, 1, -10]
    # -> entry 3 elects +, only t1 agrees: 4 / 2 = 2; entry 4: (-8 - 2) / (2 + 1)
    got = merge.merge_tensor(base, [m1, m2], [2.0, 1.0], "ties", density=0.6)
    assert torch.allclose(got, torch.tensor([3.0, 2.0, 0.0, 2.0, -10.0 / 3]))
    # a base that is not zero: only the task vectors are trimmed and merged
    got = merge.merge_tensor(base + 1, [m1 + 1, m2 + 1], [1.0, 1.0], "ties", density=0.6)
    assert torch.allclose(got, torch.tensor([4.0, 3.0, 1.0, -2.0, -2.0]))


def test_dare_by_hand():
    base = torch.zeros(6)
    m = torch.arange(1.0, 7.0)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(6, generator=g) < 0.5          # the drop merge.py draws with the same seed
    want = m * keep / 0.5
    got = merge.merge_tensor(base, [m], [1.0], "dare_linear", density=0.5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got, want) and 0 < keep.sum() < 6
    # dare_linear with two models, weights 0.5 each: the mean of the rescaled survivors
    g = torch.Generator().manual_seed(0)
    k1, k2 = torch.rand(6, generator=g) < 0.5, torch.rand(6, generator=g) < 0.5
    got = merge.merge_tensor(base, [m, -m], [0.5, 0.5], "dare_linear", 0.5, torch.Generator().manual_seed(0))
    assert torch.allclose(got, 0.5 * (m * k1 * 2) + 0.5 * (-m * k2 * 2))
    # dare_ties: where both survive their signs disagree and the sum is 0 (elects +): only m's entry counts
    got = merge.merge_tensor(base, [m, -m], [1.0, 1.0], "dare_ties", 0.5, torch.Generator().manual_seed(0))
    want = torch.where(k1 & k2, 2 * m, torch.where(k1, 2 * m, torch.where(k2, -2 * m, torch.zeros(6))))
    assert torch.allclose(got, want)
    # density 1 is plain task arithmetic, the same seed gives the same drop
    assert torch.equal(merge.merge_tensor(base, [m], [1.0], "dare_linear", 1.0, torch.Generator()), m)
    a = merge.merge_tensor(base, [m], [1.0], "dare_ties", 0.3, torch.Generator().manual_seed(9))
    b = merge.merge_tensor(base, [m], [1.0], "dare_ties", 0.3, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


def test_trim_top_keeps_exactly_the_largest():
    t = torch.tensor([[0.1, -5.0], [2.0, -0.3]])
    assert torch.equal(merge.trim_top(t, 0.5), torch.tensor([[0.0, -5.0], [2.0, 0.0]]))
    assert torch.equal(merge.trim_top(t, 1.0), t) and not merge.trim_top(t, 0.1).any()


def test_simplex_grid():
    g = merge.simplex_grid(3, 0.5)
    assert g[0] == pytest.approx((1 / 3, 1 / 3, 1 / 3)) and len(g) == 1 + 6
    assert all(abs(sum(p) - 1) < 1e-9 and min(p) >= 0 for p in g)
    assert len(merge.simplex_grid(4, 0.25)) == 35   # uniform is on this grid: listed once, first


# ----------------------------------------------------------------------------- streaming

@pytest.mark.parametrize("method", merge.METHODS)
def test_streaming_equals_in_memory(ckpts, tmp_path, method):
    _, base, models = ckpts
    w = [0.3, 0.3, 0.4]
    # shards of ~4 KB: many output shards and an index, each tensor read from disk on its own
    merge.write_merge(base, models, w, method, str(tmp_path / "out"), density=0.5, seed=7, shard_bytes=4096)
    files = os.listdir(tmp_path / "out")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 3
    b, ms, out = raw(base), [raw(m) for m in models], raw(str(tmp_path / "out"))
    assert set(out) == set(b)
    g = torch.Generator().manual_seed(7)
    for k in sorted(b):   # the in-memory merge: whole state dicts, the same tensor order for DARE's stream
        want = merge.merge_tensor(b[k], [m[k] for m in ms], w, method, 0.5, g)
        assert torch.equal(out[k], want), (method, k)


def test_a_merge_of_bf16_checkpoints_is_written_in_fp32_or_as_asked(micro, tmp_path):
    """At lr 1e-6 an RL stage moves most weights by about one bf16 step: lambda = 1/4 of such a task vector is below
    bf16's resolution and a bf16 merge rounds it away. By default the merge is fp32 (config.json says so); with
    dtype=None (--save-dtype base) it keeps the base's bf16."""
    model, tok = micro
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_checkpoint(str(tmp_path / "b"), model, tok, {}, state_dict=dict(sd))   # save_pretrained may consume its dict
    moved = {k: (v.float() * (1 + 2 ** -7)).to(torch.bfloat16) for k, v in sd.items()}   # about one bf16 step
    save_checkpoint(str(tmp_path / "m"), model, tok, {}, state_dict=dict(moved))
    merge.write_merge(str(tmp_path / "b"), [str(tmp_path / "m")], [0.25], "task_arithmetic", str(tmp_path / "o"))
    header, _ = read_header(str(tmp_path / "o" / "model.safetensors"))
    assert {v["dtype"] for v in header.values()} == {"F32"}
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "float32"
    out = load(str(tmp_path / "o"))
    for k in sd:
        want = sd[k].float() + 0.25 * (moved[k].float() - sd[k].float())
        assert torch.equal(out[k], want), k
    assert any(not torch.equal(out[k].to(torch.bfloat16), sd[k]) for k in sd)
    merge.write_merge(str(tmp_path / "b"), [str(tmp_path / "m")], [1.0], "task_arithmetic", str(tmp_path / "o2"),
                      dtype=None)
    header, _ = read_header(str(tmp_path / "o2" / "model.safetensors"))
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    out = load(str(tmp_path / "o2"))
    assert all(torch.equal(out[k].to(torch.bfloat16), moved[k]) for k in sd)


# ----------------------------------------------------------------------------- command line

def test_cli_writes_a_loadable_checkpoint_with_meta(ckpts, tmp_path):
    _, base, models = ckpts
    r = run("--base", base, "--models", *models, "--weights", "0.2", "0.3", "0.5", "--method", "ties",
            "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((tmp_path / "m" / "acl_meta.json").read_text())
    assert meta["method"] == "merge" and meta["merge"]["weights"] == [0.2, 0.3, 0.5] and meta["merge"]["density"] == 0.5
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert AutoTokenizer.from_pretrained(tmp_path / "m").chat_template
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_a_rerun_keeps_a_merge_of_the_same_inputs_and_refuses_one_whose_inputs_were_replaced(ckpts, tmp_path):
    """arena.sh restarted: the same merge of the same checkpoints is kept (nothing written); after a stage is replaced
    under its path (lineage by identity) the old merge is stale: refused in one line, replaced with --overwrite."""
    root, base, _ = ckpts
    models = [shutil.copytree(m, tmp_path / os.path.basename(m)) for m in ckpts[2]]
    args = ["--base", base, "--models", *map(str, models), "--search", "uniform", "--out", str(tmp_path / "m")]
    assert run(*args).returncode == 0
    stamp = (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns
    r = run(*args)
    assert r.returncode == 0 and "nothing to do" in r.stdout
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns == stamp
    meta = json.loads((models[1] / "acl_meta.json").read_text())
    (models[1] / "acl_meta.json").write_text(json.dumps(dict(meta, save_id="another")))   # s1 replaced in place
    r = run(*args)
    assert r.returncode == 2 and "--overwrite" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run(*args, "--overwrite")
    assert r.returncode == 0 and "nothing to do" not in r.stdout
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns != stamp


@pytest.mark.parametrize("case,msg", [
    ("weights", "3 weights for 2 models"),
    ("missing", "not a checkpoint directory"),
    ("arch", "mismatched architectures"),
    ("both", "either --weights"),
    ("density", "--density must be in (0, 1]"),
    ("balanced", "needs --oracles"),
    ("domains", "one domain per model"),
])
def test_bad_input_stops_before_writing(ckpts, tmp_path, case, msg, call):
    root, base, models = ckpts
    out = tmp_path / "never"
    args = {"weights": ["--models", *models[:2], "--weights", "1", "1", "1"],
            "missing": ["--models", models[0], str(root / "nope"), "--weights", "1", "1"],
            "arch": ["--models", models[0], str(root / "other"), "--weights", "1", "1"],
            "both": ["--models", *models, "--weights", "1", "1", "1", "--search", "uniform"],
            "density": ["--models", *models, "--weights", "1", "1", "1", "--density", "0"],
            "balanced": ["--models", *models, "--search", "balanced", "--domains", "math,if,search"],
            "domains": ["--models", *models, "--search", "grid", "--domains", "math,if"]}[case]
    if case == "arch" and not (root / "other").exists():
        from transformers import Qwen3Config, Qwen3ForCausalLM
        cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, intermediate_size=64)
        save_checkpoint(str(root / "other"), Qwen3ForCausalLM(cfg), None, {})
    r = call(merge.main, ["--base", base, *args, "--out", str(out)])
    assert r.returncode != 0 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_grid_search_end_to_end_on_val_tasks(ckpts, tmp_path):
    _, base, models = ckpts
    r = run("--base", base, "--models", *models[:2], "--search", "grid", "--domains", "math,if", "--grid-step", "0.5",
            "--search-n", "3", "--batch", "8", "--out", str(tmp_path / "grid"), "--threads", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("candidate ")]
    assert len(lines) == 3   # uniform (0.5, 0.5) first, then (0, 1) and (1, 0)
    meta = json.loads((tmp_path / "grid" / "acl_meta.json").read_text())
    cands = meta["candidates"]
    assert len(cands) == 3 and meta["search"] == "grid"
    assert all(set(c["scores"]) == {"math", "if"} for c in cands)
    assert meta["merge"]["weights"] == max(cands, key=lambda c: c["objective"])["weights"]
    assert "math/val seed" in r.stdout and not re.search(r"\w/(test|ood) seed", r.stdout)   # val tasks only
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]   # the candidates' scratch is gone
    # balanced needs an oracle that scores above 0: untrained micro oracles stop it with one line
    r = run("--base", base, "--models", *models[:2], "--search", "balanced", "--domains", "math,if", "--grid-step",
            "0.5", "--search-n", "2", "--oracles", *models[:2], "--out", str(tmp_path / "bal"), "--threads", "1")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1] == \
        "error: balanced search: every oracle scores 0 on its val tasks; nothing to normalise by"
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "bal").exists()


def test_grid_and_balanced_pick_their_own_winners(ckpts, tmp_path, monkeypatch):
    """Scores made up from the candidate's lambda: math = lambda_0, if = lambda_1 / 2; oracles math 1, if 0.5.
    grid (the mean) prefers (1, 0); balanced (the min of score / oracle) prefers the uniform (0.5, 0.5)."""
    _, base, models = ckpts

    def fake_scores(ckpt, tasks, domains, batch):
        if ckpt in models:   # an oracle
            return {"math": 1.0} if domains == ["math"] else {"if": 0.5}
        lam = json.loads(open(os.path.join(ckpt, "acl_meta.json")).read())["merge"]["weights"]
        return {"math": lam[0], "if": lam[1] / 2}

    monkeypatch.setattr(merge, "val_scores", fake_scores)
    for mode, want in (("grid", [1.0, 0.0]), ("balanced", [0.5, 0.5])):
        extra = ["--oracles", *models[:2]] if mode == "balanced" else []
        merge.main(["--base", base, "--models", *models[:2], "--search", mode, "--domains", "math,if",
                    "--grid-step", "0.5", "--search-n", "2", *extra, "--out", str(tmp_path / mode)])
        meta = json.loads((tmp_path / mode / "acl_meta.json").read_text())
        assert meta["merge"]["weights"] == want, mode
        objectives = {tuple(c["weights"]): c["objective"] for c in meta["candidates"]}
        if mode == "grid":
            assert objectives == {(0.5, 0.5): 0.375, (0.0, 1.0): 0.25, (1.0, 0.0): 0.5}
        else:
            assert objectives == {(0.5, 0.5): 0.5, (0.0, 1.0): 0.0, (1.0, 0.0): 0.0}
            assert meta["oracle_val"] == {"math": 1.0, "if": 0.5}
    # balanced on the grid's scores (--scores-from): no candidate scored again, the same winner and objectives
    monkeypatch.setattr(merge, "val_scores", lambda ckpt, *a: fake_scores(ckpt, *a) if ckpt in models else 1 / 0)
    merge.main(["--base", base, "--models", *models[:2], "--search", "balanced", "--domains", "math,if", "--grid-step",
                "0.5", "--search-n", "2", "--oracles", *models[:2], "--scores-from", str(tmp_path / "grid"),
                "--out", str(tmp_path / "reused")])
    reused = json.loads((tmp_path / "reused" / "acl_meta.json").read_text())
    assert reused["merge"]["weights"] == [0.5, 0.5] and reused["candidates"] == meta["candidates"]
    with pytest.raises(SystemExit):   # scored with another grid: refused before any work
        merge.main(["--base", base, "--models", *models[:2], "--search", "balanced", "--domains", "math,if",
                    "--grid-step", "1.0", "--search-n", "2", "--oracles", *models[:2], "--scores-from",
                    str(tmp_path / "grid"), "--out", str(tmp_path / "other")])
    assert not (tmp_path / "other").exists()


def test_search_ties_go_to_the_first_candidate(ckpts, tmp_path, monkeypatch):
    """Two candidates whose val means are equal but whose float sums are not (0.15 + 0.15 < 0.1 + 0.2): the first
    listed, the uniform point, wins, as the search promises; a float rounding must not pick the later one."""
    _, base, models = ckpts

    def fake_scores(ckpt, tasks, domains, batch):
        lam = json.loads(open(os.path.join(ckpt, "acl_meta.json")).read())["merge"]["weights"]
        return {(0.5, 0.5): {"math": 0.15, "if": 0.15}, (1.0, 0.0): {"math": 0.1, "if": 0.2}}.get(
            tuple(lam), {"math": 0.0, "if": 0.0})

    assert 0.1 + 0.2 > 0.15 + 0.15
    monkeypatch.setattr(merge, "val_scores", fake_scores)
    merge.main(["--base", base, "--models", *models[:2], "--search", "grid", "--domains", "math,if",
                "--grid-step", "0.5", "--search-n", "2", "--out", str(tmp_path / "grid")])
    assert json.loads((tmp_path / "grid" / "acl_meta.json").read_text())["merge"]["weights"] == [0.5, 0.5]
