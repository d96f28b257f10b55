"""The shared vocabulary of every environment: Task, EpisodeState, Env, and the tool-call parser.

One protocol for every agentic domain (Qwen-native): tools are JSON schemas in OpenAI's function
format, passed to the chat template with `tools=`; the policy writes
    <tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>
and each result comes back as a {"role": "tool", "name": ..., "content": str} message.

An environment never raises on what the model writes: malformed JSON, unknown tools, wrong argument
types, empty or endless text all become observations (an error string in a tool message) or a zero
reward. Nothing the model writes ever reaches eval/exec. Bad *user* input (an unknown domain, a
missing data directory, a malformed task file) raises UsageError with one clear line.
"""
import http.client
import json
import os
import re
import socket
from dataclasses import dataclass, field


class UsageError(ValueError):
    """The project's one input-error type: bad input from the user (a flag, a path, a data file), never from the
    model. Every script's main prints it as one line ("error: ...") and exits with status 2 (usage_exit)."""


class ToolError(Exception):
    """A tool refused the call; the text goes back to the policy as 'Error: ...' (envs/ecommerce.py's run_tool)."""


def json_copy(x):
    """A deep copy of JSON-like data (dicts, lists, strings, numbers): much faster than copy.deepcopy on a store."""
    return json.loads(json.dumps(x))


def deep_update(dst: dict, src: dict) -> dict:
    """Merge `src` into `dst` in place, dicts key by key (tau2's initialization data, a database's defaults);
    every other value replaced by a copy. Returns dst."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            deep_update(dst[k], v)
        else:
            dst[k] = json_copy(v)
    return dst


SPLITS = ("train", "val", "test", "ood")  # val: for weight/hyper-parameter search, never test
# What a call to an outside service (an LLM user, a retrieval server) raises when the service is down or answers
# malformed JSON: urllib's and http.client's errors, and a reply without the expected fields.
SERVICE_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, http.client.HTTPException)


@dataclass
class Task:
    id: str                      # unique within (env, split), stable across runs for the same seed
    env: str                     # domain tag: math | search | ecommerce | if
    split: str                   # train | val | test | ood, or a benchmark name at full scale
    messages: list               # opening chat messages (system and/or user), dicts with role/content
    tools: list | None = None    # JSON schemas (OpenAI function format) or None
    gold: dict = field(default_factory=dict)  # hidden: answer, constraints, expected db, ...


@dataclass
class EpisodeState:
    task: Task
    messages: list               # the transcript so far; starts as a copy of task.messages
    done: bool = False
    truncated: bool = False      # set by the rollout loop when a turn/token limit cut the episode
    turns: int = 0               # assistant turns taken
    info: dict = field(default_factory=dict)  # env-private state: db, search count, user state, ...


class Env:
    """One domain. Subclasses set `domain` and `max_turns` and implement tasks, step and score (reset, benchmark
    and knowledge where they apply)."""
    domain = ""
    max_turns = 1

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list:
        """Tasks of a split: generated from `seed` in the tiny arena, loaded from real data otherwise."""
        raise NotImplementedError

    def reset(self, task: Task) -> EpisodeState:
        return EpisodeState(task=task, messages=[dict(m) for m in task.messages])

    def step(self, state: EpisodeState, text: str) -> list:
        """Append the policy's assistant turn `text`; return the new observation messages (tool
        results or the user's reply, possibly empty) and set state.done when the episode ends."""
        raise NotImplementedError

    def score(self, state: EpisodeState) -> tuple:
        """(reward, metrics) of a finished (or truncated) episode; metrics is {name: float}."""
        raise NotImplementedError

    def benchmark(self, name: str, source: str | None = None, n: int | None = None) -> list:
        """Full scale: the tasks of one named benchmark of this domain (evaluate.py's full suite), from `source`
        (an HF dataset id or a local file; None: the benchmark's default), the first n (None: all)."""
        raise UsageError(f"the {self.domain or type(self).__name__} environment has no benchmark {name!r}")

    def check_services(self):
        """UsageError (one line) unless the outside services this environment was given answer (an LLM user, a
        retrieval server): called once before any work, so that a run never trains on the zero rewards of a dead
        service. No service (the tiny worlds, a local corpus): nothing to check."""

    def compliant(self, state: EpisodeState) -> bool:
        """Did a finished episode keep this environment's protocol (SDFT's third filter)? Here: it ended by itself,
        not cut at the turn or token limit; each domain adds its own rules (a final answer in its format and nothing
        after it, a confirmation before every write, no tool call where there are no tools). Read from the
        transcript alone (state.messages, state.task, state.truncated), so a saved episode can be checked too."""
        return not state.truncated

    def expert(self, task: Task) -> list | None:
        """Tiny arena: the assistant texts of a clean by-the-book episode of `task`, turn by turn (the worlds'
        scripted expert, the tiny counterpart of a stronger model's rollouts), or None where there is no script
        (real data). The env's answers to them are deterministic: rollout.expert_episodes replays them."""
        return None

    def knowledge(self, n: int, seed: int = 0) -> list:
        """Tiny arena only: n plain-text documents of this domain's knowledge for the base model's pre-training
        corpus (pretrain.py): the facts and skills a stage later elicits, as text a base could have read (worked
        arithmetic, encyclopaedia passages and reading comprehension, a store's catalogue, policy and case notes,
        writing of many kinds). Never the agent protocol (PROTOCOL_MARKERS: the chat template, tool calls, \\boxed{},
        <answer>), which the stages teach, and never a held-out split's content (val, test, ood tasks), so the
        base stays a base and a test score is not memorised. Deterministic in (n, seed)."""
        raise NotImplementedError


