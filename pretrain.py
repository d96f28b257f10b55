"""The tiny arena's base: a byte-level BPE tokenizer, a Qwen3-architecture model of about a million parameters,
and its pre-training on each domain's knowledge as plain text, so the base knows the domains but not the agent
protocol, which the stages teach (as a real base knows mathematics but not an RL recipe's answer format).

    python pretrain.py                                  # -> runs/tiny/base (2 CPU cores; time in the README)
    python pretrain.py --out runs/tiny/base --steps 3000 --seed 0 --n-docs 10000   # the same
    python pretrain.py --out runs/tiny/base-nodrill --drill-steps 0     # no induction drill

It prints its progress on stdout: a line per domain of the corpus, the tokenizer, the encoding at every
quarter, then the drill and the pre-training every 5% of their steps (step/steps, loss, lr, elapsed and
ETA; the drill's ETA is to its step limit, an upper bound: it stops once copying has formed).

Differences from the paper (which starts from Qwen3-8B-Base):
1. The base is built here from scratch; its pre-training corpus is each domain's knowledge in plain text
   (Env.knowledge: worked arithmetic, encyclopaedia passages and reading comprehension, a store's catalogue,
   policy and case notes, writing of many kinds), never the chat template, tool calls, \\boxed{} or <answer>
   (envs.base.PROTOCOL_MARKERS); the tokenizer has also read the protocol's text (protocol_texts), as a real
   base's tokenizer has. Each stage's cold start teaches the protocol.
2. Before that pre-training, an induction drill (random token sequences said three times, loss on the
   repeats, lr 1e-2, until its loss is below 0.5 nats; a round that has not got there by step 1,500 gives up and
   the next starts from a fresh initialisation on fresh sequences, up to 12 rounds: about 1 in 3 rounds forms it): without it the ~1M model never learns to copy by position,
   and search sits at 0% EM (the README's base section has the measurements).
3. The chat template is Qwen3's format (<|im_start|>role ... <|im_end|>, <tool_call>, tool results as
   <tool_response> inside a user turn) but lists tools compactly, one `name(arg, ...)` line each,
   because the tiny model pays for every prompt token.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch

from acl.common import Parser, check_output, eta, usage_exit

# The chat template: Qwen3's layout, tools listed compactly. `{% generation %}` marks the assistant
# tokens so apply_chat_template(..., return_assistant_tokens_mask=True) can mask the loss.
CHAT_TEMPLATE = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}{%- if sys -%}{{- sys + '\\n' -}}{%- endif -%}{{- '# Tools' -}}"
    "{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}"
    "{{- '\\n' + f.name + '(' -}}"
    "{%- if f.parameters is defined and f.parameters.properties is defined -%}{{- f.parameters.properties.keys()|join(', ') -}}{%- endif -%}"
    "{{- ')' -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif sys -%}{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}{%- generation -%}{{- m.content or '' -}}"
    "{%- for tc in (m.tool_calls or []) -%}{{- '<tool_call>' + ((tc.function if tc.function is defined else tc) | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# The pre-tokenizer split, Qwen2/3's with one change. As in Qwen, every digit is its own pre-token.
# Unlike Qwen, a word never absorbs the character before it (Qwen: " Rogom", "\"Rogom", ">Rogom" are three
# different tokens), so a name or an id is the same tokens in a question, a JSON argument, a tool result
# and an <answer> tag, and copying it is token identity: a ~1M model learns that, not the mapping between
# the variants. Spaces become tokens of their own; sequences get ~20% longer.
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Model sizes (Qwen3 architecture, tied embeddings). The design notes: ~0.6M learned three toy tasks and
# 3.3M was no better but 3-4x slower; four domains with multi-turn tool use want a little more.
SIZES = {
    "tiny": dict(hidden_size=160, num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=1,
                 head_dim=32, intermediate_size=512),
    "micro": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, intermediate_size=128),   # for unit tests: seconds, not minutes
}


def train_tokenizer(texts, vocab_size: int = 1024):
    """A byte-level BPE tokenizer in Qwen's style, trained on `texts`, with the chat template set."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL + ADDED, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=SPECIAL[1:], clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    hf.padding_side = "left"
    return hf


def model_config(tokenizer, size: str = "tiny", max_len: int = 1024):
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=max_len,
                       rope_theta=10000.0, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, **SIZES[size])


