"""Math: single-turn problems answered in \\boxed{}; exact match in the tiny arena, math-verify at full scale.

    env = MathEnv()                                   # tiny arena: generated arithmetic
    env = MathEnv(data="BytedTsinghua-SIA/DAPO-Math-17k")   # or a local .jsonl/.json/.parquet/.csv or directory
    tasks = env.tasks("test")                         # tiny: train | val | test | ood; real data: train only
    tasks = env.benchmark("aime26")                   # full-scale evaluation: see BENCHMARKS

Tiny arena. In-domain (train/val/test) is `a+b`, `a-b` (a >= b) and `a*b` (b one digit) with 1-3 digit
operands, short operands most common (DIGIT_WEIGHTS) so a ~1M-parameter base is right sometimes.
The three in-domain splits hash-partition the problem space (a+b and b+a count as one problem), so
a test problem never appears in train. OOD is 4-digit operands or three-operand expressions such as
"12+7*3" and "(45-8)+19", which no in-domain split contains.

Real data. Training rows are DAPO-Math-17k style (`prompt` chat list or string plus
`reward_model.ground_truth`) or plain `problem`/`answer`. Benchmarks: AIME 2026 (`problem`/`answer`,
math-verify; avg@k is the caller sampling k times), GPQA-Diamond (its own CSV columns, options shuffled
by a seeded RNG per row) and MMLU-Redux 2.0 (only rows annotated error_type "ok" are kept: rows marked
bad_question_clarity, bad_options_clarity, no_correct_answer, multiple_correct_answers, wrong_groundtruth
or expert are dropped, as their gold letter is unreliable). Multiple choice is graded by the letter in
the last \\boxed{} ("B" or "(B)").

Reward: 1 if the final answer is right, else 0; a truncated episode (cut by a token limit) scores 0
because its answer is unfinished. Metrics: acc, boxed (a \\boxed{...} answer was found at all).
"""
import math
import random
import re
import threading
import zlib

from envs.base import SPLITS, Env, EpisodeState, Task, UsageError, load_rows

SYSTEM = "Math: solve. Put the final answer in \\boxed{}."
BOXED_HINT = "Please reason step by step, and put your final answer within \\boxed{}."
CHOICE_HINT = "Answer with the letter of the correct option within \\boxed{}."
DEFAULT_N = {"train": 5000, "val": 300, "test": 300, "ood": 300}
DIGIT_WEIGHTS = (0.7, 0.2, 0.1)            # chance of a 1-, 2-, 3-digit operand in-domain
OPS, OP_WEIGHTS = ("+", "-", "*"), (0.4, 0.35, 0.25)
# the base's pre-training text (MathEnv.knowledge): how a worked problem is written down, and the tables' names
KNOWLEDGE_FORMS = ("Question: What is {e}?\n{w}.\nAnswer: {v}", "{e} = {v}. Worked out: {w}.",
                   "Compute {e}. {w}. So {e} = {v}.", "What is {e}? {w}. The answer is {v}.")
TABLE_NAMES = {"+": "Sums", "-": "Differences", "*": "Products"}
MAX_ANSWER_CHARS = 1000                    # longer "answers" are garbage; never hand them to sympy

BENCHMARKS = ("aime26", "gpqa_diamond", "mmlu_redux")
# name -> (HF dataset id, configs to concatenate, split); `source=` replaces the id with an id or a local path
BENCHMARK_SOURCES = {
    "aime26": ("MathArena/aime_2026", (None,), "train"),
    "gpqa_diamond": ("Idavidrein/gpqa", ("gpqa_diamond",), "train"),
    "mmlu_redux": ("edinburgh-dawg/mmlu-redux-2.0", tuple("""
        abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology college_chemistry
        college_computer_science college_mathematics college_medicine college_physics computer_security
        conceptual_physics econometrics electrical_engineering elementary_mathematics formal_logic global_facts
        high_school_biology high_school_chemistry high_school_computer_science high_school_european_history
        high_school_geography high_school_government_and_politics high_school_macroeconomics
        high_school_mathematics high_school_microeconomics high_school_physics high_school_psychology
        high_school_statistics high_school_us_history high_school_world_history human_aging human_sexuality
        international_law jurisprudence logical_fallacies machine_learning management marketing
        medical_genetics miscellaneous moral_disputes moral_scenarios nutrition philosophy prehistory
        professional_accounting professional_law professional_medicine professional_psychology
        public_relations security_studies sociology us_foreign_policy virology world_religions""".split()), "test"),
}


# ----------------------------------------------------------------------------- grading

