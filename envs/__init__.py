"""ACLArena environments: one file per domain, the rollout loop, the tiny world.

    from envs import make_env
    env = make_env("math")                      # tiny arena (generated from a seed)
    tasks = env.tasks("test", n=300, seed=0)
"""
import importlib

from envs.base import EnvError, EpisodeState, Task  # noqa: F401  (re-exported)

DOMAINS = ("math", "search", "ecommerce", "if")
_CLASSES = {"math": ("envs.math", "MathEnv"), "search": ("envs.search", "SearchEnv"),
            "ecommerce": ("envs.ecommerce", "EcommerceEnv"), "if": ("envs.instruct", "IFEnv")}


def make_env(domain: str, **options):
    """The environment of one domain; `options` are that Env class's constructor arguments."""
    if domain not in _CLASSES:
        raise EnvError(f"unknown domain {domain!r}; expected one of {', '.join(DOMAINS)}")
    module, name = _CLASSES[domain]
    return getattr(importlib.import_module(module), name)(**options)


def parse_domains(text: str) -> list:
    """'math,search' -> ['math', 'search'], with one clear error for a typo or a repeat."""
    domains = [d.strip() for d in text.split(",") if d.strip()]
    for d in domains:
        if d not in DOMAINS:
            raise EnvError(f"unknown domain {d!r} in {text!r}; expected a comma-separated subset of {','.join(DOMAINS)}")
    if len(set(domains)) != len(domains) or not domains:
        raise EnvError(f"domains must be non-empty and distinct: {text!r}")
    return domains