def log_every_for(total: int, share: float = 0.05) -> int:
    """A progress line every this many of `total` steps: about every `share` of them (5%: ~20 lines)."""
    return max(1, round(total * share))


def build_corpus(n_docs: int, seed: int, domains=None, progress: bool = False):
    """The pre-training documents, [(domain, text)]: n_docs of each domain's knowledge in plain text (Env.knowledge:
    worked arithmetic, encyclopaedia passages and reading, a store's catalogue, policy and case notes, writing of
    many kinds), never the agent protocol. progress: a line per domain with its time and the time so far."""
    from envs import DOMAINS, make_env
    docs, t0 = [], time.time()
    for i, d in enumerate(domains or DOMAINS):
        t1 = time.time()
        texts = make_env(d).knowledge(n_docs, seed=seed * 1000 + i)
        docs += [(d, x) for x in texts]
        if progress:
            print(f"corpus {i + 1}/{len(domains or DOMAINS)}: {len(texts)} {d} documents in {time.time() - t1:.1f}s "
                  f"| {time.time() - t0:.0f}s elapsed", flush=True)
    return docs


def protocol_texts(domains=None, n: int = 200) -> list:
    """What the stages will have the model read and write, for the tokenizer's vocabulary only (never a pre-training
    document): n train tasks per domain, their tool schemas and messages and the scripted expert's turns. A real
    base's tokenizer has seen such text too; without it a tool call or a system prompt costs byte-level tokens."""
    from envs import DOMAINS, make_env
    out = []
    for d in domains or DOMAINS:
        env = make_env(d)
        for t in env.tasks("train", n=n, seed=0):
            out.append(json.dumps(t.tools or []) + "\n" + "\n".join(m["content"] for m in t.messages) + "\n"
                       + "\n".join(env.expert(t) or []))
    return out


def corpus_tokenizer(docs, vocab_size: int = 1024, domains=None):
    """The tokenizer trained on build_corpus's documents and the protocol's text (protocol_texts)."""
    return train_tokenizer([t for _, t in docs] + protocol_texts(domains), vocab_size)


def encode_corpus(tokenizer, docs, max_len: int, progress: bool = False):
    """-> list of (group, ids, loss_mask): each document's tokens (cut at max_len), the loss on every token.
    progress: a line at every quarter of the documents, with elapsed time and ETA."""
    rows, cut, t0 = [], 0, time.time()
    every = log_every_for(len(docs), 0.25)
    for k, (group, text) in enumerate(docs, 1):
        ids = tokenizer(text)["input_ids"]
        cut += len(ids) > max_len
        rows.append((group, ids[:max_len], [1] * min(len(ids), max_len)))
        if progress and (k % every == 0 or k == len(docs)):
            print(f"encode {k}/{len(docs)} documents | {eta(t0, k, len(docs) - k)}", flush=True)
    return rows, cut


DEFAULT_MIX = {}   # pre-training weight per group (1 for a group not named): see --mix
DRILL_DONE = 0.5   # nats per repeated token: the copy circuit has formed (uniform guessing costs ~6.9)
# A drill round that has not formed copying by DRILL_PATIENCE steps gives up (its lr schedule stays --drill-steps
# long, so a round that forms is the same computation as without it), and the next starts over from a fresh
# initialisation: a random restart. Measured (2026-12-03, docs/LOG.md): copying formed at step 721-1,007 in the rounds
# that formed it (seeds 0, 2, 3, 4 and 6001, seed 1's round 7); the others were far from it at step ~1,000 (3.2-4.4
# nats; 1.5-3.8 at 1,500; 2.06 at 3,000 for seed 1). That is 5 of 13 initialisations, so at p = 1/3 per round, 12
# rounds all fail about once in 130 builds; a failed round costs ~3 min at 2 threads.
DRILL_PATIENCE = 1500
DRILL_ROUNDS = 12


def copy_rows(pool, n: int, seed: int):
    """Induction drill: n documents, each a random sequence of tokens drawn from `pool` said three times. Only
    copying can predict the repeats (the first copy is noise and carries no loss), which is the skill the
    tiny base lacks: finding a token seen before and reading the one after it. -> rows ("copy", ids, mask).
    Fresh sequences matter: a model drilled on a few thousand fixed ones memorises them instead."""
    rng = random.Random(seed + 7)
    out = []
    for _ in range(n):
        L = rng.randint(8, 48)
        seq = [rng.choice(pool) for _ in range(L)]
        out.append(("copy", seq * 3, [0] * L + [1] * (2 * L)))
    return out