def last_boxed(text) -> str | None:
    """Content of the last \\boxed{...} in `text` (braces balanced), or None."""
    if not isinstance(text, str):
        return None
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _answer_line(text: str) -> str | None:
    """DAPO's own format, 'Answer: 42' on the last line; accepted at full scale since its prompts ask for it."""
    k = text.rfind("Answer:")
    if k < 0:
        return None
    return text[k + len("Answer:"):].split("\n", 1)[0].strip().strip("$").rstrip(".").strip() or None


GRADE_TIMEOUT = 5.0                        # seconds one math-verify grade may take; past it the answer scores 0
GRADE_TIMEOUTS = {"count": 0}              # grades cut at GRADE_TIMEOUT in this process, wherever they ran


def _math_verify_here(pred: str, answer: str, timeout) -> float:
    from math_verify import parse, verify
    gold = parse("\\boxed{" + answer.strip().strip("$") + "}", parsing_timeout=timeout)
    got = parse("\\boxed{" + pred.strip().strip("$") + "}", parsing_timeout=timeout)
    return float(bool(gold) and bool(got) and verify(gold, got, timeout_seconds=timeout))


def _grader_loop(conn):
    """The grading process: (pred, answer) in, a score out, until the pipe closes."""
    while True:
        try:
            pred, answer = conn.recv()
        except EOFError:
            return
        try:
            conn.send(_math_verify_here(pred, answer, None))
        except Exception:
            conn.send(0.0)


class _Grader:
    """math-verify off the main thread, where its signal.alarm timer cannot run: one grading process of its own,
    and a grade that takes longer than GRADE_TIMEOUT has that process killed (and a new one started next time)
    and scores 0. One grade at a time (a lock): grading is fast beside generation."""

    def __init__(self):
        self.lock, self.proc, self.conn = threading.Lock(), None, None

    def __call__(self, pred: str, answer: str) -> float:
        import multiprocessing as mp
        with self.lock:
            if self.proc is None or not self.proc.is_alive():
                self.conn, child = mp.get_context("spawn").Pipe()
                self.proc = mp.get_context("spawn").Process(target=_grader_loop, args=(child,), daemon=True)
                self.proc.start()
                child.close()
                self.conn.send(("1", "1"))   # warm up (imports) outside the first real grade's time limit
                self.conn.recv()
            self.conn.send((pred, answer))
            if self.conn.poll(GRADE_TIMEOUT):
                return self.conn.recv()
            self.proc.kill()
            self.proc.join()
            self.proc = None
            GRADE_TIMEOUTS["count"] += 1
            return 0.0


_GRADER = _Grader()


def _math_verify(pred: str, answer: str) -> float:
    """math-verify's equivalence of pred and answer, bounded by GRADE_TIMEOUT wherever it runs: math-verify's own
    timer on the main thread, a grading process of its own elsewhere (_Grader)."""
    if threading.current_thread() is not threading.main_thread():
        return _GRADER(pred, answer)
    import time
    t0 = time.time()
    score = _math_verify_here(pred, answer, max(1, math.ceil(GRADE_TIMEOUT)))   # signal.alarm: whole seconds
    if time.time() - t0 >= GRADE_TIMEOUT:
        GRADE_TIMEOUTS["count"] += 1
    return score


def grade(response: str, gold: dict) -> float:
    """1.0 if `response` answers `gold` correctly, else 0.0; never raises on what the model wrote.
    gold = {"kind": "exact" | "math_verify" | "choice", "answer": str}."""
    kind = gold.get("kind")
    if kind not in ("exact", "math_verify", "choice"):
        raise UsageError(f"unknown grading kind {kind!r}; expected exact, math_verify or choice")
    try:
        answer = str(gold["answer"])
        got = last_boxed(response)
        if kind == "exact":  # tiny arena: the boxed text itself, spaces ignored
            return float(got is not None and "".join(got.split()) == "".join(answer.split()))
        if got is None and isinstance(response, str):
            got = _answer_line(response)
        if got is None or len(got) > MAX_ANSWER_CHARS:
            return 0.0
        if kind == "choice":
            m = re.fullmatch(r"\(?([A-Z])\)?", got.strip())
            return float(m is not None and m.group(1) == answer)
        return _math_verify(got, answer)
    except Exception:  # math-verify/sympy can fail in many ways on model text: that is a wrong answer
        return 0.0


# ----------------------------------------------------------------------------- tiny generator

def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def problem_key(a: int, op: str, b: int) -> str:
    """One name per in-domain problem; + and * are commutative, so 3+5 and 5+3 share it."""
    if op in "+*":
        a, b = min(a, b), max(a, b)
    return f"{a}{op}{b}"


