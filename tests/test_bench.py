"""Every benchmark in bench/ run as a user runs it (python bench/X.py ...), with tiny settings so that each takes
seconds, so that no bench rots unseen. Our side runs everywhere (--sides ours/hf, or gpu_step.py --smoke); the
full comparison runs where the peer is installed and is skipped, naming the package, where it is not.
The benches' random models (no --ckpt) go to a temporary directory: TMPDIR points them at pytest's tmp_path."""
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # the slow tier: bash test.sh -m slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(tmp_path, *args, timeout=300) -> str:
    """Run `python <args>` in the repository root, as a user would; -> its stdout (fails with its output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TMPDIR=str(tmp_path))
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def table(out: str) -> dict:
    """The markdown table rows of `out`: {first cell: [the other cells]} (header and separator included)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("|")]
    return {r[0]: r[1:] for r in rows}


# ----------------------------------------------------------------------------- bench/grpo_vs_trl.py
GRPO = ["bench/grpo_vs_trl.py", "--prompts", "2", "--group", "2", "--max-new-tokens", "8", "--repeats", "1"]


def check_grpo_row(row, max_new_tokens=8):
    gen, train, total, tokens, longest, _load = map(float, row)
    assert gen > 0 and train > 0 and total == pytest.approx(gen + train, abs=0.011)
    assert 0 < longest <= max_new_tokens and longest <= tokens <= 2 * 2 * max_new_tokens


def test_grpo_vs_trl_ours(tmp_path):
    out = bench(tmp_path, *GRPO, "--sides", "ours", "--ckpt", str(tmp_path / "absent"))
    assert "building a random tiny model" in out and "ours update 1:" in out
    rows = table(out)
    check_grpo_row(rows["ours"])
    assert "TRL" not in rows and "ratio" not in out


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed: pip install trl")
def test_grpo_vs_trl_full(tmp_path):
    out = bench(tmp_path, *GRPO, "--ckpt", str(tmp_path / "absent"))
    rows = table(out)
    check_grpo_row(rows["ours"])
    check_grpo_row(rows["TRL"])
    assert re.search(r"ratio ours/TRL: \d+\.\d\d \(target <= 0\.7\) \| gen \d+\.\d\d \| train \d+\.\d\d", out)


# ----------------------------------------------------------------------------- bench/merge_vs_mergekit.py
MERGE = ["bench/merge_vs_mergekit.py", "--synthetic-mb", "1", "--models", "2", "--repeats", "1"]


def merge_rows(out: str) -> dict:
    """{side: (wall s, peak RSS MB)} from the bench's fixed-width table."""
    rows = re.finditer(r"^(merge\.py|mergekit)\s+([\d.]+)\s+(\d+)$", out, re.M)
    return {m[1]: (float(m[2]), float(m[3])) for m in rows}


def test_merge_vs_mergekit_ours(tmp_path):
    out = bench(tmp_path, *MERGE, "--sides", "ours")
    assert "task_arithmetic merge, synthetic: base + 2 models of ~1 MB, best of 1" in out
    rows = merge_rows(out)
    assert list(rows) == ["merge.py"] and rows["merge.py"][0] > 0 and rows["merge.py"][1] > 0
    assert "ratio" not in out


@pytest.mark.skipif(shutil.which("mergekit-yaml") is None, reason="mergekit not installed: pip install mergekit==0.1.5")
def test_merge_vs_mergekit_full(tmp_path):
    out = bench(tmp_path, *MERGE)
    rows = merge_rows(out)
    assert set(rows) == {"merge.py", "mergekit"} and all(t > 0 and rss > 0 for t, rss in rows.values())
    m = re.search(r"ratio merge\.py / mergekit: time [\d.]+, memory [\d.]+; max \|difference\| (\S+)", out)
    assert m and float(m[1]) <= 1e-6   # the same merge: the two outputs agree


# ----------------------------------------------------------------------------- bench/rollout_hf_vs_vllm.py
ROLLOUT = ["bench/rollout_hf_vs_vllm.py", "--n", "1", "--samples", "2", "--max-turn-tokens", "8"]
DOMAINS = ["math", "search", "ecommerce", "if"]