def make_batches(rows, batch_tokens: int):
    """Length-bucketed batches of about batch_tokens tokens each, never mixing groups: {group: [batch]}."""
    groups = {}
    for g, ids, mask in sorted(rows, key=lambda r: (r[0], len(r[1]))):
        bs = groups.setdefault(g, [[]])
        bs[-1].append((ids, mask))
        if len(bs[-1]) * len(ids) >= batch_tokens:
            bs.append([])
    return {g: [b for b in bs if b] for g, bs in groups.items()}


def pretrain(model, rows, steps: int, batch_tokens: int, lr: float, seed: int, log_every: int | None = None,
             mix: dict | None = None, stop_below: float | None = None, name: str = "pre-train",
             give_up_at: int | None = None):
    """AdamW, warmup + cosine decay. Each step draws a group (a domain, or the drill's "copy") with weight
    mix.get(group, 1), then one of its length-bucketed batches: a long multi-turn domain gets as many
    updates as a short one. stop_below: stop early once the mean loss of the last 50 steps is below it;
    give_up_at: with stop_below, stop at this step if that has not happened (the schedule is still `steps` long).
    A progress line (`name`, step/steps, the mean loss since the last line, lr, elapsed, ETA) every log_every
    steps (default: every 5% of steps), at the last step and at an early stop; with stop_below the ETA is
    to `steps`, an upper bound."""
    log_every = log_every or log_every_for(steps)
    rng = random.Random(seed)
    batches = make_batches(rows, batch_tokens)
    names = sorted(batches)
    weights = [(mix or {}).get(g, 1.0) for g in names]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    pad = model.config.pad_token_id
    model.train()
    t0, losses, shown = time.time(), [], 0
    for step in range(1, steps + 1):
        group = rng.choices(names, weights)[0] if mix else rng.choice(names)  # (the same stream as before --mix)
        batch = rng.choice(batches[group])
        T = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), T), pad, dtype=torch.long)      # (B, T), right-padded
        mask = torch.zeros((len(batch), T), dtype=torch.float)        # (B, T) loss mask
        attn = torch.zeros((len(batch), T), dtype=torch.long)
        for i, (x, m) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
            attn[i, : len(x)] = 1
        lr_now = lr * min(1.0, step / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))
        for g in opt.param_groups:
            g["lr"] = lr_now
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # (B, T-1, V)
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                                reduction="none").view(len(batch), T - 1)
        m = mask[:, 1:]
        loss = (nll * m).sum() / m.sum().clamp(min=1)
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite pre-training loss at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        done = stop_below is not None and len(losses) >= 50 and sum(losses[-50:]) / 50 < stop_below
        give_up = stop_below is not None and not done and step == give_up_at
        if step % log_every == 0 or step == steps or done or give_up:
            last, shown = losses[shown:], step   # the loss is the mean over the steps since the last line
            print(f"{name} step {step:5d}/{steps} | loss {sum(last) / len(last):.4f} | lr {lr_now:.2e} "
                  f"| {eta(t0, step, (step if done else min(steps, give_up_at or steps)) - step, at_most=stop_below is not None and not done)}", flush=True)
        if done:
            print(f"stopped at step {step}: the last 50 steps' loss is below {stop_below}", flush=True)
            break
        if give_up:
            print(f"gave up at step {step}: the last 50 steps' loss is still above {stop_below}", flush=True)
            break
    model.eval()
    return losses


def build_fingerprint(docs, config: dict) -> str:
    """sha256 of everything a base build depends on: the corpus (every document), the build's
    settings, and the source of the code that turns them into weights (tokenizer, model, drill, pre-training).
    A committed base whose recorded fingerprint differs from the current code's is stale (tests/test_pretrain.py)."""
    import hashlib
    import inspect
    h = hashlib.sha256()
    code = [train_tokenizer, model_config, protocol_texts, corpus_tokenizer, encode_corpus, copy_rows, make_batches, pretrain, build_base]
    drill = [str(DRILL_DONE), str(DRILL_ROUNDS), str(DRILL_PATIENCE)]
    for part in [CHAT_TEMPLATE, SPLIT, json.dumps(SIZES, sort_keys=True)] + drill + [inspect.getsource(f) for f in code]:
        h.update(part.encode())
    h.update(json.dumps(config, sort_keys=True).encode())
    for doc in docs:
        h.update(json.dumps(doc, sort_keys=True, default=str).encode())
    return h.hexdigest()