def split_of(a: int, op: str, b: int) -> str:
    """Which in-domain split owns a problem: a stable hash gives test 10%, val 10%, train 80%."""
    bucket = zlib.crc32(problem_key(a, op, b).encode()) % 10
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


def _in_domain(rng: random.Random, split: str) -> tuple:
    """(expression, value) for a 2-operand problem owned by `split` (rejection sampling on the hash)."""
    while True:
        op = rng.choices(OPS, OP_WEIGHTS)[0]
        a = _number(rng, rng.choices((1, 2, 3), DIGIT_WEIGHTS)[0])
        b = _number(rng, 1 if op == "*" else rng.choices((1, 2, 3), DIGIT_WEIGHTS)[0])
        if op == "-" and a < b:
            a, b = b, a
        if split_of(a, op, b) == split:
            return f"{a}{op}{b}", _apply(a, op, b)


def ood_split_of(expr: str) -> str:
    """Which use an out-of-domain problem (a 4-digit operand, three operands) has: a stable hash gives 1 in 5 to the
    `ood` evaluation split and the rest to the base's pre-training text (MathEnv.knowledge), so the base has read
    worked problems of these forms, as a real base has read harder mathematics, but never an evaluated one."""
    return "ood" if zlib.crc32(expr.encode()) % 5 == 0 else "knowledge"


def _ood(rng: random.Random, use: str = "ood") -> tuple:
    """(expression, value) of `use` (ood_split_of): a 4-digit operand, or three operands with precedence or
    parentheses."""
    while True:
        expr, value = _ood_form(rng)
        if ood_split_of(expr) == use:
            return expr, value


def _ood_form(rng: random.Random) -> tuple:
    if rng.random() < 0.5:
        op, a, b = rng.choice("+-"), _number(rng, 4), _number(rng, rng.randint(1, 4))
        if op == "-" and a < b:
            a, b = b, a
        return f"{a}{op}{b}", _apply(a, op, b)
    while True:
        a, b, c = (_number(rng, rng.choice((1, 2))) for _ in range(3))
        op1, op2 = rng.choice(OPS), rng.choice(OPS)
        form = rng.choice(("plain", "left", "right"))
        if form == "left":
            text, value = f"({a}{op1}{b}){op2}{c}", _apply(_apply(a, op1, b), op2, c)
        elif form == "right":
            text, value = f"{a}{op1}({b}{op2}{c})", _apply(a, op1, _apply(b, op2, c))
        elif op2 == "*" and op1 != "*":  # a+b*c: multiplication first
            text, value = f"{a}{op1}{b}{op2}{c}", _apply(a, op1, b * c)
        else:
            text, value = f"{a}{op1}{b}{op2}{c}", _apply(_apply(a, op1, b), op2, c)
        if value >= 0:
            return text, value


def working(a: int, op: str, b: int) -> tuple:
    """Column-by-column working of a+b, a-b (a >= b) or a*b (b one digit), right to left, and its result:
    "7+5=12 so 2; 3+4+1=8 so 82". Each step is one single-digit fact (which train problems cover, even when
    the whole problem is a test one) and then the answer so far, one digit longer: every step copies from
    just before it. -> (text, answer as int)."""
    da, db = str(a)[::-1], str(b)[::-1]
    cols = len(da) if op == "*" else max(len(da), len(db))
    steps, so_far, carry = [], "", 0
    for i in range(cols):
        x = int(da[i]) if i < len(da) else 0
        y = b if op == "*" else int(db[i]) if i < len(db) else 0
        if op == "-":
            need = 10 if x - y - carry < 0 else 0
            r = need + x - y - carry
            fact = f"{need + x}-{y}" + (f"-{carry}" if carry else "") + f"={r}"
            digit, carry = r, need // 10
        else:
            r = x + y + carry if op == "+" else x * y + carry
            fact = (f"{x}+{y}" if op == "+" else f"{x}*{y}") + (f"+{carry}" if carry else "") + f"={r}"
            digit, carry = r % 10, r // 10
        last = i == cols - 1
        so_far = (str(r) if last and op != "-" else str(digit)) + so_far
        steps.append(f"{fact} so {so_far}")
    return "; ".join(steps), int(so_far)


def expert_working(expr: str) -> str:
    """The scripted expert's reply to "What is <expr>?": each operation in the order it is evaluated, worked
    column by column (working()), then the boxed value, e.g. "37+45: 7+5=12 so 2; 3+4+1=8 so 82. \\boxed{82}"."""
    lines, value = worked_lines(expr)
    return ". ".join(lines) + f". \\boxed{{{value}}}"