def check_rollout_rows(rows, side, cols):
    """The side's tokens, seconds and tok/s per domain (sampled tokens > 0 everywhere), the "all" row their sum."""
    t = cols.index(f"{side} tokens")
    for d in DOMAINS:
        assert int(rows[d][t]) > 0 and float(rows[d][t + 2]) > 0, (side, d, rows[d])
        assert 0 <= float(rows[d][cols.index(f"{side} reward")]) <= 1
    assert int(rows["all"][t]) == sum(int(rows[d][t]) for d in DOMAINS)
    assert rows["all"][cols.index(f"{side} reward")] == "-"


def test_rollout_hf_vs_vllm_hf(tmp_path):
    out = bench(tmp_path, *ROLLOUT, "--sides", "hf", "--ckpt", str(tmp_path / "absent"))
    rows = table(out)
    cols = rows["domain"]
    assert cols == ["hf tokens", "hf s", "hf tok/s", "hf reward"]
    check_rollout_rows(rows, "hf", cols)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm not installed here: bash tests/setup_vllm_cpu.sh, then .venv-vllm/bin/python -m "
                           "pytest -q tests/test_bench.py::test_rollout_hf_vs_vllm")
def test_rollout_hf_vs_vllm(tmp_path):
    out = bench(tmp_path, *ROLLOUT, "--ckpt", str(tmp_path / "absent"), timeout=600)
    rows = table(out)
    cols = rows["domain"]
    assert cols == ["hf tokens", "hf s", "hf tok/s", "vllm tokens", "vllm s", "vllm tok/s", "vllm/hf", "hf reward",
                    "vllm reward"]
    check_rollout_rows(rows, "hf", cols)
    check_rollout_rows(rows, "vllm", cols)
    assert all(re.fullmatch(r"\d+\.\d\dx", rows[d][cols.index("vllm/hf")]) for d in DOMAINS + ["all"])


# ----------------------------------------------------------------------------- bench/gpu.sh + bench/gpu_step.py
def gpu_sh_commands() -> list:
    """gpu.sh's torchrun lines, as argument lists after `torchrun`."""
    with open(os.path.join(ROOT, "bench", "gpu.sh")) as f:
        return [shlex.split(line.split(" || ")[0])[1:] for line in f if line.startswith("torchrun ")]


@pytest.mark.parametrize("args", gpu_sh_commands(), ids=lambda a: " ".join(a[2:]))
def test_gpu_step_smoke(tmp_path, args):
    """Each of gpu.sh's commands with --smoke: the same code (FSDP2 under torchrun, train_on with grpo_loss, the
    hf backend) on a micro model and tiny sizes on the CPU; the GPU figures themselves need the H200."""
    out = bench(tmp_path, "-m", "torch.distributed.run", *args, "--smoke")
    rows = table(out)
    ckpt = "--grad-ckpt" in args
    assert any(k.startswith(f"GRPO update: 4 sequences of 16+24 tokens, micro-batch 2, grad ckpt {ckpt}") for k in rows)
    assert float(rows["training tokens/s"][0].replace(",", "")) > 0
    assert re.fullmatch(r"\d+\.\d%.*", rows["MFU (vs 989 TFLOP/s nominal bf16 dense)"][0])
    assert "peak GPU memory, training: allocated, reserved" in rows
    assert float(rows["hf generation: 4 x (8 prompt + 8 new) tokens/s, eager"][0].replace(",", "")) > 0
    graphs = [v[0] for k, v in rows.items() if k.startswith("same, decode steps as CUDA graphs")]
    assert len(graphs) == 1 and re.fullmatch(r"[\d,]+ \(\d+\.\d\dx eager; .*\)", graphs[0]), graphs
    lora = [v[0] for k, v in rows.items() if k.startswith("LoRA rank")]
    assert len(lora) == ("--lora" in args) and all(re.fullmatch(r"[\d,]+ \(\d+\.\d\dx full fine-tuning\), .*", x) for x in lora)
    comp = [v[0] for k, v in rows.items() if k.startswith("same update, norms and SwiGLU compiled")]
    assert len(comp) == ("--compile" in args) and all(re.fullmatch(r"[\d,]+ \(\d+\.\d\dx eager; loss .*\), \d+\.\d%, .*",
                                                                   x) for x in comp)