def build_base(out: str, steps: int = 12000, seed: int = 0, size: str = "tiny", n_docs: int = 10000,
               vocab_size: int = 1024, batch_tokens: int = 2048, lr: float = 3e-3,
               max_len: int = 2048, domains=None, threads: int | None = None,
               mix: dict | None = None, copy_docs: int = 0, drill_steps: int = 3000, drill_lr: float = 1e-2):
    """Build the tokenizer, the model and pre-train it; save a HF checkpoint at `out`. Returns out."""
    from transformers import Qwen3ForCausalLM

    from acl.common import save_checkpoint, seed_all
    if threads:
        torch.set_num_threads(threads)
    mix = DEFAULT_MIX if mix is None else mix
    seed_all(seed)
    t0 = time.time()
    docs = build_corpus(n_docs, seed, domains, progress=True)
    tok = corpus_tokenizer(docs, vocab_size, domains)
    print(f"tokenizer: {len(tok)} tokens | {time.time() - t0:.0f}s elapsed", flush=True)
    rows, cut = encode_corpus(tok, docs, max_len, progress=True)
    if copy_docs:   # the drill kept up during pre-training, on the corpus's own tokens
        rows += copy_rows([t for _, ids, _ in rows for t in ids], copy_docs, seed)
    n_tok = sum(len(r[1]) for r in rows)
    print(f"corpus: {len(docs)} documents = {n_tok} tokens ({cut} cut at {max_len} tokens); vocab {len(tok)}; "
          f"built in {time.time() - t0:.1f}s", flush=True)
    cfg = model_config(tok, size, max_len)
    model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3 {size}, {n_params / 1e6:.2f}M parameters", flush=True)
    drill_stop, drill_loss = 0, None
    if drill_steps:   # phase 1: the drill alone, at a high lr, until copying forms (a sudden drop of its loss,
        # whose step varies between runs and seeds: 550 in one, 1,007 for seed 0, never for seed 1), then stop.
        # A round that has not formed it by DRILL_PATIENCE is a failed start: seed 1's stalled at a loss of ~2.1,
        # and a second round re-warmed from there stalled too (2.14 after 1,350 more steps). So the next round
        # starts over, from a fresh initialisation (seed + 1000 r) on fresh sequences: a random restart.
        patience = min(DRILL_PATIENCE, drill_steps)
        print(f"induction drill: at most {DRILL_ROUNDS} rounds of {patience} steps (lr {drill_lr}, a schedule of "
              f"{drill_steps}), until its loss < {DRILL_DONE}", flush=True)
        for r in range(DRILL_ROUNDS):   # round 1 is the drill every committed base was built with
            rs = seed + 1000 * r   # round r's initialisation, sequences and batch order
            if r > 0:
                torch.manual_seed(rs)
                model = Qwen3ForCausalLM(cfg)
            losses = pretrain(model, copy_rows(list(range(10, len(tok))), 40 * drill_steps, rs), drill_steps,
                              batch_tokens, drill_lr, rs, stop_below=DRILL_DONE, give_up_at=patience,
                              name="drill" if r == 0 else f"drill round {r + 1}")
            drill_stop += len(losses)
            drill_loss = sum(losses[-50:]) / len(losses[-50:])
            if drill_loss < DRILL_DONE:
                break
        else:
            print(f"warning: the induction drill did not form copying in {DRILL_ROUNDS} rounds of {patience} steps (loss "
                  f"{drill_loss:.2f} > {DRILL_DONE}): this base will hardly copy (search near 0% EM); acl_meta.json "
                  "records drill_formed false", flush=True)
    print(f"pre-training: {steps} steps at lr {lr}", flush=True)
    losses = pretrain(model, rows, steps, batch_tokens, lr, seed, mix=mix)
    elapsed = time.time() - t0
    config = dict(size=size, steps=steps, n_docs=n_docs, vocab_size=vocab_size,
                  batch_tokens=batch_tokens, lr=lr, max_len=max_len, domains=list(domains or []),
                  mix=mix or {}, copy_docs=copy_docs, drill_steps=drill_steps, drill_lr=drill_lr)
    meta = dict(method="base", stage="base", parent=None, curriculum_position=0, step=steps, seed=seed, config=config,
                n_params=n_params, corpus_tokens=n_tok, final_loss=sum(losses[-50:]) / len(losses[-50:]),
                build_seconds=round(elapsed, 1), drill_stopped_at=drill_stop,
                drill_formed=None if drill_loss is None else drill_loss < DRILL_DONE,
                fingerprint=build_fingerprint(docs, dict(config, seed=seed)), torch=torch.__version__)
    save_checkpoint(out, model, tok, meta)
    print(f"saved {out} in {elapsed:.0f}s", flush=True)
    return out