def worked_lines(expr: str) -> tuple:
    """(lines, value): one line per operation of `expr` in the order it is evaluated, each worked column by column
    (working()), "37+45: 7+5=12 so 2; 3+4+1=8 so 82"; an operation that working() does not cover (a subtraction below
    zero on the way) is one plain fact, "3-7=-4"."""
    import ast

    def ev(node, lines):
        if isinstance(node, ast.Constant):
            return node.value
        x, y = ev(node.left, lines), ev(node.right, lines)
        op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}[type(node.op)]
        value = _apply(x, op, y)
        if x < 0 or y < 0 or value < 0:
            lines.append(f"{x}{op}{y}={value}")
        else:
            a, b = (y, x) if op == "*" and y > x else (x, y)   # the longer factor is worked digit by digit
            lines.append(f"{a}{op}{b}: {working(a, op, b)[0]}")
        return value

    lines = []
    value = ev(ast.parse(expr, mode="eval").body, lines)
    return lines, value


def _tiny_task(split: str, i: int, seed: int, expr: str, value: int) -> Task:
    return Task(id=f"math-{split}-{seed}-{i}", env="math", split=split,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {expr}?"}],
                gold={"kind": "exact", "answer": str(value), "expr": expr})


# ----------------------------------------------------------------------------- real data

def _column(row: dict, name: str, i: int, source: str):
    if row.get(name) is None:
        raise UsageError(f"row {i} of {source!r} has no {name!r} column")
    return row[name]


def _train_task(row: dict, i: int, source: str) -> Task:
    """A DAPO-Math-17k row (prompt chat list + reward_model.ground_truth) or a plain problem/answer row."""
    reward_model = row.get("reward_model")
    answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    answer = row.get("answer") if answer is None else answer
    if answer is None or str(answer).strip() == "":
        raise UsageError(f"row {i} of {source!r} has no answer (expected reward_model.ground_truth or answer)")
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in prompt):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    elif isinstance(row.get("problem"), str) or isinstance(prompt, str):
        problem = row["problem"] if isinstance(row.get("problem"), str) else prompt
        messages = [{"role": "user", "content": f"{problem}\n\n{BOXED_HINT}"}]
    else:
        raise UsageError(f"row {i} of {source!r} has no problem (expected a 'prompt' chat list or 'problem' text)")
    return Task(id=f"math-train-{i}", env="math", split="train", messages=messages,
                gold={"kind": "math_verify", "answer": str(answer).strip()})


def _choice_task(name: str, i: int, question: str, options: list, correct: int) -> Task:
    letters = [chr(ord("A") + k) for k in range(len(options))]
    body = "\n".join(f"{letter}) {str(option).strip()}" for letter, option in zip(letters, options))
    return Task(id=f"{name}-{i}", env="math", split=name,
                messages=[{"role": "user", "content": f"{str(question).strip()}\n\n{body}\n\n{CHOICE_HINT}"}],
                gold={"kind": "choice", "answer": letters[correct]})


# ----------------------------------------------------------------------------- the environment

