"""Serving an MLE directory (mle.py's output: a backbone, one LoRA expert per domain, maybe a learned router): which
expert serves a task, by its environment tag or by the learned router's reading of the prompt, or a blend of the
experts by the router's probabilities. evaluate.py serves MLE through this file; mle.py trains what it serves.

    route = router("runs/tiny/mle", "learned", tok)      # route(env, task) -> the adapter directory to sample with
    route = router("runs/tiny/mle", "request", tok)      # the router that reads the user's request alone (no tag)

Two learned routers (issue 42's routing without tags): "learned" reads the prompt as the policy sees it, whose system
prompt and tools name the domain (so it is an environment tag in disguise); "request" reads the user's request alone,
the first user message rendered as a lone user turn: no system prompt, no tools, no tag, what a real assistant gets.
"""
import os

import torch

from acl.common import load_policy, read_meta
from acl.step import pad_id
from envs.base import UsageError
from envs.rollout import ChatML

FORMAT = "aclarena-mle/1"
ROUTER_FILES = {"learned": "router.pt", "request": "router-request.pt"}   # each learned router's file in an MLE dir


def request_messages(messages: list) -> list:
    """What the request router reads of an episode's opening messages: the first user message alone, as a lone user
    turn (the system prompt, the tools and any tag dropped)."""
    first = next((m for m in messages if m.get("role") == "user"), {"content": ""})
    return [{"role": "user", "content": first.get("content") or ""}]


@torch.no_grad()
def prompt_features(model, tok, items, batch: int = 16, request: bool = False) -> torch.Tensor:
    """(N, h) the frozen backbone's last hidden states mean-pooled over each prompt's tokens: the chat-rendered
    opening messages and tools, exactly what the policy is prompted with (the learned router), or with request the
    user's request alone (request_messages, no tools: the request router)."""
    chat, dev = ChatML(tok), next(model.parameters()).device
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prompts = [chat.prompt(request_messages(env.reset(t).messages), None) if request else
               chat.prompt(env.reset(t).messages, t.tools) for env, t in items]
    out = []
    for s in range(0, len(prompts), batch):
        ps = prompts[s: s + batch]
        T = max(len(p) for p in ps)
        ids = torch.full((len(ps), T), pad_id(base), dtype=torch.long)
        attn = torch.zeros((len(ps), T), dtype=torch.long)
        for i, p in enumerate(ps):                                   # right-padded: positions 0.. are the prompt's
            ids[i, : len(p)], attn[i, : len(p)] = torch.tensor(p), 1
        h = base.model(input_ids=ids.to(dev), attention_mask=attn.to(dev)).last_hidden_state.float()    # (b, T, h)
        m = attn.to(dev)[..., None].float()
        out.append(((h * m).sum(1) / m.sum(1)).cpu())
    return torch.cat(out)


class Router(torch.nn.Module):
    """The learned router: a linear softmax classifier over domains on standardised prompt features."""

    def __init__(self, dim: int, domains: list):
        super().__init__()
        self.domains = list(domains)
        self.linear = torch.nn.Linear(dim, len(domains))
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def forward(self, x):                                            # (N, h) -> (N, domains) logits
        return self.linear((x - self.mean) / self.std)


def is_mle(path: str) -> bool:
    return read_meta(path).get("format") == FORMAT


def backbone_of(path: str) -> str:
    return read_meta(path)["backbone"]


def lora_rank_of(path: str, mix: bool = False) -> int:
    """The LoRA rank vLLM must allow for this MLE directory: its largest expert's, or with --router-mix the sum of
    all (a blend stacks the experts' ranks)."""
    ranks = [read_meta(e).get("recipe", {}).get("lora", {}).get("rank", 0) for e in experts_of(path).values()]
    return sum(ranks) if mix else max(ranks, default=0)


