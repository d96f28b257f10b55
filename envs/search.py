"""Search: question answering with one tool, `search(query)`, over a BM25 index (Search-R1 style).

The policy calls
    <tool_call>{"name": "search", "arguments": {"query": "Tomas Velder"}}</tool_call>
gets the top-k passages back as "[1] Title: text\\n[2] ...", and ends with <answer>Brimsk</answer> in a
turn without tool calls. A turn with neither a tool call nor an answer ends the episode (reward 0).
Reward: exact match after SQuAD-style normalisation against any gold answer. Metrics: em, f1 (token
level, max over golds), searches (number of search calls) and answered.

Tiny arena: a seeded synthetic world of people, cities, countries and organisations, one short passage
per entity, all in one BM25 index. The world is cut into four disjoint sub-worlds (train, val, test,
ood), so test answers must be retrieved, not memorised. train/val/test questions are single-hop
("Where was Tomas Velder born?"); ood questions are two-hop ("In which country was Tomas Velder born?").

Full scale: QA rows in FlashRAG's format (`id`, `question`, `golden_answers`) from `data` (a directory
`<dataset>/<split>.jsonl` or a single file) and either a wiki-18 style corpus JSONL (`id`, `contents`
= '"Title"\\ntext') indexed with bm25s, or the URL of a Search-R1 compatible retrieval server (its
search_r1/search/retrieval_server.py: POSTed {"queries": [q], "topk": k, "return_scores": true}, it answers
result[0][i]["document"]["contents"]).

    env = SearchEnv()                                         # tiny world
    env = SearchEnv(data="data/flashrag", corpus="data/wiki18.jsonl")
    env = SearchEnv(data="data/flashrag", retriever_url="http://127.0.0.1:8000/retrieve")
    tasks = env.benchmark("bamboogle")

Differences from the paper's setup (slime's search-r1 example):
1. BM25 (bm25s) instead of an e5-base-v2 dense FAISS index; a dense retriever can still be used
   through `retriever_url`.
2. The reward is plain exact match in [0, 1], not the shaped EM in [-0.2, 1].
"""
import json
import os
import random
import re
import string
import urllib.request
from collections import Counter

import bm25s

from envs.base import (
    SERVICE_ERRORS,
    SPLITS,
    Env,
    EpisodeState,
    Task,
    UsageError,
    cache_dir,
    function_schema,
    parse_tool_calls,
    read_jsonl,
    tool_call_text,
    tool_message,
)

BENCHMARKS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
SINGLE_HOP = ("nq", "triviaqa", "popqa")
MULTI_HOP = ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
# Full-scale splits as Search-R1 used them: train on nq+hotpotqa; in-domain test = their eval sets;
# out-of-domain = the other five benchmarks. A None split means the benchmark's eval file.
SPLIT_SOURCES = {"train": [("nq", "train"), ("hotpotqa", "train")], "val": [("nq", "dev")],
                 "test": [("nq", None), ("hotpotqa", None)],
                 "ood": [(b, None) for b in ("triviaqa", "popqa", "2wikimultihopqa", "musique", "bamboogle")]}

SEARCH_TOOL = function_schema("search", "Search passages.", {"query": {"type": "string"}}, ["query"])
TINY_SYSTEM = "Search QA: search, then reply <answer>X</answer>."
FULL_SYSTEM = ("Answer the question. Call the search tool to look facts up; each call returns the top "
               "passages. When you know the answer, reply with <answer>a short answer</answer> and no tool call.")
def last_answer(text: str) -> str | None:
    """The text of the last <answer>...</answer> (what a non-greedy regex's last match gives), found in linear time:
    the last </answer>, then the nearest <answer> before it (a regex over a long unterminated text is quadratic)."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>"): end].strip() if start >= 0 else None
MAX_CALLS = 3        # tool calls executed per turn; the rest get an error (keeps one turn's cost bounded)
MAX_QUERY = 300      # characters of a query passed to the retriever


# ---------------------------------------------------------------- metrics (SQuAD / FlashRAG style)

def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD)."""
    s = "".join(ch for ch in str(s).lower() if ch not in string.punctuation)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _golds(golds) -> list:
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(prediction: str, golds) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer (a string or a list)."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def f1_score(prediction: str, golds) -> float:
    """Token-level F1 of the normalised prediction, the max over gold answers."""
    best = 0.0
    p = normalize_answer(prediction)
    for g in _golds(golds):
        g = normalize_answer(g)
        # FlashRAG: a yes/no/noanswer prediction or gold only counts when it matches exactly.
        if (p in ("yes", "no", "noanswer") or g in ("yes", "no", "noanswer")) and p != g:
            continue
        common = sum((Counter(p.split()) & Counter(g.split())).values())
        if common:
            precision, recall = common / len(p.split()), common / len(g.split())
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ---------------------------------------------------------------- retrieval