class MathEnv(Env):
    """Single turn, no tools: the reply is graded by `grade` against task.gold."""
    domain = "math"
    max_turns = 1

    def __init__(self, data: str | None = None, seed: int = 0):
        self.data, self.seed = data, seed
        self.train_tasks = None
        if data is not None:  # load now, so a bad path or file fails at construction
            tasks, seen = [], set()
            for i, row in enumerate(load_rows(data, "train")):
                task = _train_task(row, i, data)
                key = repr(task.messages)
                if key not in seen:  # the original DAPO-Math-17k repeats each prompt about 100 times
                    seen.add(key)
                    tasks.append(task)
            self.train_tasks = tasks

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list:
        if split not in SPLITS:
            raise UsageError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        if n is not None and (not isinstance(n, int) or n < 0):
            raise UsageError(f"n must be a non-negative integer, got {n!r}")
        if self.train_tasks is not None:
            if split != "train":
                raise UsageError(f"math with real data has only a 'train' split; evaluate with benchmark(), "
                               f"one of {', '.join(BENCHMARKS)}")
            tasks = list(self.train_tasks)
            random.Random(seed).shuffle(tasks)
            return tasks if n is None else tasks[:n]
        n = DEFAULT_N[split] if n is None else n
        rng = random.Random(f"math-{split}-{seed}")
        make = (lambda: _ood(rng)) if split == "ood" else (lambda: _in_domain(rng, split))
        return [_tiny_task(split, i, seed, *make()) for i in range(n)]

    def step(self, state: EpisodeState, text: str) -> list:
        state.messages.append({"role": "assistant", "content": text if isinstance(text, str) else ""})
        state.turns += 1
        state.done = True  # one reply is the whole episode
        return []

    def score(self, state: EpisodeState) -> tuple:
        replies = [m.get("content") for m in state.messages[len(state.task.messages):] if m.get("role") == "assistant"]
        text = replies[-1] if replies and isinstance(replies[-1], str) else ""
        boxed = float(last_boxed(text) is not None)
        acc = 0.0 if state.truncated else grade(text, state.task.gold)
        return acc, {"acc": acc, "boxed": boxed}

    def compliant(self, state: EpisodeState) -> bool:
        """One reply, no tool call, ending in its \\boxed{} answer: nothing after it but spaces or a full stop."""
        replies = [m.get("content") or "" for m in state.messages if m.get("role") == "assistant"]
        if state.truncated or len(replies) != 1 or "<tool_call>" in replies[0]:
            return False
        text, inner = replies[0], last_boxed(replies[0])
        end = text.rfind("\\boxed{") + len("\\boxed{") + len(inner or "") + 1
        return inner is not None and not text[end:].strip(" \n.$")

    def expert(self, task: Task) -> list | None:
        return [expert_working(task.gold["expr"])] if task.gold.get("expr") else None

    def knowledge(self, n: int, seed: int = 0) -> list:
        """Arithmetic as a base reads it, never boxed (the stage teaches \\boxed{}):
        - worked problems (4 documents in 5): 3-8 problems each, worked column by column as the expert works them
          (worked_lines), in one of KNOWLEDGE_FORMS' phrasings; two in three are in-domain problems of the train
          split, one in three has an out-of-domain form (a 4-digit operand, three operands) from the knowledge
          share of ood_split_of;
        - tables (1 in 5): one digit's single-digit sums, differences or products, "7+5=12, 7+6=13, ...".
        No val, test or ood problem ever appears."""
        rng = random.Random(f"math-knowledge-{seed}")
        out = []
        for _ in range(n):
            if rng.random() < 0.2:
                d, op = rng.randrange(10), rng.choice(OPS)
                facts = [f"{d + y}-{y}={d}" if op == "-" else f"{d}{op}{y}={_apply(d, op, y)}" for y in range(10)]
                out.append(f"{TABLE_NAMES[op]} of {d}: " + ", ".join(facts) + ".")
                continue
            problems = []
            for _ in range(rng.randint(3, 8)):
                expr, value = _in_domain(rng, "train") if rng.random() < 2 / 3 else _ood(rng, "knowledge")
                lines, _ = worked_lines(expr)
                problems.append(rng.choice(KNOWLEDGE_FORMS).format(e=expr, w=". ".join(lines), v=value))
            out.append("\n\n".join(problems))
        return out

    def benchmark(self, name: str, source: str | None = None, n: int | None = None) -> list:
        """Evaluation tasks of a full-scale benchmark (see BENCHMARKS), from its HF id or `source`."""
        if name not in BENCHMARKS:
            raise UsageError(f"unknown math benchmark {name!r}; expected one of {', '.join(BENCHMARKS)}")
        hub_id, configs, split = BENCHMARK_SOURCES[name]
        src = source or hub_id
        rows = load_rows(src, split, configs if source is None else (None,))
        tasks = []
        for i, row in enumerate(rows):
            if name == "aime26":
                problem, answer = _column(row, "problem", i, src), _column(row, "answer", i, src)
                tasks.append(Task(id=f"aime26-{row.get('problem_idx', i)}", env="math", split=name,
                                  messages=[{"role": "user", "content": f"{problem}\n\n{BOXED_HINT}"}],
                                  gold={"kind": "math_verify", "answer": str(answer).strip()}))
            elif name == "gpqa_diamond":
                question = _column(row, "Question", i, src)
                options = [_column(row, c, i, src) for c in
                           ("Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")]
                order = list(range(4))
                random.Random(f"gpqa-{self.seed}-{question}").shuffle(order)  # str seeds are stable across runs
                tasks.append(_choice_task(name, i, question, [options[k] for k in order], order.index(0)))
            else:
                if row.get("error_type") not in (None, "", "ok"):
                    continue
                question, choices = _column(row, "question", i, src), _column(row, "choices", i, src)
                answer = _column(row, "answer", i, src)
                if not isinstance(choices, list) or not 2 <= len(choices) <= 26 or not (
                        isinstance(answer, int) and 0 <= answer < len(choices)):
                    raise UsageError(f"row {i} of {src!r}: expected a list of choices and an int answer index")
                tasks.append(_choice_task(name, i, question, choices, answer))
        return tasks if n is None else tasks[:n]
