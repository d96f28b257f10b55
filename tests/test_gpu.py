"""The GPU tier (pytest -m gpu; bench/gpu_check.sh runs it): what only a GPU run can show, each test skipped without
CUDA. ACL_TEST_DEVICE=cpu runs the same tests on the CPU (bench/gpu_check.sh --cpu, in CI), so the tier itself is
checked everywhere; only on a GPU does it check NCCL, CUDA kernels and bf16.
  - the collective helpers, a GRPO update under FSDP2 (bf16 on GPUs) and a DCP resume round trip, under torchrun;
  - two sequential stages under torchrun with rank 0's checkpoint writes slowed down (the stage hand-off);
  - bf16 token log-probs against the fp32 reference;
  - the hf backend's kept-cache decoding (multi-turn, continuous batching) on stock sdpa against full re-prefill
    (greedy: token ids, masks, rewards) and its sampled log-probs against teacher forcing, on every domain;
  - the same with every decode step replayed as a CUDA graph (GraphDecode; on the CPU its static step, eagerly)."""
import os
import subprocess
import sys

import pytest
import torch
from test_train_seq import FAST, micro_base  # noqa: F401 (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = os.environ.get("ACL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason="the GPU tier needs CUDA "
                                                                         "(ACL_TEST_DEVICE=cpu runs it on the CPU)")]
NPROC = str(min(2, torch.cuda.device_count())) if DEVICE == "cuda" else "2"


def torchrun(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if DEVICE == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_collectives_an_update_and_a_resume_under_torchrun(tmp_path):
    r = torchrun(os.path.join(ROOT, "tests", "dist_device.py"), str(tmp_path / "seen.pt"))
    assert r.returncode == 0, r.stderr[-3000:]
    seen = torch.load(tmp_path / "seen.pt")
    n = int(NPROC)
    assert seen["device"].startswith(DEVICE) and seen["sum"] == n * (n + 1) / 2 and seen["max"] == n - 1
    assert seen["mean"] == pytest.approx((n - 1) / 2) and seen["bcast"] == {"from": 0}
    assert seen["loss"] == seen["loss"] and 0 < seen["grad_norm"] < float("inf")
    assert seen["restored"] and seen["extra"] == {"step": 1}


def test_two_stages_hand_off_under_torchrun(micro_base, tmp_path):  # noqa: F811
    runs = str(tmp_path / "runs")
    r = torchrun(os.path.join(ROOT, "tests", "dist_slow_write.py"), "4", "--init", micro_base, "--runs", runs,
                 "--curriculum", "math,search", *FAST, "--eval-n", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{NPROC} rank(s) on {DEVICE}" in r.stdout and "[seq/2-search] step 2/2" in r.stdout
    assert os.path.isfile(os.path.join(runs, "seq", "2-search", "model.safetensors"))


def test_bf16_logprobs_are_the_fp32_reference_within_bf16_rounding(micro):
    from acl.step import selected_logprobs
    model, tok = micro
    ids = torch.tensor([tok("What is 12+7? \\boxed{19} Tomas Velder was born in Brimsk.")["input_ids"]] * 2)
    with torch.no_grad():
        ref = selected_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
        low = model.to(DEVICE, torch.bfloat16)
        got = selected_logprobs(low(input_ids=ids.to(DEVICE)).logits[:, :-1], ids[:, 1:].to(DEVICE)).float().cpu()
    model.to("cpu", torch.float32)
    assert (got - ref).abs().max() < 0.1 and (got - ref).abs().mean() < 0.02, (got - ref).abs().max()


def test_kept_cache_decoding_equals_re_prefill_on_the_device(tiny_agent):
    """The hf backend's kept caches and continuous batching on the device's stock attention (sdpa: kept caches,
    padding inside a row, stacked parts), against full re-prefill and teacher forcing, as tests/test_engine.py
    checks them on the CPU with stock sdpa (shared_attention False)."""
    from test_engine import check_kept_equals_re_prefill, check_sampled_logprobs_are_teacher_forced, tiny_policy
    model, tok = tiny_policy(tiny_agent, torch.device(DEVICE))
    assert model.config._attn_implementation == "sdpa"
    check_kept_equals_re_prefill(model, tok, shared_attention=False)
    worst = check_sampled_logprobs_are_teacher_forced(model, tok, shared_attention=False)
    print(f"sampled log-probs against teacher forcing on {DEVICE}: {worst:.2e} at most")


def test_graph_decoding_equals_re_prefill_on_the_device(tiny_agent):
    """The decode steps as CUDA graphs (HFBackend(graphs=True): static buffers, a graph per batch size, rows that end
    kept in the batch until they are half of it) against full re-prefill, greedily, and sampled log-probs against
    teacher forcing, on every domain, turn by turn and with continuous batching (each admit a new batch size)."""
    from test_engine import check_kept_equals_re_prefill, check_sampled_logprobs_are_teacher_forced, tiny_policy
    model, tok = tiny_policy(tiny_agent, torch.device(DEVICE))
    check_kept_equals_re_prefill(model, tok, shared_attention=False, graphs=True)
    worst = check_sampled_logprobs_are_teacher_forced(model, tok, shared_attention=False, graphs=True)
    print(f"graph-decoded log-probs against teacher forcing on {DEVICE}: {worst:.2e} at most")