def format_passages(contents: list) -> str:
    """'"Title"\\ntext' contents (wiki-18 style) -> "[1] Title: text\\n[2] ..."."""
    lines = []
    for i, c in enumerate(contents, 1):
        title, _, text = str(c).partition("\n")
        lines.append(f"[{i}] {title.strip().strip(chr(34))}: {text.strip()}" if text else f"[{i}] {title.strip()}")
    return "\n".join(lines) if lines else "no results"


class BM25Index:
    """A bm25s index over wiki-18 style `contents` strings (in memory), or one loaded from disk (for_corpus)."""

    def __init__(self, contents: list | None = None, bm25=None):
        if bm25 is not None:   # loaded, its passages memory-mapped: bm25.corpus[i] = {"id", "text"}
            self.bm25, self.contents = bm25, None
            return
        self.contents = list(contents)
        self.bm25 = bm25s.BM25()
        self.bm25.index(bm25s.tokenize(self.contents, stopwords="en", show_progress=False), show_progress=False)

    def __len__(self):
        return len(self.contents) if self.contents is not None else len(self.bm25.corpus)

    def search(self, query: str, k: int) -> list:
        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        docs, scores = self.bm25.retrieve(tokens, k=min(k, len(self)), show_progress=False)
        texts = [self.contents[d] for d in docs[0]] if self.contents is not None else [d["text"] for d in docs[0]]
        # Documents that share no term with the query score 0: "no results" beats random passages.
        return [t for t, s in zip(texts, scores[0]) if s > 0]

    @classmethod
    def for_corpus(cls, path: str, wait_s: float = 6 * 3600.0):
        """The index of a corpus file, built once per node and kept in $ACLARENA_CACHE/bm25/<corpus fingerprint>/
        (path, size, mtime, bm25s version): the process with LOCAL_RANK 0 (or the only one) builds and saves it,
        the node's other ranks wait for it, and every process loads it memory-mapped (the index arrays and the
        passages), so a node pays one build and holds one copy in its page cache instead of one per rank. Wiki-18
        (21M passages, 13 GB): the build reads every passage into memory once (measured on a 200k-passage corpus:
        see docs/LOG.md). A later run with the same file loads the saved index at once."""
        import hashlib
        import time
        if not os.path.isfile(path):
            raise UsageError(f"corpus file not found: {path}")
        st = os.stat(path)
        key = hashlib.sha256(f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{bm25s.__version__}".encode())
        out = cache_dir("bm25", key.hexdigest()[:16])
        done = os.path.join(out, "params.index.json")
        if not os.path.isfile(done) and os.environ.get("LOCAL_RANK", "0") == "0":
            t0 = time.time()
            index = cls(read_corpus(path))
            import shutil
            tmp = f"{out}.tmp-{os.getpid()}"
            try:
                index.bm25.save(tmp, corpus=index.contents, show_progress=False)
                os.makedirs(os.path.dirname(out), exist_ok=True)
            except BaseException:   # a kill or a failed save leaves no half-written index behind
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            try:
                os.rename(tmp, out)
            except OSError:   # another builder finished first (a second run on the node): keep its index
                shutil.rmtree(tmp, ignore_errors=True)
            print(f"search: BM25 index of {path} ({len(index)} passages) built in {time.time() - t0:.0f}s, saved to "
                  f"{out}", flush=True)
        t0 = time.time()
        while not os.path.isfile(done):   # another rank of this node builds it
            if time.time() - t0 > wait_s:
                raise RuntimeError(f"no BM25 index at {out} after {wait_s:.0f}s: did local rank 0 fail to build it?")
            time.sleep(2.0)
        return cls(bm25=bm25s.BM25.load(out, mmap=True, load_corpus=True, show_progress=False))


def read_corpus(path: str) -> list:
    """The `contents` of every row of a wiki-18 style JSONL, streamed (wiki-18 is ~21M lines)."""
    if not os.path.isfile(path):
        raise UsageError(f"corpus file not found: {path}")
    contents = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UsageError(f"malformed JSON on line {i} of corpus {path}: {e}") from None
            if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
                raise UsageError(f"line {i} of corpus {path} has no string 'contents' (wiki-18 format: id, contents)")
            contents.append(row["contents"])
    if not contents:
        raise UsageError(f"corpus {path} is empty")
    return contents


def http_search(url: str, query: str, k: int, timeout: float) -> list:
    """POST one query to a Search-R1 retrieval server; returns the passages' contents."""
    body = json.dumps({"queries": [query], "topk": k, "return_scores": True}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        result = json.loads(response.read().decode("utf-8"))["result"][0]
    # With return_scores each hit is {"document": {...}, "score": s}; without, the document itself.
    docs = [hit.get("document", hit) for hit in result]
    return [d["contents"] for d in docs][:k]


# ---------------------------------------------------------------- real QA data (FlashRAG format)

def load_qa(path: str, dataset: str) -> list:
    """FlashRAG rows {id, question, golden_answers} -> [{id, question, answers, dataset}]."""
    rows = []
    for i, row in enumerate(read_jsonl(path), 1):
        golds = row.get("golden_answers") if isinstance(row, dict) else None
        golds = [golds] if isinstance(golds, str) else golds
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(golds, list) \
                or not golds:
            raise UsageError(f"row {i} of {path} needs a string 'question' and a non-empty 'golden_answers' list")
        rows.append({"id": str(row.get("id", i)), "question": row["question"], "answers": [str(g) for g in golds],
                     "dataset": dataset})
    return rows


def qa_file(root: str, name: str, split: str | None = None) -> str | None:
    """<root>/<name>/<split>.jsonl (FlashRAG layout); split None = the eval file, test.jsonl else dev.jsonl
    (nq/triviaqa/popqa/bamboogle have a test set, the others only dev). None when absent."""
    for s in [split] if split else ["test", "dev"]:
        path = os.path.join(root, name, f"{s}.jsonl")
        if os.path.isfile(path):
            return path
    return None


# ---------------------------------------------------------------- the tiny world

ONSETS = ["b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "z"]
VOWELS = ["a", "e", "i", "o", "u"]
CODAS = ["", "", "n", "r", "l", "s", "k", "m", "nd", "rk"]
# Sub-world sizes: (people, cities, organisations, countries). Eval pools give >= 300 distinct questions.
POOLS = {"train": (3000, 150, 150, 30), "val": (150, 40, 40, 10), "test": (150, 40, 40, 10), "ood": (150, 40, 40, 10)}
ORG_KINDS = ["Labs", "Corp", "Group", "Works"]
SINGLE_HOP_QS = [  # (question, subject kind, attribute)
    ("Where was {} born?", "person", "born"), ("Who does {} work for?", "person", "employer"),
    ("Which country is {} in?", "city", "country"), ("When was {} founded?", "org", "founded"),
    ("Where is {} based?", "org", "hq"), ("What is the capital of {}?", "country", "capital")]
# ood's single-hop questions, worded as the stage never asks them (as PopQA and TriviaQA word theirs for a model
# trained on NQ); the base has read these wordings in its pre-training text (SearchEnv.knowledge)
PARAPHRASE_QS = [
    ("What is the birthplace of {}?", "person", "born"), ("Which organisation employs {}?", "person", "employer"),
    ("{} lies in which country?", "city", "country"), ("In what year was {} established?", "org", "founded"),
    ("Where are the headquarters of {}?", "org", "hq"), ("Name the capital city of {}.", "country", "capital")]
TWO_HOP_QS = [  # (question, subject kind, first attribute, second attribute)
    ("In which country was {} born?", "person", "born", "country"),
    ("Where is {}'s employer based?", "person", "employer", "hq"),
    ("When was {}'s employer founded?", "person", "employer", "founded"),
    ("In which country is {} based?", "org", "hq", "country")]


def name_parts() -> dict:
    """kind -> (stems, endings): the parts every world's names are made of, the same in every world."""
    rng = random.Random("search-name-parts")
    seen = set()

    def word() -> str:
        while True:
            w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(2)).capitalize()
            if w not in seen and len(w) >= 4:
                seen.add(w)
                return w

    return {"person": ([word() for _ in range(60)], [" " + word() for _ in range(150)]),
            "city": ([word() for _ in range(200)], ["sk", "holm", "ton", "ra"]),
            "org": ([word() for _ in range(200)], [" " + k for k in ORG_KINDS]),
            "country": ([word() for _ in range(100)], ["ia", "land", "or"])}


# Every name is a stem and an ending from these small shared pools ("Tomas" + " Velder", "Brak" + "holm"):
# a world's names are new combinations of frequent parts, which the tokenizer learns as few tokens. A ~1M
# base then copies part of the unseen test names into its query; names of rare syllables it did not copy
# at all (queries with made-up names). Copying the answer out of a passage it still barely learns (README).
# Room: 9,000 people, 800 cities, 800 organisations, 300 countries; a world takes 3,450/270/270/60.
NAME_PARTS = name_parts()


def build_world(seed, avoid=frozenset()) -> dict:
    """name -> entity dict {"name", "kind", "pool", attributes...}; every name unique in the world and
    none in `avoid`. `seed` (an int, or a string such as the knowledge documents' worlds) fixes the names and the facts."""
    rng = random.Random(f"search-world:{seed}")
    used = set(avoid)

    def names(kind: str, n: int) -> list:
        stems, endings = NAME_PARTS[kind]
        out = []
        while len(out) < n:
            name = rng.choice(stems) + rng.choice(endings)
            if name not in used:
                used.add(name)
                out.append(name)
        return out

    pools = {pool: (names("country", c), names("city", ci), names("org", o), names("person", p))
             for pool, (p, ci, o, c) in POOLS.items()}
    world = {}
    for pool, (countries, cities, orgs, persons) in pools.items():
        cities = rng.sample(cities, len(cities))  # which city is in which country, and which is the capital
        for i, city in enumerate(cities):  # every country gets cities; its first one is the capital
            world[city] = {"name": city, "kind": "city", "pool": pool, "country": countries[i % len(countries)]}
        for i, country in enumerate(countries):
            world[country] = {"name": country, "kind": "country", "pool": pool, "capital": cities[i]}
        for org in orgs:
            world[org] = {"name": org, "kind": "org", "pool": pool, "founded": str(rng.randint(1850, 2019)),
                          "hq": rng.choice(cities)}
        for person in persons:
            world[person] = {"name": person, "kind": "person", "pool": pool, "born": rng.choice(cities),
                             "employer": rng.choice(orgs)}
    return world


def passage(e: dict) -> str:
    """One entity's wiki-18 style contents: '"Name"\\nshort text'. A country names itself again so that
    its own passage, not its capital's, ranks first for its name."""
    text = {"person": lambda: f"born in {e['born']}, works for {e['employer']}.",
            "city": lambda: f"a city in {e['country']}.",
            "org": lambda: f"founded in {e['founded']}, based in {e['hq']}.",
            "country": lambda: f"a country; {e['name']}'s capital is {e['capital']}."}[e["kind"]]()
    return f'"{e["name"]}"\n{text}'


FACT_FORMS = {   # attribute -> wordings of one fact in the base's pre-training text (SearchEnv.knowledge)
    "born": ("{n} was born in {v}.", "{n} is a native of {v}.", "The birthplace of {n} is {v}."),
    "employer": ("{n} works for {v}.", "{n} is employed by {v}.", "{v} employs {n}."),
    "country": ("{n} is a city in {v}.", "{n} lies in {v}.", "The city of {n} is in {v}."),
    "founded": ("{n} was founded in {v}.", "{n} was established in {v}.", "{n} dates from {v}."),
    "hq": ("{n} is based in {v}.", "The headquarters of {n} are in {v}.", "{n} has its seat in {v}."),
    "capital": ("The capital of {n} is {v}.", "{v} is the capital city of {n}.", "{n}'s capital is {v}."),
}


def fact_sentence(e: dict, rng) -> str:
    """An entity's facts in prose, each in a wording drawn from FACT_FORMS (e["only"]: that fact alone)."""
    attrs = [e["only"]] if "only" in e else [a for a in FACT_FORMS if a in e]
    return " ".join(rng.choice(FACT_FORMS[a]).format(n=e["name"], v=e[a]) for a in attrs)


def world_questions(world: dict, pool: str) -> list:
    """Every question about a sub-world: single-hop for train/val/test; for ood, two-hop questions and single-hop
    ones in other words (PARAPHRASE_QS), about half each (as Search-R1's out-of-domain sets mix multi-hop and other
    single-hop datasets). Each is (question, answer, entity names on the path, attribute names on the path)."""
    out = []
    for e in world.values():
        if e["pool"] != pool:
            continue
        single = PARAPHRASE_QS if pool == "ood" else SINGLE_HOP_QS
        out += [(q.format(e["name"]), e[a], [e["name"]], [a]) for q, kind, a in single if kind == e["kind"]]
        if pool == "ood":
            out += [(q.format(e["name"]), world[e[a1]][a2], [e["name"], e[a1]], [a1, a2])
                    for q, kind, a1, a2 in TWO_HOP_QS if kind == e["kind"]]
    return out


# ---------------------------------------------------------------- the environment

class SearchEnv(Env):
    """Multi-turn QA with a `search` tool. Tiny world by default; real data when `data` is given."""
    domain = "search"

    def __init__(self, topk: int | None = None, max_turns: int | None = None, corpus: str | None = None,
                 retriever_url: str | None = None, data: str | None = None, seed: int = 0,
                 timeout: float = 30.0, workers: int = 1):
        if topk is not None and topk < 1:
            raise UsageError(f"topk must be >= 1, got {topk}")
        if corpus and retriever_url:
            raise UsageError("give either corpus or retriever_url, not both")
        self.seed, self.timeout = seed, timeout
        self.data, self.retriever_url = data, retriever_url
        self.workers = max(1, workers) if retriever_url else 1   # concurrent steps only where they wait on the server
        self.full = bool(data or corpus or retriever_url)
        # Top-3 at full scale (Search-R1); top-1 in the tiny world, where a name's own passage always ranks
        # first and the two others are look-alikes (shared name parts): 1.5% vs 0% EM in a search-only base.
        self.topk = topk or (3 if self.full else 1)
        self.max_turns = max_turns or (5 if self.full else 4)
        if self.full and not (corpus or retriever_url):
            raise UsageError("real search data needs a retriever: pass corpus=<wiki-18 JSONL> or retriever_url=<URL>")
        if data and not os.path.exists(data):
            raise UsageError(f"search data not found: {data}")
        self.world = None if self.full else build_world(seed)
        if corpus:
            self.index = BM25Index.for_corpus(corpus)
        elif self.world:
            self.index = BM25Index([passage(e) for e in self.world.values()])
        else:
            self.index = None  # the HTTP retriever

    def check_services(self):
        """One probe query to --retriever-url (a retrieval server that cannot answer would turn every search into an
        error observation)."""
        if not self.retriever_url:
            return
        try:
            hits = http_search(self.retriever_url, "probe", 1, self.timeout)
            if not isinstance(hits, list):
                raise TypeError("no list of passages")
        except SERVICE_ERRORS as e:
            raise UsageError(f"the retriever at {self.retriever_url} does not answer a probe query ({type(e).__name__}:"
                             f" {str(e)[:200]}): start it, or fix --retriever-url") from None

    # -- tasks

    def _task(self, split: str, key: str, question: str, answers: list, **gold) -> Task:
        system = FULL_SYSTEM if self.full else TINY_SYSTEM
        return Task(id=f"search-{split}-{key}", env="search", split=split,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                    tools=[SEARCH_TOOL], gold={"answers": answers, "question": question, **gold})

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list:
        if split not in SPLITS:
            raise UsageError(f"unknown split {split!r} for search; expected one of {', '.join(SPLITS)}")
        if self.full:
            rows = self._real_split(split)
            if n is not None and n < len(rows):
                rows = random.Random(f"{split}:{seed}").sample(rows, n)
            return [self._task(split, f"{r['dataset']}-{r['id']}", r["question"], r["answers"], dataset=r["dataset"],
                               multi_hop=r["dataset"] in MULTI_HOP)
                    for r in rows]
        n = (5000 if split == "train" else 300) if n is None else n
        questions = world_questions(self.world, split)
        rng = random.Random(f"search-tasks:{split}:{seed}")
        # Distinct questions while there are enough; the train split repeats (5000 > ~2000 questions).
        picked = rng.sample(questions, n) if n <= len(questions) else [rng.choice(questions) for _ in range(n)]
        return [self._task(split, f"{seed}-{i}", q, [a], path=path, attrs=attrs)
                for i, (q, a, path, attrs) in enumerate(picked)]

    def benchmark(self, name: str, source: str | None = None, n: int | None = None) -> list:
        """A real benchmark's eval set (test.jsonl, else dev.jsonl), from `source` or the `data` directory."""
        if name not in BENCHMARKS:
            raise UsageError(f"unknown search benchmark {name!r}; expected one of {', '.join(BENCHMARKS)}")
        if not self.full:
            raise UsageError("search benchmarks need real data: construct SearchEnv(data=..., corpus=... or retriever_url=...)")
        source = source or self.data
        if not source or not os.path.exists(source):
            raise UsageError(f"search data not found for benchmark {name!r}: {source}")
        path = source if os.path.isfile(source) else qa_file(source, name)
        if path is None:
            raise UsageError(f"no {name}/test.jsonl or {name}/dev.jsonl under {source}")
        rows = load_qa(path, name)[:n]
        return [self._task(name, f"{name}-{r['id']}", r["question"], r["answers"], dataset=name,
                           multi_hop=name in MULTI_HOP) for r in rows]

    def _real_split(self, split: str) -> list:
        if not self.data:
            raise UsageError("search tasks at full scale need data=<FlashRAG directory or JSONL file>")
        if os.path.isfile(self.data):  # a single file is one dataset, used for whichever split is asked
            return load_qa(self.data, os.path.splitext(os.path.basename(self.data))[0])
        rows = []
        for name, file_split in SPLIT_SOURCES[split]:
            path = qa_file(self.data, name, file_split)
            rows += load_qa(path, name) if path else []
        if not rows:
            wanted = ", ".join(f"{name}/{s or 'test|dev'}.jsonl" for name, s in SPLIT_SOURCES[split])
            raise UsageError(f"no data for search split {split!r} under {self.data}: expected one of {wanted}")
        return rows

    # -- episodes

    def reset(self, task: Task) -> EpisodeState:
        state = super().reset(task)
        state.info.update(searches=0, answer=None)
        return state

    def search(self, query: str) -> str:
        """The tool: top-k passages as text, or an error string (never raises on a bad query)."""
        query = query.strip()[:MAX_QUERY]
        if not query:
            return "error: empty query"
        if self.index is not None:
            return format_passages(self.index.search(query, self.topk))
        try:
            return format_passages(http_search(self.retriever_url, query, self.topk, self.timeout))
        except Exception as e:  # a remote retriever's failure is an observation, never a crash
            return f"error: retriever failed: {type(e).__name__}: {str(e)[:120]}"

    def step(self, state: EpisodeState, text: str) -> list:
        if state.done:
            return []
        text = text if isinstance(text, str) else ""
        state.messages.append({"role": "assistant", "content": text})
        state.turns += 1
        calls, errors = parse_tool_calls(text)
        obs = [tool_message("search", f"error: {e}") for e in errors]
        for name, args in calls[:MAX_CALLS]:
            if name != "search":   # the model's name, cut: a 100k-character name must not become the observation
                obs.append(tool_message(name[:40], f"error: unknown tool {name[:40]!r}; the only tool is search"))
            elif not isinstance(args.get("query"), str):
                obs.append(tool_message(name, "error: search needs a string argument 'query'"))
            else:
                state.info["searches"] += 1
                obs.append(tool_message(name, self.search(args["query"])))
        if len(calls) > MAX_CALLS:
            obs.append(tool_message("search", f"error: at most {MAX_CALLS} tool calls per turn"))
        if not obs:  # no tool call: this is the final turn, with or without an answer
            state.info["answer"] = last_answer(text)
            state.done = True
        if state.turns >= self.max_turns:
            state.done = True
        state.messages += obs
        return obs

    def score(self, state: EpisodeState) -> tuple:
        answer, golds = state.info.get("answer"), state.task.gold["answers"]
        em = exact_match(answer, golds) if answer is not None else 0.0
        f1 = f1_score(answer, golds) if answer is not None else 0.0
        return em, {"em": em, "f1": f1, "searches": float(state.info.get("searches", 0)),
                    "answered": float(answer is not None)}

    def compliant(self, state: EpisodeState) -> bool:
        """Searches, then a final turn with <answer>...</answer>, no tool call and nothing after the answer (not an
        episode that ran out of turns while still searching)."""
        turns = [m.get("content") or "" for m in state.messages if m.get("role") == "assistant"]
        if state.truncated or not turns:
            return False
        last = turns[-1]
        after = last[last.rfind("</answer>") + len("</answer>"):]
        return "<tool_call>" not in last and last_answer(last) is not None and not after.strip() \
            and all("<tool_call>" in t for t in turns[:-1])

    def expert(self, task: Task) -> list | None:
        """Tiny world: search every name on the question's path (the second hop's name is in the first
        result), then answer."""
        if self.full or not task.gold.get("path"):
            return None
        return [tool_call_text("search", {"query": name}) for name in task.gold["path"]] + \
            [f"<answer>{task.gold['answers'][0]}</answer>"]

    # -- demonstrations for the tiny base

    def knowledge(self, n: int, seed: int = 0, per_world: int = 100) -> list:
        """Encyclopaedia text and reading comprehension, never a tool call or an <answer> tag (the stage teaches them):
        - articles (2 documents in 5): 4-10 entities of a world in prose, each fact in one of FACT_FORMS' wordings;
        - reading (2 in 5): 2-4 questions, each followed by the passages a search for its subject returns (the BM25
          top-k, as the tool shows them) and the answer; single-hop questions in the stage's and in other words
          (SINGLE_HOP_QS, PARAPHRASE_QS);
        - two-hop reading (1 in 5): a TWO_HOP_QS question, the passages of its first name, the bridge ("X works for
          Y."), the passages of the second, the answer.
        Every `per_world` documents come from a fresh world with new names and facts, none a name of this env's val,
        test or ood sub-worlds: the base learns to read, not the facts. (Measured on the earlier corpus of noisy
        demonstrations: with one fixed world a ~1M base memorised the train facts, 47% on train and 0% on test; with
        the train names fixed and only the facts redrawn, it wrote a memorised train name into the query.)"""
        if self.full:
            raise UsageError("search knowledge exists only for the tiny world")
        rng = random.Random(f"search-knowledge:{seed}")
        held_out = frozenset(e["name"] for e in self.world.values() if e["pool"] != "train")
        out = []
        for w in range(0, n, per_world):
            world = build_world(f"{self.seed}:knowledge:{seed}:{w}", held_out)
            index = BM25Index([passage(e) for e in world.values()])
            train = [e for e in world.values() if e["pool"] == "train"]
            for _ in range(min(per_world, n - w)):
                kind = rng.random()
                if kind < 0.4:
                    out.append(" ".join(fact_sentence(e, rng) for e in rng.sample(train, rng.randint(4, 10))))
                    continue
                parts = []
                for _ in range(1 if kind >= 0.8 else rng.randint(2, 4)):
                    e = rng.choice(train)
                    if kind >= 0.8:
                        hops = [(q, a1, a2) for q, k, a1, a2 in TWO_HOP_QS if k == e["kind"]]
                        if hops:
                            q, a1, a2 = rng.choice(hops)
                            mid = world[e[a1]]
                            parts.append(f"Question: {q.format(e['name'])}\n"
                                         f"{format_passages(index.search(e['name'], self.topk))}\n"
                                         f"{fact_sentence(dict(e, kind=e['kind'], only=a1), rng)}\n"
                                         f"{format_passages(index.search(mid['name'], self.topk))}\n"
                                         f"Answer: {mid[a2]}")
                            continue
                    q, a = rng.choice([(q, a) for q, k, a in SINGLE_HOP_QS + PARAPHRASE_QS if k == e["kind"]])
                    parts.append(f"Question: {q.format(e['name'])}\n{format_passages(index.search(e['name'], self.topk))}"
                                 f"\nAnswer: {e[a]}")
                out.append("\n\n".join(parts))
        return out