def test_gpu_step_a_failed_row_keeps_the_others(tmp_path):
    """A measurement that raises (LoRA's expert here, out of memory as on a GPU that is too small) is a row that says
    so; the rows before and after it still print, and the bench exits 1 naming it (gpu.sh then runs its next line)."""
    code = ("import sys, torch, mle\n"
            "def oom(*a, **k): raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
            "mle.with_adapter = oom\n"
            "sys.path.insert(0, 'bench'); import gpu_step; gpu_step.main(['--smoke', '--lora', '4'])\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)))
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    rows = table(p.stdout)
    lora = rows["LoRA rank 4 expert, same update: tokens/s, x full, peak memory"][0]
    assert lora.startswith("failed: OutOfMemoryError: CUDA out of memory"), lora
    assert float(rows["training tokens/s"][0].replace(",", "")) > 0     # measured before it
    assert float(rows["hf generation: 4 x (8 prompt + 8 new) tokens/s, eager"][0].replace(",", "")) > 0   # after it
    assert "FAILED: LoRA rank 4 expert" in p.stdout
    with open(os.path.join(ROOT, "bench", "gpu.sh")) as f:   # a failed line does not stop the next one
        text = f.read()
    assert "set -e" not in text and text.count("|| rc=1") == len(gpu_sh_commands()) == 2 and "exit $rc" in text


# ----------------------------------------------------------------------------- bench/bm25_index.py

def test_bm25_index_once_per_node(tmp_path):
    out = bench(tmp_path, "bench/bm25_index.py", "--passages", "300", "--words", "20", "--vocab", "500", "--ranks", "4")
    rows = table(out)
    assert "corpus: 300 passages" in out and "wiki-18 (21M passages), extrapolated linearly" in out
    before = rows["before: every rank builds its own"]
    after = rows["for_corpus: local rank 0 builds, all load it mapped"]
    assert "(each, at once)" in before[0] and "(once)" in after[0] and float(after[2]) >= 0 and float(after[3]) > 0


def test_gpu_check_runs_every_step_on_the_cpu(tmp_path):
    """bench/gpu_check.sh --cpu: the install check, the GPU tier of the tests and the hf backend on stock sdpa (on the
    CPU), and the step figures at smoke size, each step's status in the log under $OUT, so the script a lent GPU runs
    has run before."""
    env = {k: v for k, v in os.environ.items() if k != "WHL"}   # --cpu: no wheels (not even a .whl/ left here)
    r = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=dict(env, OUT=str(tmp_path), TOKENIZERS_PARALLELISM="false"))
    assert r.returncode == 0, r.stdout[-3000:]
    log = (tmp_path / "gpu_check.log").read_text()
    for name in ("install", "gpu-tier", "kv-sdpa", "step-figures", "memory-8b-width"):
        assert f"== {name}: exit 0" in log, log[-2000:]
    assert "3 passed" in log and "2 passed" in log and "every step passed" in log and "== wheels" not in log
    assert "sampled log-probs against teacher forcing on cpu" in log
    assert "graph-decoded log-probs against teacher forcing on cpu" in log
    assert "at 3 layers" in log and "| training memory: --dry-run's estimate, measured allocated ÷ it |" in log