# What the stages teach and a base's pre-training text never contains (Env.knowledge): the chat template's markers,
# the tool-call and tool-result tags, math's boxed answer and search's answer tag.
PROTOCOL_MARKERS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "\\boxed",
                    "<answer>", "</answer>", "<think>")


TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def cache_dir(*parts) -> str:
    """A directory under the project's cache, $ACLARENA_CACHE (default ~/.cache/aclarena): what an environment builds
    once and reuses across processes (the IF world's tasks, a corpus's BM25 index). Not created here."""
    root = os.environ.get("ACLARENA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "aclarena")
    return os.path.join(root, *parts)


def parse_tool_calls(text: str) -> tuple:
    """Find every <tool_call>...</tool_call> block in `text`.

    Returns (calls, errors): calls is a list of (name: str, arguments: dict) for well-formed blocks,
    errors a list of one-line strings, one per malformed block (bad JSON, no name, arguments not an
    object). Never raises; an unterminated last block is parsed up to the end of the text."""
    calls, errors = [], []
    if not isinstance(text, str):
        return calls, ["tool call text is not a string"]
    for raw in TOOL_CALL_RE.findall(text):
        raw = raw.strip()
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            errors.append(f"invalid JSON in tool call: {raw[:80]!r}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append("a tool call must be a JSON object with a string 'name'")
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass
        if not isinstance(args, dict):
            errors.append(f"arguments of '{obj['name']}' must be a JSON object")
            continue
        calls.append((obj["name"], args))
    return calls, errors


def well_formed(messages) -> bool:
    """Every assistant turn that tries a tool call parses (RFT keeps only such episodes). An episode cut
    at the turn limit after the task was done still counts: its reward says whether it ended right."""
    return not any(parse_tool_calls(m["content"])[1] for m in messages
                   if m.get("role") == "assistant" and "<tool_call>" in (m.get("content") or ""))


def check_arguments(schema: dict, args: dict) -> str | None:
    """None if a call's `args` fit its tool's JSON schema (OpenAI function format: no unknown or missing names,
    the right JSON types, array items of the right type), else the problem in one line."""
    params = schema["function"]["parameters"]
    props = params.get("properties", {})
    for k in args:
        if k not in props:
            return f"unexpected argument {k[:40]!r}"
    for k in params.get("required", []):
        if k not in args:
            return f"missing argument {k!r}"
    for k, v in args.items():
        spec = props[k]
        if not _json_type(v, spec.get("type")):
            return f"argument {k!r} must be " + ("an array of strings" if spec.get("type") == "array" and
                                                 spec.get("items", {}).get("type") == "string" else f"a {spec.get('type')}")
        if spec.get("type") == "array" and "items" in spec and not all(_json_type(x, spec["items"].get("type")) for x in v):
            return f"argument {k!r} must be an array of {spec['items'].get('type')}s"
    return None


def _json_type(v, kind) -> bool:
    return {"string": lambda: isinstance(v, str), "integer": lambda: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda: isinstance(v, (int, float)) and not isinstance(v, bool),
            "boolean": lambda: isinstance(v, bool), "array": lambda: isinstance(v, list),
            "object": lambda: isinstance(v, dict), None: lambda: True}.get(kind, lambda: False)()


def valid_tool_calls(messages, tools) -> bool:
    """SDFT's second filter, stricter than well_formed: every tool call of every assistant turn is valid JSON,
    names a tool of `tools` (the task's schemas; None: no tool exists) and has arguments that fit its schema."""
    schemas = {t["function"]["name"]: t for t in tools or []}
    for m in messages:
        if m.get("role") != "assistant" or "<tool_call>" not in (m.get("content") or ""):
            continue
        calls, errors = parse_tool_calls(m["content"])
        if errors or any(name not in schemas or check_arguments(schemas[name], args) for name, args in calls):
            return False
    return True


def tool_call_text(name: str, arguments: dict) -> str:
    """The exact text the policy is expected to write for one call (the scripted experts and tests)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "</tool_call>"


def tool_message(name: str, content) -> dict:
    """A tool result message; non-string content is JSON-encoded."""
    if not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False, sort_keys=True)
    return {"role": "tool", "name": name, "content": content}


def function_schema(name: str, description: str, properties: dict, required=None) -> dict:
    """A tool's JSON schema in OpenAI's function format, e.g.
    function_schema("search", "Search the corpus.", {"query": {"type": "string"}}, ["query"])."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(properties) if required is None else list(required)}}}


def read_jsonl(path) -> list:
    """Rows of a JSONL (or a JSON list) file; UsageError with one clear line on a missing/malformed file."""
    import os
    if not os.path.isfile(path):
        raise UsageError(f"data file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as e:
            raise UsageError(f"malformed JSON in {path}: {e}") from None
        if not isinstance(rows, list):
            raise UsageError(f"malformed JSON in {path}: expected a list of objects")
        return rows
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            raise UsageError(f"malformed JSON on line {i} of {path}: {e}") from None
    return rows


def load_rows(source: str, split: str = "train", configs=(None,)) -> list:
    """Rows (dicts) of a local .jsonl/.json file (read here: a malformed one stops with its line), a local
    .parquet/.csv file or data directory (split names from the file names), or a Hugging Face dataset id (one
    split per config), through `datasets`. Every failure is one UsageError line naming the source and the reason."""
    import os
    path = os.path.expanduser(source)
    local = source.startswith(("/", ".", "~")) or source.count("/") > 1 or source.endswith(
        (".jsonl", ".json", ".parquet", ".csv"))
    if os.path.isfile(path) and path.endswith((".jsonl", ".json")):
        rows = read_jsonl(path)
    elif os.path.exists(path) or not local:
        rows = _dataset_rows(source, path, split, configs)
    else:
        raise UsageError(f"data not found: {source}")
    if not rows:
        raise UsageError(f"no rows in {source!r}")
    bad = next((i for i, r in enumerate(rows, 1) if not isinstance(r, dict)), None)
    if bad:
        raise UsageError(f"row {bad} of {source!r} is not an object: {str(rows[bad - 1])[:60]}")
    return rows


def _dataset_rows(source, path, split, configs) -> list:
    import os

    import datasets
    datasets.disable_progress_bars()             # its bars and logged errors would ride along with our one line
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    try:
        if os.path.isfile(path):
            builder = {"parquet": "parquet", "csv": "csv"}.get(path.rsplit(".", 1)[-1])
            if builder is None:
                raise UsageError(f"unsupported data file {source!r}; expected .jsonl, .json, .parquet or .csv")
            parts = [datasets.load_dataset(builder, data_files=path, split="train")]
        elif os.path.isdir(path):
            if not any(f.endswith((".jsonl", ".json", ".parquet", ".csv")) for f in os.listdir(path)):
                raise UsageError(f"no .jsonl/.json/.parquet/.csv files in {source}")
            found = datasets.load_dataset(path)  # split names come from the file names (train.jsonl, ...)
            if split not in found and len(found) != 1:
                raise UsageError(f"no {split!r} split in {source!r}; it has {', '.join(found)}")
            parts = [found[split] if split in found else next(iter(found.values()))]
        else:
            parts = [datasets.load_dataset(source, config, split=split) for config in configs]
    except UsageError:
        raise
    except Exception as e:  # a malformed file or an unreachable hub id: the innermost reason, in one line
        while e.__cause__ is not None or e.__context__ is not None:
            e = e.__cause__ or e.__context__
        first = (str(e).strip().splitlines() or [""])[0]
        raise UsageError(f"cannot load {source!r}: {type(e).__name__}: {first}") from None
    return [dict(row) for part in parts for row in part]


# ----------------------------------------------------------------------------- files written atomically
# (the ground floor's, so that an environment's cache uses the same write as the library's checkpoints: acl/common.py)


def fsync(path: str):
    """Flush a file, or a directory's entries and every file in it, to the disk: a rename that follows is then never
    the name of an empty or half-written file after a crash (on filesystems that may reorder the two)."""
    paths = [os.path.join(path, f) for f in os.listdir(path)] + [path] if os.path.isdir(path) else [path]
    for p in paths:
        if os.path.isdir(p) and p != path:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file_atomically(path: str, write, suffix: str = "") -> str:
    """Call write(tmp) on a temporary sibling file, fsync it, then rename it to `path` (and fsync the directory): a
    reader never sees half a file, nor a crash an empty one. suffix: the temporary file's extension, for writers that
    pick the format from it (matplotlib)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{tmp_tag()}{suffix}"
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
        fsync(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def tmp_tag() -> str:
    """What every temporary name carries of its writer, host and process: the leftover sweep removes only what a
    process of this host that is no longer alive left (another lane of the same arena, or a node sharing runs/, may
    be writing beside us)."""
    return f"{socket.gethostname()}-{os.getpid()}"