def main():
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/tiny/base", help="checkpoint directory to write (a new one, or a base "
                                                          "this project built, with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it holds a base built here")
    p.add_argument("--steps", type=int, default=12000, help="pre-training steps")
    p.add_argument("--seed", type=int, default=0, help="seed for the corpus, the tokenizer and the init")
    p.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model size")
    p.add_argument("--n-docs", type=int, default=10000, help="knowledge documents per domain (Env.knowledge)")
    p.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size")
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per batch (length-bucketed)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--max-len", type=int, default=2048, help="longest sequence the model is built for")
    p.add_argument("--domains", default="math,search,ecommerce,if", help="domains whose knowledge enters the corpus")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--mix", default=None, help="pre-training weight per group, e.g. search=4,math=2 "
                   "(1 for a group not named; '' = 1 each); default DEFAULT_MIX")
    p.add_argument("--drill-steps", type=int, default=3000, help="induction drill before pre-training: the length "
                   "of its lr schedule on random token sequences said three times, loss on the repeats (0 = none); "
                   f"a round gives up at step min(this, {DRILL_PATIENCE}) and restarts, up to {DRILL_ROUNDS} rounds")
    p.add_argument("--drill-lr", type=float, default=1e-2, help="peak learning rate of the drill")
    p.add_argument("--copy-docs", type=int, default=0, help="drill documents kept in the pre-training mix (group "
                                                               "'copy'), on the corpus's own tokens")
    a = p.parse_args()
    from envs import DOMAINS, parse_domains
    from envs.base import UsageError
    try:
        domains = parse_domains(a.domains)
        if a.steps < 1 or a.n_docs < 1 or a.lr <= 0 or a.vocab_size < 300:
            raise UsageError("need --steps >= 1, --n-docs >= 1, --lr > 0, --vocab-size >= 300")
        if a.drill_steps < 0 or a.drill_lr <= 0 or a.copy_docs < 0:
            raise UsageError("need --drill-steps >= 0, --drill-lr > 0, --copy-docs >= 0")
        if a.batch_tokens < 1 or a.max_len < 64 or (a.threads is not None and a.threads < 1):
            raise UsageError("need --batch-tokens >= 1, --max-len >= 64 and --threads >= 1")
        if not (a.lr < float("inf") and a.drill_lr < float("inf")):
            raise UsageError("--lr and --drill-lr must be finite")
        mix = None if a.mix is None else {}   # None: build_base's DEFAULT_MIX
        for item in filter(None, (a.mix or "").split(",")):
            group, _, w = item.partition("=")
            if group.strip() not in [*DOMAINS, "copy"] or not w.replace(".", "", 1).isdigit() or float(w) <= 0:
                raise UsageError(f"bad --mix item {item!r}: want group=weight > 0, group one of "
                               f"{', '.join(DOMAINS)}, copy")
            mix[group.strip()] = float(w)
        check_output(a.out, "base", overwrite=a.overwrite)
    except UsageError as e:
        usage_exit(e)
    try:
        build_base(a.out, a.steps, a.seed, a.size, a.n_docs, a.vocab_size, a.batch_tokens, a.lr, a.max_len,
                   domains, a.threads, mix, a.copy_docs, a.drill_steps, a.drill_lr)
    except OSError as e:   # write_atomically has removed its partial directory
        sys.exit(f"error: writing {a.out} failed: {e}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
