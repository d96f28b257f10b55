"""ACLArena environments: one file per domain, the rollout loop, the tiny world.

    from envs import make_env
    env = make_env("math")                      # tiny arena (generated from a seed)
    tasks = env.tasks("test", n=300, seed=0)
"""
import importlib

from envs.base import EpisodeState, Task, UsageError  # noqa: F401  (re-exported)

DOMAINS = ("math", "search", "ecommerce", "if")
_CLASSES = {"math": ("envs.math", "MathEnv"), "search": ("envs.search", "SearchEnv"),
            "ecommerce": ("envs.ecommerce", "EcommerceEnv"), "if": ("envs.instruct", "IFEnv")}


def make_env(domain: str, **options):
    """The environment of one domain; `options` are that Env class's constructor arguments."""
    if domain not in _CLASSES:
        raise UsageError(f"unknown domain {domain!r}; expected one of {', '.join(DOMAINS)}")
    module, name = _CLASSES[domain]
    return getattr(importlib.import_module(module), name)(**options)


def load_envs(domains, env_opts: dict, seed: int = 0) -> dict:
    """{domain: its environment}, each with its train prompts loaded once, for a script to check every domain's
    data and services before any work: UsageError naming the domain on a bad flag, a missing file, a loader's own
    error or an outside service that does not answer (Env.check_services)."""
    envs = {}
    for d in domains:
        try:
            env = make_env(d, **env_opts.get(d, {}))
            env.check_services()
            n = len(env.tasks("train", seed=seed))
        except UsageError as e:
            raise UsageError(f"{d}: {e}") from None
        except Exception as e:   # a loader's own error (a hub id offline, a malformed file): one line, not a traceback
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise UsageError(f"{d}: cannot load its train prompts ({type(e).__name__}: {first})") from None
        if n == 0:
            raise UsageError(f"{d}: its train split is empty")
        envs[d] = env
    return envs


def parse_domains(text: str) -> list:
    """'math,search' -> ['math', 'search'], with one clear error for a typo or a repeat."""
    domains = [d.strip() for d in text.split(",") if d.strip()]
    for d in domains:
        if d not in DOMAINS:
            raise UsageError(f"unknown domain {d!r} in {text!r}; expected a comma-separated subset of {','.join(DOMAINS)}")
    if len(set(domains)) != len(domains) or not domains:
        raise UsageError(f"domains must be non-empty and distinct: {text!r}")
    return domains



def per_domain(flag: str, text, domains, cast=int) -> dict:
    """'40' -> every domain 40; 'math=40,search=30' -> per domain (a curriculum domain not named, a domain named
    twice or unknown, a value that is not a number: one-line error). cast: int (counts), float (rates; finite) or str
    (names: --loss)."""
    import math
    what = "N" if cast is int else "NAME" if cast is str else "X"
    parts = [part.partition("=") for part in str(text).split(",")] if "=" in str(text) else []
    try:
        out = {k.strip(): cast(v) for k, _, v in parts} if parts else {d: cast(text) for d in domains}
    except ValueError:
        raise UsageError(f"{flag} takes {what} or domain={what},...; got {text!r}") from None
    if parts and len(out) != len(parts):
        raise UsageError(f"{flag} names a domain twice: {text!r}")
    unknown = [d for d in out if d not in DOMAINS]
    if unknown:
        raise UsageError(f"{flag}: unknown domain {unknown[0]!r}; expected some of {','.join(DOMAINS)}")
    missing = [d for d in domains if d not in out]
    if missing:
        raise UsageError(f"{flag} names no {'count' if cast is int else 'value'} for {', '.join(missing)}")
    if cast is not str and any(not math.isfinite(v) for v in out.values()):
        raise UsageError(f"{flag} values must be finite; got {text!r}")
    return out