def test_gpu_check_fits_its_eight_minutes():
    """The GPU branch of gpu_check.sh: every step under a timeout, within 480 s in all (a lent GPU gives ~15 minutes
    in all, one call at most 10): the step figures get what is left of the 480 s less the later steps' timeouts, at
    least 150 s when every step before them runs to its own; and the same steps as the --cpu branch that CI runs."""
    text = open(os.path.join(ROOT, "bench", "gpu_check.sh")).read()
    cpu, gpu = text.split('\nif [ "$CPU" = 1 ]; then\n', 1)[1].split("\nelse\n", 1)
    gpu = gpu.split("\nfi\n", 1)[0]
    steps = lambda branch: re.findall(r"^\s*step (\S+)", branch, re.M)
    assert steps(gpu) == steps(cpu) and len(steps(gpu)) == 5
    limits = re.findall(r'^\s*step (\S+) timeout (\d+|"\$\(left (\d+)\)") ', gpu, re.M)
    assert len(limits) == 5 and "local s=$(( 480 - ($(date +%s) - T0) - $1 ))" in text, limits
    fixed = [int(t) for _, t, _ in limits if t.isdigit()]
    (i, keep), = [(i, int(k)) for i, (_, t, k) in enumerate(limits) if not t.isdigit()]
    assert limits[i][0] == "step-figures" and keep == sum(fixed[i:]), (limits, keep)
    assert 480 - sum(fixed) >= 150, fixed   # the step figures' least


def test_gpu_wheels_for_a_machine_without_an_index(tmp_path):
    """bench/gpu_wheels.sh (needs the package index, as CI's install does): the packages a lent GPU's image lacks,
    pure-Python wheels at requirements.txt's pins, one version each; installed the way gpu_check.sh installs them
    (no index, no dependencies, --target) they are there at those versions; a second run adds nothing."""
    import importlib.metadata as md
    env = dict(os.environ, WHL=str(tmp_path / "whl"))
    run = lambda: subprocess.run(["bash", "bench/gpu_wheels.sh"], cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: E731
                                 timeout=300)
    r = run()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheels = sorted(os.listdir(tmp_path / "whl"))
    assert all(re.fullmatch(r"[\w.]+-[\w.]+-py3\d*-none-any\.whl", w) for w in wheels), wheels
    assert run().returncode == 0 and sorted(os.listdir(tmp_path / "whl")) == wheels
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",   # the image's Python
                    *[str(tmp_path / "whl" / w) for w in wheels]], check=True, capture_output=True, timeout=300)
    got = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions(path=[str(site)])}
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = dict(line.strip().split("==") for line in f if "==" in line and not line.startswith("#"))
    for name in ("bm25s", "langdetect", "math-verify", "datasets"):
        assert got.get(name) == pins[name], (name, got)
    assert len(got) == len(wheels) == 8, got
    with open(os.path.join(ROOT, "bench", "gpu_check.sh")) as f:
        assert '--no-index --no-deps' in f.read()


# ----------------------------------------------------------------------------- bench/tiny_sizes.py
def test_tiny_sizes_smoke(tmp_path):
    """Two sizes at toy batch and length: every column, the 1 M model as the peer (ratio 1.00), positive rates; a bad
    size stops in one line."""
    rows = table(bench(tmp_path, "bench/tiny_sizes.py", "--smoke", "--threads", "1"))
    assert rows["size"] == ["parameters", "decode tokens/s", "train tokens/s", "decode ÷ 1m", "train ÷ 1m"]
    assert rows["1m"][0] == "1.09 M" and rows["1m"][3:] == ["1.00", "1.00"] and rows["3m"][0] == "3.21 M"
    assert all(float(x.replace(",", "")) > 0 for r in ("1m", "3m") for x in rows[r][1:3])
    p = subprocess.run([sys.executable, "bench/tiny_sizes.py", "--sizes", "2m"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and p.stderr.strip() == "error: unknown size '2m' (of 1m, 3m, 6m, 12m)"


# ----------------------------------------------------------------------------- bench/logprob_memory.py
def test_logprob_memory_smoke(tmp_path):
    """Both paths measured, each in its own process: the fused head keeps less for backward than the logits path
    (the (B, T, V) logits and their log-softmax are what it no longer holds)."""
    out = bench(tmp_path, "bench/logprob_memory.py", "--smoke", "--threads", "1", timeout=600)   # two processes
    rows = table(out)
    assert rows["path"] == ["saved for backward", "peak above start", "aten ops", "seconds"]
    mib = {p: float(rows[p][0].split()[0]) for p in ("logits", "fused")}
    assert 0 < mib["fused"] < mib["logits"], out
    assert "fused / logits: saved" in out