def experts_of(path: str) -> dict:
    """{domain: expert directory} of an MLE directory; UsageError on a missing or unfinished expert."""
    meta = read_meta(path)
    out = {}
    for d in meta.get("domains", []):
        e = os.path.join(path, "experts", d)
        if not os.path.isfile(os.path.join(e, "adapter_config.json")):
            raise UsageError(f"{path}: the {d} expert is missing ({e}); finish it with python mle.py --out {path}")
        out[d] = e
    return out


class Blends:
    """--router-mix: adapters that blend the experts by the router's probabilities, one peft directory per distinct
    blend (weights rounded to 0.05, those below dropped, renormalised), in a temporary directory of this process.
    peft's add_weighted_adapter with combination "cat" stacks the experts' ranks, so the blend's update is exactly
    sum_d w_d B_d A_d (scales included); hf and vLLM serve it like any adapter (its rank: the experts' ranks summed)."""

    def __init__(self, backbone: str, experts: dict):
        import atexit
        import shutil
        import tempfile

        from peft import PeftModel
        self.dir = tempfile.mkdtemp(prefix="aclarena-mle-blends-")
        atexit.register(shutil.rmtree, self.dir, True)
        model, _ = load_policy(backbone, torch.device("cpu"))
        names = list(experts)
        self.model = PeftModel.from_pretrained(model, experts[names[0]], adapter_name=names[0])
        for d in names[1:]:
            self.model.load_adapter(experts[d], adapter_name=d)
        self.experts, self.made = experts, {}

    def __call__(self, probs: dict) -> str:
        w = {d: round(p * 20) / 20 for d, p in probs.items() if round(p * 20) / 20 > 0}
        if len(w) == 1:
            return self.experts[next(iter(w))]
        total = sum(w.values())
        key = ",".join(f"{d}={v / total:.3f}" for d, v in sorted(w.items()))
        if key not in self.made:   # (the new adapter's initialisation draws from torch's RNG: not from the sampler's)
            name = f"blend{len(self.made)}"
            with torch.random.fork_rng(devices=[]):
                self.model.add_weighted_adapter(list(w), [v / total for v in w.values()], name, combination_type="cat")
            self.model.save_pretrained(self.dir, selected_adapters=[name])     # -> <dir>/<name>/
            self.model.delete_adapter(name)
            self.made[key] = os.path.join(self.dir, name)
        return self.made[key]


def router(path: str, kind: str, tok, mix: bool = False):
    """route(env, task) -> the expert directory that serves the task. kind "tag": the task's environment tag (an
    unknown tag is a UsageError); "learned" or "request": that learned router's top-1 domain for the task's prompt
    (features from the backbone, loaded once here), or with mix a blend of the experts by its probabilities
    (Blends). With tok None only checks that everything is there."""
    experts = experts_of(path)
    if kind == "tag":
        def route(env, task):
            if env.domain not in experts:
                raise UsageError(f"{path} has no expert for the tag {env.domain!r} (experts: {', '.join(experts)})")
            return experts[env.domain]
        return route
    saved_path = os.path.join(path, ROUTER_FILES[kind])
    if not os.path.isfile(saved_path):
        raise UsageError(f"{path} has no {kind} router ({saved_path}): python mle.py --router learned --out {path}")
    if tok is None:
        return None
    try:   # tensors and plain values only: a crafted pickle in a runs directory must not run code
        saved = torch.load(saved_path, weights_only=True)
    except Exception as e:
        raise UsageError(f"{saved_path} is not a router this project saved ({type(e).__name__}): refused") from None
    r = Router(saved["dim"], saved["domains"])
    r.load_state_dict(saved["state"])
    model, _ = load_policy(backbone_of(path), torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model.eval()
    blends = Blends(backbone_of(path), experts) if mix else None

    @torch.no_grad()
    def route(env, task):
        p = torch.softmax(r(prompt_features(model, tok, [(env, task)], request=kind == "request"))[0], -1)
        return blends(dict(zip(r.domains, p.tolist()))) if mix else experts[r.domains[int(p.argmax())]]
    return route