def add_data_flags(p, train: bool = False):
    """The flags that point the environments at real data, shared by train_seq.py (train=True: also the math and
    if train prompts) and evaluate.py (which names benchmark data with --source). See env_options."""
    if train:
        p.add_argument("--math-data", default=None, help="math train prompts: HF dataset id or local file "
                                                         "(default: the tiny world)")
        p.add_argument("--if-data", default=None, help="if: train prompts (IFEval-format JSONL)")
    p.add_argument("--search-data", default=None, help="search: FlashRAG directory <dataset>/<split>.jsonl")
    p.add_argument("--search-corpus", default=None, help="search: wiki-18 style corpus JSONL for BM25")
    p.add_argument("--retriever-url", default=None, help="search: a Search-R1 retrieval server instead of BM25")
    p.add_argument("--tau-data", default=None, help="ecommerce: tau-bench v1 or tau2/tau3 retail data directory")
    p.add_argument("--user-url", default=None, help="ecommerce: OpenAI-compatible endpoint of the simulated user")
    p.add_argument("--user-model", default=None, help="ecommerce: the simulated user's model name (required with "
                                                       "--user-url)")
    p.add_argument("--max-user-errors", type=float, default=0.25, help="ecommerce: stop a run when more than this "
                   "fraction of one batch's episodes end in a user-model error (their reward would be 0)")
    p.add_argument("--env-workers", type=int, default=16, help="search with --retriever-url, ecommerce with --user-url: "
                   "episodes whose tool or user calls run at once (threads) within a turn")
    p.add_argument("--user-key-env", default=None, help="ecommerce: the environment variable holding the user "
                   "endpoint's API key (e.g. OPENAI_API_KEY); no key is sent unless one is named")


# What each domain needs to run on real data (full scale): the flags, and what they give it. Without them a domain
# would fall back to its tiny world, which at full scale is a silent failure.
REAL_DATA = {"math": [("math_data", "--math-data")],
             "search": [("search_data", "--search-data"), (("search_corpus", "retriever_url"),
                                                            "--search-corpus or --retriever-url")],
             "ecommerce": [("tau_data", "--tau-data"), ("user_url", "--user-url"), ("user_model", "--user-model")],
             "if": [("if_data", "--if-data")]}


def require_real_data(a, domains):
    """UsageError (one line, every missing flag named) unless each of `domains` has its real data: the full-scale
    presets refuse to train on the tiny worlds."""
    missing = []
    for d in domains:
        for attrs, flag in REAL_DATA[d]:
            attrs = attrs if isinstance(attrs, tuple) else (attrs,)
            if not any(getattr(a, x, None) for x in attrs):
                missing.append(f"{flag} ({d})")
    if missing:
        raise UsageError(f"--preset {a.preset} trains on real data only; missing: {', '.join(missing)} (the tiny "
                         f"worlds are --preset tiny)")


def env_options(a) -> dict:
    """{domain: its Env's constructor arguments} from add_data_flags' flags; flags left unset are left out.
    UsageError for --user-url without --user-model: a server answers an unknown model name with an error, and every
    e-commerce episode would then end in a user error (reward 0)."""
    if not 0 <= getattr(a, "max_user_errors", 0.0) <= 1:
        raise UsageError("--max-user-errors is a fraction in [0, 1]")
    if a.user_url and not a.user_model:
        raise UsageError("--user-url needs --user-model, the model name that endpoint serves (e.g. Qwen/Qwen3-32B)")
    if getattr(a, "env_workers", 1) < 1:
        raise UsageError("--env-workers must be >= 1")
    workers = getattr(a, "env_workers", None)
    opts = dict(math=dict(data=getattr(a, "math_data", None)),
                search=dict(data=a.search_data, corpus=a.search_corpus, retriever_url=a.retriever_url,
                            workers=workers if a.retriever_url else None),
                ecommerce=dict(data=a.tau_data, user_url=a.user_url, user_model=a.user_model,
                               user_api_key_env=a.user_key_env, workers=workers if a.user_url else None),
                **{"if": dict(data=getattr(a, "if_data", None))})
    return {d: {k: v for k, v in o.items() if v is not None} for d, o in opts.items()}
