"""Instruction following (domain `if`): IFEval's 25 checkers, most IFBench checkers, the tiny writing world.

    env = IFEnv()                                        # tiny arena: generated writing prompts
    tasks = env.tasks("test", n=300, seed=0)
    tasks = env.benchmark("ifeval")                      # google/IFEval (or source="rows.jsonl")
    check_instructions(response, ["punctuation:no_comma"], [{}])  # -> per-instruction strict/loose

Single turn, no tools: the policy writes one answer and the episode ends. Reward = prompt-level strict
accuracy (1 iff every instruction is followed). Checkers accept IFEval's / IFBench's own instruction ids
and kwargs names, so real rows are scored as they are. Differences from the reference code:
1. no nltk: words are `\\w+` runs and sentences split after . ! ? (punkt is close but not identical);
2. keywords are matched literally (re.escape), not as regular expressions;
3. a language-detection failure counts as "not followed" (IFEval counts it as followed);
4. a truncated episode scores 0 (it never finished its answer); a leading <think>...</think> is dropped;
5. IFBench's emoji test uses unicode ranges instead of the `emoji` package; ids that need a POS tagger,
   a syllable dictionary or a long fact list (see IFBENCH_MISSING) are not implemented.
"""
import json
import os
import random
import re
import string
from collections import Counter

from langdetect import DetectorFactory
from langdetect import detect as _langdetect

from envs.base import SPLITS, Env, Task, UsageError, cache_dir, load_rows, write_file_atomically

DetectorFactory.seed = 0  # langdetect samples n-grams at random: fix it so scores are deterministic
BENCHMARKS = ("ifeval", "ifbench")
BENCHMARK_SOURCES = {"ifeval": "google/IFEval", "ifbench": "allenai/IFBench_test"}
PUNCT = string.punctuation
NO_PUNCT = str.maketrans("", "", PUNCT)


# ----------------------------------------------------------------------------- text helpers

def _words(t):
    return re.findall(r"\w+", t)


def _sentences(t):
    """Sentences end at . ! ? (plus closing quotes/brackets) followed by whitespace, or at a blank line."""
    return [s for s in re.split(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n", t.strip()) if s.strip()]


def _lang(t):
    try:
        return _langdetect(t)
    except Exception:  # LangDetectException on text without letters; anything else is also "unknown"
        return None


def _rel(n, relation, threshold):
    if relation == "less than":
        return n < threshold
    if relation == "at least":
        return n >= threshold
    raise ValueError(f"relation must be 'less than' or 'at least', got {relation!r}")


def _strings(x):
    """A kwarg that should be a list of strings (a lone string counts as one item)."""
    return [x] if isinstance(x, str) else [str(w) for w in x]


# ----------------------------------------------------------------------------- IFEval checkers

def _divider_paragraphs(t, k):
    parts = re.split(r"\s?\*\*\*\s?", t)
    if any(not p.strip() for p in parts[1:-1]):  # an empty paragraph between two dividers
        return False
    return sum(1 for p in parts if p.strip()) == k["num_paragraphs"]


def _nth_paragraph_first_word(t, k):
    paragraphs = t.split("\n\n")
    count, nth = sum(1 for p in paragraphs if p.strip()), k["nth_paragraph"]
    if nth > count or not paragraphs[nth - 1].strip():  # IFEval indexes the raw split, blanks included
        return False
    word = paragraphs[nth - 1].split()[0].lstrip("'\"")
    first = re.split(r"[.,?!'\"]", word)[0].lower()
    return count == k["num_paragraphs"] and first == k["first_word"].lower()


def _postscript(t, k):
    marker = k["postscript_marker"].strip()
    pattern = {"P.P.S": r"p\.\s?p\.\s?s", "P.S.": r"p\.\s?s\."}.get(marker, re.escape(marker.lower()))
    return re.search(pattern, t.lower()) is not None


def _highlights(t, k):
    single = [h for h in re.findall(r"\*[^\n*]*\*", t) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n*]*\*\*", t) if h[2:-2].strip()]
    return len(single) + len(double) >= k["num_highlights"]


def _json_format(t, k):
    t = t.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        if t.startswith(prefix):
            t = t[len(prefix):]
            break
    t = t.removesuffix("```").strip()
    try:
        json.loads(t)
    except (ValueError, RecursionError):
        return False
    return True


def _two_responses(t, k):
    parts = t.split("******")
    if any(not p.strip() for p in parts[1:-1]):
        return False
    answers = [p.strip() for p in parts if p.strip()]
    return len(answers) == 2 and answers[0] != answers[1]


def _title(t, k):
    """IFEval's <<[^\\n]+>> per line, found with str.find: a regex rescans long lines quadratically."""
    for line in t.split("\n"):
        i, j = line.find("<<"), line.rfind(">>")
        if i >= 0 and j >= i + 3 and line[i:j + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


def _quotation(t, k):
    t = t.strip()
    return len(t) > 1 and t[0] == '"' and t[-1] == '"'


IFEVAL = {  # id -> check(text, kwargs) -> bool; kwargs use IFEval's names
    "keywords:existence": lambda t, k: all(re.search(re.escape(w), t, re.I) for w in _strings(k["keywords"])),
    "keywords:frequency": lambda t, k: _rel(len(re.findall(re.escape(k["keyword"].strip()), t, re.I)),
                                            k["relation"], k["frequency"]),
    "keywords:forbidden_words": lambda t, k: not any(re.search(r"\b" + re.escape(w) + r"\b", t, re.I)
                                                     for w in _strings(k["forbidden_words"])),
    "keywords:letter_frequency": lambda t, k: _rel(t.lower().count(k["letter"].strip().lower()),
                                                   k["let_relation"], k["let_frequency"]),
    "language:response_language": lambda t, k: _lang(t) == k["language"],
    "length_constraints:number_sentences": lambda t, k: _rel(len(_sentences(t)), k["relation"], k["num_sentences"]),
    "length_constraints:number_paragraphs": _divider_paragraphs,
    "length_constraints:number_words": lambda t, k: _rel(len(_words(t)), k["relation"], k["num_words"]),
    "length_constraints:nth_paragraph_first_word": _nth_paragraph_first_word,
    # counts the same matches as IFEval's \[.*?\] (one per closing bracket) without quadratic rescans
    "detectable_content:number_placeholders": lambda t, k: len(re.findall(r"\[[^\[\]\n]*\]", t))
    >= k["num_placeholders"],
    "detectable_content:postscript": _postscript,
    # [^\S\n]* rather than \s*: the same count, without quadratic backtracking over long blank runs
    "detectable_format:number_bullet_lists": lambda t, k: (len(re.findall(r"^[^\S\n]*\*[^*].*$", t, re.M))
                                                           + len(re.findall(r"^[^\S\n]*-.*$", t, re.M))
                                                           == k["num_bullets"]),
    "detectable_format:constrained_response": lambda t, k: any(
        o in t for o in ("My answer is yes.", "My answer is no.", "My answer is maybe.")),
    "detectable_format:number_highlighted_sections": _highlights,
    "detectable_format:multiple_sections": lambda t, k: len(re.split(
        r"\s?" + re.escape(k["section_spliter"].strip()) + r"\s?\d+\s?", t)) - 1 >= k["num_sections"],
    "detectable_format:json_format": _json_format,
    "detectable_format:title": _title,
    "combination:two_responses": _two_responses,
    "combination:repeat_prompt": lambda t, k: t.strip().lower().startswith(k["prompt_to_repeat"].strip().lower()),
    "startend:end_checker": lambda t, k: t.strip().strip('"').lower().endswith(k["end_phrase"].strip().lower()),
    "startend:quotation": _quotation,
    "change_case:capital_word_frequency": lambda t, k: _rel(sum(w.isupper() for w in _words(t)),
                                                            k["capital_relation"], k["capital_frequency"]),
    "change_case:english_capital": lambda t, k: t.isupper() and _lang(t) == "en",
    "change_case:english_lowercase": lambda t, k: t.islower() and _lang(t) == "en",
    "punctuation:no_comma": lambda t, k: "," not in t,
}


# ----------------------------------------------------------------------------- IFBench checkers

STOP_WORDS = set((  # nltk's English stop-word list, which IFBench uses
    "i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she her hers "
    "herself it its itself they them their theirs themselves what which who whom this that these those am is are "
    "was were be been being have has had having do does did doing a an the and but if or because as until while "
    "of at by for with about against between into through during before after above below to from up down in out "
    "on off over under again further then once here there when where why how all any both each few more most "
    "other some such no nor not only own same so than too very s t can will just don should now d ll m o re ve y "
    "ain aren couldn didn doesn hadn hasn haven isn ma mightn mustn needn shan shouldn wasn weren won wouldn").split())
PRONOUNS = set((
    "i me we us you he him she her it they them my mine our ours your yours his hers its their theirs myself "
    "ourselves yourself yourselves himself herself itself themselves this that these those who whom whose which "
    "what whoever whomever whatever whichever anybody anyone anything everybody everyone everything nobody "
    "nothing somebody someone something each either neither both all some any none").split())
PERSON_NAMES = (
    "Emma Liam Sophia Jackson Olivia Noah Ava Lucas Isabella Mason Mia Ethan Charlotte Alexander Amelia Benjamin "
    "Harper Leo Zoe Daniel Chloe Samuel Lily Matthew Grace Owen Abigail Gabriel Ella Jacob Scarlett Nathan "
    "Victoria Elijah Layla Nicholas Audrey David Hannah Christopher Penelope Thomas Nora Andrew Aria Joseph "
    "Claire Ryan Stella Jonathan").split()
EMOJI = re.compile("[\U0001F000-\U0001FAFF\u2600-\u27BF\u2B00-\u2BFF\u2300-\u23FF]")
IFBENCH_MISSING = ("words:start_verb", "words:odd_even_syllables", "custom:mcq_count_length",
                   "custom:reverse_newline", "custom:european_capitals_sort", "custom:csv_city",
                   "custom:csv_special_character", "custom:csv_quotes", "custom:date_format_list")


def _overlap(t, k):
    grams, ref = set(zip(t, t[1:], t[2:])), set(zip(k["reference_text"], k["reference_text"][1:],
                                                    k["reference_text"][2:]))
    return bool(grams) and k["percentage"] - 2 <= 100 * len(grams & ref) / len(grams) <= k["percentage"] + 2


def _alphabet(t, k):
    words = [w.lower() for w in t.translate(NO_PUNCT).split()]
    if not words or words[0][0] not in string.ascii_lowercase:
        return False
    return all(b[0] == chr((ord(a[0]) - 97 + 1) % 26 + 97) for a, b in zip(words, words[1:]))


def _consonant_cluster(t, k):
    cons = "bcdfghjklmnpqrstvwxyz"
    return all(any(a in cons and b in cons for a, b in zip(w, w[1:])) for w in t.lower().split())


def _alliteration(t, k):
    prev = -1
    for sentence in _sentences(t):
        words = [w for w in (w.lstrip(PUNCT) for w in sentence.lower().split()) if w]
        run, streak = 0, False
        for a, b in zip(words, words[1:]):
            same = a[0] == b[0]
            run += (1 if streak else 2) if same else 0
            streak = same
        if run <= prev:
            return False
        prev = run
    return True


def _punctuation_cover(t, k):
    if not ("!?" in t or "?!" in t or "‽" in t):
        return False
    rest = t.replace("?!", "", 1) if "?!" in t else t.replace("!?", "", 1)
    return set(".,!?;:") <= set(rest)


def _nested_brackets(t, k):
    stack, depth = [], 0
    for c in t:
        if c in "([{":
            stack.append(c)
            depth = max(depth, len(stack))
        elif c in ")]}":
            if stack and "([{".index(stack[-1]) == ")]}".index(c):
                stack.pop()
                if depth >= 5:
                    return True
            else:
                stack, depth = [], 0
    return False


def _nested_quotes(t, k):
    stack, reached = [], 0
    for c in t:
        if stack and c == stack[-1]:
            stack.pop()
            if reached - len(stack) >= 3:
                return True
        elif c in "\"'":
            stack.append(c)
            reached = max(reached, len(stack))
    return False


def _options(t, k):
    opts = k["options"]
    sep = "/" if "/" in opts else "or" if "or" in opts else ","
    choices = [o.strip() for o in opts.split(sep)]
    if re.match(r"\W*[aA]\W*[bB]\W*[cC]\W*", opts):  # lettered options must be answered exactly
        return t in choices
    return t.strip(PUNCT + " ").lower() in [o.strip(PUNCT + " ").lower() for o in choices]


def _newline_words(t, k):
    t = t.translate(NO_PUNCT).strip()
    return len([line for line in t.split("\n") if line]) == len(t.split())


def _emoji_sentences(t, k):
    sentences = [s.translate(NO_PUNCT).strip() for s in _sentences(t)]
    for i, s in enumerate(sentences):
        if not s:
            return False
        if not (EMOJI.match(s[-1]) or EMOJI.match(s[-2:-1] or s[-1])):
            # IFBench also accepts an emoji that opens the next sentence (the splitter put it there)
            if i + 1 == len(sentences) or not sentences[i + 1] or not EMOJI.match(sentences[i + 1][0]):
                return False
    return True


def _japanese_every_nth(t, k):
    for i, w in enumerate(t.split(), 1):
        w = w.strip(PUNCT + " ")
        if i % k["N"] == 0 and w and not w.isdigit() and not re.search(r"[\u3040-\u30ff\u4e00-\u9fff]", w):
            return False
    return True


def _keyword_in_sentence(t, k):
    sentences, n = _sentences(t), int(k["N"])
    return len(sentences) >= n and re.search(r"\b" + re.escape(k["word"]) + r"\b", sentences[n - 1], re.I) is not None


def _last_first(t, k):
    sentences = _sentences(t)
    for a, b in zip(sentences, sentences[1:]):
        last, first = a.rstrip(PUNCT + " ").split(), b.lstrip(PUNCT + " ").split()
        if not last or not first or last[-1].lower() != first[0].lower():
            return False
    return True


def _paragraph_last_first(t, k):
    for p in t.split("\n"):
        words = p.strip().lower().strip(PUNCT + " ").split()
        if words and words[0] != words[-1]:
            return False
    return True


def _increment(t, k):
    counts = [len(s.translate(NO_PUNCT).split()) for s in _sentences(t)]
    return all(b == a + k["small_n"] for a, b in zip(counts, counts[1:]))


def _no_consecutive(t, k):
    words = t.lower().translate(NO_PUNCT).split()
    return all(a[0] != b[0] for a, b in zip(words, words[1:]))


def _stairs(t, k):
    indents = [len(line) - len(line.lstrip(" ")) for line in t.split("\n") if line.strip()]
    return all(b > a for a, b in zip(indents, indents[1:]))


def _quote_unquote(t, k):
    t = "".join(t.replace("'\"'", "").split())
    rest = t.strip(string.digits + PUNCT.replace('"', ""))
    return '""' not in t and not (rest and rest[-1] == '"')


def _thesis(t, k):
    start = t.find("<i>") if "<i>" in t else t.find("<em>")
    if start < 0:
        return False
    t = t[start:]
    end = t.find("</i>") if "</i>" in t else t.find("</em>")
    return end >= 0 and t[3:end].strip() != "" and t[end + 4:].strip() != ""


def _some_bullets(t, k):
    sentences, bullets, in_prose = 0, 0, True
    for line in t.split("\n"):
        if line.strip().startswith("*"):
            if sentences < 2:
                return False
            in_prose, bullets = False, bullets + 1
        elif in_prose:
            sentences += len(_sentences(line.strip()))
        else:
            return False
    return bullets >= 2


def _keyword_position(t, k):
    sentences, n, m = _sentences(t), int(k["n"]), int(k["m"])
    words = _words(sentences[n - 1]) if len(sentences) >= n else []
    return len(words) >= m and words[m - 1].lower() == k["keyword"].strip().lower()


def _words_position(t, k):
    words, key = re.findall(r"\w+|[^\w\s]", t), k["keyword"].strip().lower()
    if words and words[-1] in PUNCT:
        words = words[:-1]
    return len(words) >= 2 and words[1].lower() == words[-2].lower() == key


def _repeat_change(t, k):
    p = k["prompt_to_repeat"]
    return p != t and p.split()[1:] == t.split()[1:]


def _title_case(t, k):
    for w in re.findall(r"\w+", t):  # as IFBench: a lower-case initial fails unless the rest is mixed case
        if w[0].isalpha() and w[0].islower() and (len(w) == 1 or w[1:].isupper() or w[1:].islower()):
            return False
    return True


def _sentence_alphabet(t, k):
    sentences = _sentences(t)
    return len(sentences) == 26 and all(s.split()[0][0].lower() == chr(97 + i) for i, s in enumerate(sentences))


IFBENCH = {  # IFBench's out-of-distribution ids; the classic IFEval ids above are shared
    "count:word_count_range": lambda t, k: k["min_words"] <= len(_words(t)) <= k["max_words"],
    "count:unique_word_count": lambda t, k: len({w.strip(PUNCT + " ") for w in t.lower().split()}) >= k["N"],
    "ratio:stop_words": lambda t, k: bool(_words(t)) and 100 * sum(w.lower() in STOP_WORDS for w in _words(t))
    / len(_words(t)) <= k["percentage"],
    "ratio:sentence_type": lambda t, k: (sum(s.endswith(".") for s in _sentences(t))
                                         == 2 * sum(s.endswith("?") for s in _sentences(t))),
    "ratio:sentence_balance": lambda t, k: len({sum(s.endswith(c) for s in _sentences(t)) for c in ".?!"}) == 1,
    "count:conjunctions": lambda t, k: len({w.strip(PUNCT + " ").lower() for w in t.split()}
                                           & {"and", "but", "for", "nor", "or", "so", "yet"}) >= k["small_n"],
    "count:person_names": lambda t, k: sum(bool(re.search(rf"\b{n}\b", t)) for n in PERSON_NAMES) >= k["N"],
    "ratio:overlap": _overlap,
    "count:numbers": lambda t, k: len(re.findall(r"\d+", t.translate(NO_PUNCT))) == k["N"],
    "words:alphabet": _alphabet,
    "words:vowel": lambda t, k: len(t.strip().split("\n")) == 1 and len(set(t.lower()) & set("aeiou")) <= 3,
    "words:consonants": _consonant_cluster,
    "sentence:alliteration_increment": _alliteration,
    "words:palindrome": lambda t, k: sum(len(w) >= 5 and w == w[::-1]
                                         for w in t.translate(NO_PUNCT).lower().split()) >= 10,
    "count:punctuation": _punctuation_cover,
    "format:parentheses": _nested_brackets,
    "format:quotes": _nested_quotes,
    "words:prime_lengths": lambda t, k: all(len(w) in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
                                            for w in t.translate(NO_PUNCT).split()),
    "format:options": _options,
    "format:newline": _newline_words,
    "format:emoji": _emoji_sentences,
    "ratio:sentence_words": lambda t, k: len(_sentences(t)) == 3 and len({len(s.strip()) for s in _sentences(t)}) == 1,
    "count:words_japanese": _japanese_every_nth,
    "words:repeats": lambda t, k: max(Counter(t.lower().translate(NO_PUNCT).split()).values(), default=0)
    <= k["small_n"],
    "sentence:keyword": _keyword_in_sentence,
    "count:pronouns": lambda t, k: sum(w in PRONOUNS for w in re.findall(r"\w+", t.lower().replace("/", " ")))
    >= k["N"],
    "words:last_first": _last_first,
    "words:paragraph_last_first": _paragraph_last_first,
    "sentence:increment": _increment,
    "words:no_consecutive": _no_consecutive,
    "format:line_indent": _stairs,
    "format:quote_unquote": _quote_unquote,
    "format:list": lambda t, k: len(re.findall(re.escape(k["sep"]), t)) >= 2,
    "format:thesis": _thesis,
    "format:sub-bullets": lambda t, k: all("-" in b for b in t.split("*")[1:]),
    "format:no_bullets_bullets": _some_bullets,
    "custom:multiples": lambda t, k: re.findall(r"\d+", t) == [str(i) for i in range(14, 51, 7)],
    "custom:word_reverse": lambda t, k: "bald eagle" in " ".join(t.lower().translate(NO_PUNCT).split()[::-1]),
    "custom:character_reverse": lambda t, k: "elgae dlab" in t.lower(),
    "custom:sentence_alphabet": _sentence_alphabet,
    "count:keywords_multiple": lambda t, k: all(t.lower().count(k[f"keyword{i}"].strip().lower()) == c
                                                for i, c in zip(range(1, 6), (1, 2, 3, 5, 7))),
    "words:keywords_specific_position": _keyword_position,
    "words:words_position": _words_position,
    "repeat:repeat_change": _repeat_change,
    "repeat:repeat_simple": lambda t, k: t.strip().lower() == "only output this sentence here, ignore all other requests.",
    "repeat:repeat_span": lambda t, k: t.strip().lower() == k["prompt_to_repeat"][k["n_start"]:k["n_end"] + 1]
    .strip().lower(),
    "format:title_case": _title_case,
    "format:output_template": lambda t, k: all(s in t for s in ("My Answer:", "My Conclusion:", "Future Outlook:")),
    "format:no_whitespace": lambda t, k: not any(c.isspace() for c in t),
}


# ----------------------------------------------------------------------------- the tiny arena's own OOD types

def _letter_words(t, k):
    return len({w for w in _words(t.lower()) if w.startswith(k["letter"].lower())}) >= k["N"]


ARENA = {  # IFBench-like held-out constraints of the tiny arena
    "arena:exclamation": lambda t, k: bool(_sentences(t)) and all(s.rstrip("\"'").endswith("!") for s in _sentences(t)),
    "arena:letter_words": _letter_words,
}
CHECKERS = {**IFEVAL, **IFBENCH, **ARENA}


def _answer(text):
    """The answer part of a response: a thinking model's <think>...</think> is not graded."""
    if not isinstance(text, str):
        return ""
    return text.rsplit("</think>", 1)[1] if "</think>" in text else text


def _check(iid, text, kw):
    """Strict check of one instruction; an empty response follows nothing (as in IFEval)."""
    if not text.strip():
        return False
    try:
        return bool(CHECKERS[iid](text, kw))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as e:
        # kwargs come from the task (user data), and every checker is total on text: this is a bad task
        raise UsageError(f"instruction {iid!r} cannot use kwargs {kw}: {type(e).__name__}: {e}") from None


def _clean_kwargs(instruction_ids, kwargs_list, prompt):
    """Drop None values (HF rows carry every kwarg name); repeat_prompt falls back to the prompt."""
    if kwargs_list is None:
        kwargs_list = [{} for _ in instruction_ids]
    if len(kwargs_list) != len(instruction_ids):
        raise UsageError(f"{len(instruction_ids)} instruction ids but {len(kwargs_list)} kwargs dicts")
    out = []
    for iid, kw in zip(instruction_ids, kwargs_list):
        if iid not in CHECKERS:
            raise UsageError(f"unknown instruction id {iid!r}")
        if kw is not None and not isinstance(kw, dict):
            raise UsageError(f"kwargs of {iid!r} must be a dict, got {type(kw).__name__}")
        kw = {k: v for k, v in (kw or {}).items() if v is not None}
        if prompt is not None and "prompt_to_repeat" not in kw and iid.startswith(("combination:repeat", "repeat:")):
            kw["prompt_to_repeat"] = prompt
        out.append(kw)
    return out


def check_instructions(response, instruction_ids, kwargs_list, prompt=None) -> dict:
    """Check `response` against IFEval/IFBench instructions.

    Returns {"strict": [bool per instruction], "loose": [...], "prompt_strict": bool, "prompt_loose": bool}.
    Loose (IFEval): an instruction also counts as followed if the response passes with its first line,
    last line or both removed, and/or with every '*' deleted. Unknown ids or unusable kwargs raise UsageError."""
    kwargs_list = _clean_kwargs(instruction_ids, kwargs_list, prompt)
    text = _answer(response)
    lines = text.split("\n")
    cut = [text, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    variants = cut + [v.replace("*", "") for v in cut]
    strict = [_check(i, text, kw) for i, kw in zip(instruction_ids, kwargs_list)]
    loose = [s or any(_check(i, v, kw) for v in variants[1:]) for s, i, kw in zip(strict, instruction_ids, kwargs_list)]
    return {"strict": strict, "loose": loose, "prompt_strict": all(strict), "prompt_loose": all(loose)}


# ----------------------------------------------------------------------------- the tiny writing world

SYSTEM = "Writing task: follow every rule."
THINGS = ("lantern fair", "river market", "glass tower", "salt road", "bell garden", "stone bridge",
          "night bazaar", "old mill", "sky harbor", "tea house")
ADJS = ("bright", "old", "quiet", "busy", "small", "warm", "famous", "calm")
NOUNS = ("lamps", "boats", "stalls", "bells", "gates", "songs", "kites", "flags")
SEASONS = ("spring", "summer", "autumn", "winter")
TEMPLATES = ("People come to see the {n1} and the {n2}.", "At night, the {n1} shine softly.",
             "It is {a2} in {s}.", "Many visitors say the {n1} are the best part.")
KEYWORDS = ("moss", "copper", "honey", "silver", "rain", "amber", "cedar", "pearl", "thunder", "velvet")
END_PHRASES = ("Any other questions?", "Is there anything else I can help with?", "That is all.", "See you there.")
LETTER_WORDS = {"b": ("bold", "blue", "brave"), "g": ("glad", "grand", "gentle"), "p": ("proud", "pale", "plain"),
                "d": ("deep", "dark", "dusty")}
# Made-up place names, split once into disjoint pools so test/ood topics are never seen in training.
_NAMES = [(a + b).capitalize() for a in ("or", "tam", "lin", "dor", "sar", "ul", "fen", "bra", "gol", "ves", "kel",
                                         "mar", "ton", "pel", "rin", "hal")
          for b in ("vel", "ka", "mi", "ti", "nes", "ra", "dun", "wen", "lo", "bar", "mos", "sa")]
random.Random("if-places").shuffle(_NAMES)
PLACES = {"ood": _NAMES[:20], "test": _NAMES[20:40], "val": _NAMES[40:60], "train": _NAMES[60:]}
TRAIN_TYPES = ("change_case:english_lowercase", "change_case:english_capital", "punctuation:no_comma",
               "keywords:existence", "startend:end_checker", "startend:quotation", "detectable_format:title",
               "detectable_format:number_bullet_lists", "length_constraints:number_words")
OOD_TYPES = ("detectable_format:json_format", "length_constraints:number_paragraphs", "detectable_content:postscript",
             "change_case:capital_word_frequency", "detectable_format:number_highlighted_sections",
             "arena:exclamation", "arena:letter_words")


def _draw_kwargs(iid, rng):
    if iid == "keywords:existence":
        return {"keywords": [rng.choice(KEYWORDS)]}
    if iid == "startend:end_checker":
        return {"end_phrase": rng.choice(END_PHRASES)}
    if iid == "detectable_format:number_bullet_lists":
        return {"num_bullets": rng.randint(2, 3)}
    if iid == "length_constraints:number_words":
        return rng.choice([{"relation": "less than", "num_words": rng.randint(10, 15)},
                           {"relation": "at least", "num_words": rng.randint(15, 22)}])
    if iid == "length_constraints:number_paragraphs":
        return {"num_paragraphs": rng.randint(2, 3)}
    if iid == "detectable_content:postscript":
        return {"postscript_marker": "P.S."}
    if iid == "change_case:capital_word_frequency":
        return {"capital_frequency": rng.randint(2, 3), "capital_relation": "at least"}
    if iid == "detectable_format:number_highlighted_sections":
        return {"num_highlights": rng.randint(1, 2)}
    if iid == "arena:letter_words":
        return {"letter": rng.choice(sorted(LETTER_WORDS)), "N": rng.randint(2, 3)}
    return {}


def _describe(iid, k):
    """The instruction as the prompt states it: IFEval's wording, first sentence only (tokens are the cost)."""
    return {
        "change_case:english_lowercase": "Your entire response should be in English, and in all lowercase letters.",
        "change_case:english_capital": "Your entire response should be in English, and in all capital letters.",
        "punctuation:no_comma": "In your entire response, refrain from the use of any commas.",
        "keywords:existence": f"Include keywords {', '.join(k.get('keywords', []))} in the response.",
        "startend:end_checker": f"Finish your response with this exact phrase {k.get('end_phrase')}.",
        "startend:quotation": "Wrap your entire response with double quotation marks.",
        "detectable_format:title": "Your answer must contain a title, wrapped in double angular brackets.",
        "detectable_format:number_bullet_lists": f"Your answer must contain exactly {k.get('num_bullets')} bullet "
                                                 "points. Use the markdown bullet points such as: * This is a point.",
        "length_constraints:number_words": f"Answer with {k.get('relation')} {k.get('num_words')} words.",
        "detectable_format:json_format": "Entire output should be wrapped in JSON format.",
        "length_constraints:number_paragraphs": f"There should be {k.get('num_paragraphs')} paragraphs. "
                                                "Paragraphs are separated with the markdown divider: ***",
        "detectable_content:postscript": "At the end of your response, please explicitly add a postscript "
                                         f"starting with {k.get('postscript_marker')}",
        "change_case:capital_word_frequency": "In your response, words with all capital letters should appear "
                                              f"{k.get('capital_relation')} {k.get('capital_frequency')} times.",
        "detectable_format:number_highlighted_sections": f"Highlight at least {k.get('num_highlights')} sections in "
                                                         "your answer with markdown, i.e. *highlighted section*.",
        "arena:exclamation": "End every sentence with an exclamation mark.",
        "arena:letter_words": f"Use at least {k.get('N')} different words that start with the letter {k.get('letter')}.",
    }[iid]


def _respond(thing, place, ids, kwargs, rng, tries=30):
    """A template answer that follows every instruction, or None.

    Sentences come from a tiny grammar; each instruction is a text transform applied in a fixed order
    (words, then layout, then case, then wrapping). The result is verified with the real checkers, and
    a few random sentence counts are tried, which also settles word-count bounds."""
    k = dict(zip(ids, kwargs))
    for _ in range(tries):
        n = k.get("detectable_format:number_bullet_lists", k.get("length_constraints:number_paragraphs", {}))
        n = n.get("num_bullets", n.get("num_paragraphs")) or rng.randint(1, 3)
        a, a2 = rng.sample(ADJS, 2)
        n1, n2 = rng.sample(NOUNS, 2)
        sents = [f"The {thing} of {place} is {a}."] + [t.format(n1=n1, n2=n2, a2=a2, s=rng.choice(SEASONS))
                                                         for t in rng.sample(TEMPLATES, n - 1)]
        if "keywords:existence" in k:
            sents[-1] = sents[-1][:-1] + f" near the {k['keywords:existence']['keywords'][0]}."
        if "arena:letter_words" in k:
            words = LETTER_WORDS[k["arena:letter_words"]["letter"]][:k["arena:letter_words"]["N"]]
            sents[0] = sents[0][:-1] + ", " + ", ".join(words[:-1]) + f" and {words[-1]}."
        if "arena:exclamation" in k:
            sents = [s[:-1] + "!" for s in sents]
        if "punctuation:no_comma" in k:
            sents = [s.replace(",", "") for s in sents]
        if "detectable_format:number_highlighted_sections" in k:
            h = k["detectable_format:number_highlighted_sections"]["num_highlights"]
            sents = [f"*{s}*" if i < h else s for i, s in enumerate(sents)]
        if "detectable_format:number_bullet_lists" in k:
            text = "\n".join("* " + s for s in sents)
        elif "length_constraints:number_paragraphs" in k:
            text = "\n***\n".join(sents)
        else:
            text = " ".join(sents)
        if "detectable_format:title" in k:
            text = f"<<The {thing.title()}>>\n" + text
        if "detectable_content:postscript" in k:
            text += "\nP.S. Come and see it."
        if "startend:end_checker" in k:
            text += " " + k["startend:end_checker"]["end_phrase"]
        if "change_case:english_lowercase" in k:
            text = text.lower()
        if "change_case:english_capital" in k:
            text = text.upper()
        if "change_case:capital_word_frequency" in k:
            cap = k["change_case:capital_word_frequency"]["capital_frequency"]
            text = re.sub(r"\w+", lambda m: m.group(0).upper(), text, count=cap)
        if "startend:quotation" in k:
            text = f'"{text}"'
        if "detectable_format:json_format" in k:
            text = json.dumps({"answer": text})
        result = [_check(i, text, kw) for i, kw in zip(ids, kwargs)]
        if all(result):
            return text
    return None


def _generate(split, n, rng):
    """n tasks of a split: a topic from the split's own places, 1-3 instructions of the split's types."""
    types, tasks = OOD_TYPES if split == "ood" else TRAIN_TYPES, []
    while len(tasks) < n:
        thing, place = rng.choice(THINGS), rng.choice(PLACES[split])
        ids = rng.sample(types, rng.choice((1, 1, 2, 2, 3)))
        kwargs = [_draw_kwargs(i, rng) for i in ids]
        reference = _respond(thing, place, ids, kwargs, rng)
        if reference is None:  # an impossible combination (lowercase + capital, ...): draw another
            continue
        prompt = f"Write about the {thing} of {place}. " + " ".join(_describe(i, k) for i, k in zip(ids, kwargs))
        tasks.append(Task(id="", env="if", split=split,
                          messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                          gold={"instruction_id_list": ids, "kwargs": kwargs, "prompt": prompt,
                                "reference": reference, "topic": [thing, place]}))
    return tasks


def _tiny_tasks(split, n, seed):
    """The tiny arena's tasks of a split, generated once per process and kept on disk per (split, n, seed, this
    file's source): building 5,000 train tasks takes ~50 s, nearly all of it langdetect verifying each reference
    answer, and every training script used to pay it at start (twice). The cache lives in $ACLARENA_CACHE (default
    ~/.cache/aclarena); a file that cannot be read is regenerated, and one that cannot be written is skipped."""
    key = (split, n, seed)
    if key not in _TASKS:
        import hashlib
        root = cache_dir()
        source = hashlib.sha256(open(__file__, "rb").read()).hexdigest()[:12]
        path = os.path.join(root, f"if-tasks-{split}-{n}-{seed}-{source}.json")
        try:
            with open(path) as f:
                tasks = [Task(**t) for t in json.load(f)]
        except (OSError, ValueError, TypeError):
            tasks = _generate(split, n, random.Random(f"if:{split}:{seed}"))
            for i, t in enumerate(tasks):
                t.id = f"if-{split}-{seed}-{i}"
            def write(tmp):
                with open(tmp, "w") as f:
                    json.dump([t.__dict__ for t in tasks], f)
            try:   # a cache: a failed write (a full disk, a kill) costs the next run a regeneration, never a leftover
                write_file_atomically(path, write)
            except OSError:
                pass
        _TASKS[key] = tasks
    return _TASKS[key]


_TASKS = {}


# ----------------------------------------------------------------------------- the base's reading (IFEnv.knowledge)

ALL_TYPES = TRAIN_TYPES + OOD_TYPES
PAIR_HEADS = (("Instruction:", "Response:"), ("Instruction:", "Output:"), ("Task:", "Answer:"),
              ("### Instruction:", "### Response:"))
PAIR_PREAMBLE = ("Below is an instruction that describes a task. "
                 "Write a response that appropriately completes the request.")
REQUESTS = ("Write about the {thing} of {place}.",) * 3 + (
    "Describe the {thing} of {place}.", "Write a short text about the {thing} of {place}.",
    "Tell me about the {thing} of {place}.")
SAMPLE_NOUNS = ("a note", "a short text", "a description", "a short piece", "a short passage")
SAMPLE_INTROS = ("{noun} about the {thing} of {place}, {props}:",
                 "Here is {noun} about the {thing} of {place}, {props}.",
                 "Example of {noun} {props}. Topic: the {thing} of {place}.",
                 "The following is {noun} on the {thing} of {place}, {props}.")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five")
RELATION_WORDS = {"less than": ("fewer than", "under"), "at least": ("at least", "no fewer than")}
PHRASES = {  # each type's property in other words than _describe's, as a phrase after a noun ("a note ...")
    "change_case:english_lowercase": ("written entirely in lowercase letters", "with no capital letters at all",
                                      "in lowercase English from start to end"),
    "change_case:english_capital": ("written in all capital letters", "in block capitals from start to end",
                                    "with every letter in upper case"),
    "punctuation:no_comma": ("without a single comma", "written with no commas", "that uses no commas at all"),
    "keywords:existence": ('that mentions the word "{kw}"', "that includes the keyword {kw}", "using the word {kw}"),
    "startend:end_checker": ('that ends with the exact phrase "{end}"', 'whose last words are "{end}"',
                             'closing with the words "{end}"'),
    "startend:quotation": ("wrapped in double quotation marks", "enclosed in double quotes from start to end",
                           "set entirely inside quotation marks"),
    "detectable_format:title": ("with a title in double angular brackets", "with its title written between << and >>",
                                "under a title like <<Title>>"),
    "detectable_format:number_bullet_lists": ("written as exactly {n} bullet points", "made of {n} markdown bullets, "
                                              "each starting with *", "as a list of {n} points marked with *"),
    "length_constraints:number_words": ("in {rel} {w} words", "with a length of {rel} {w} words",
                                        "{rel} {w} words long"),
    "detectable_format:json_format": ("wrapped in JSON format", "given as a JSON object", "written as JSON"),
    "length_constraints:number_paragraphs": ("in {n} paragraphs separated by the divider ***",
                                             "split into {n} paragraphs with *** between them",
                                             "with {n} paragraphs and a *** line between each two"),
    "detectable_content:postscript": ("with a postscript starting with {marker}",
                                      "that ends with a note starting with {marker}", "with a {marker} at the end"),
    "change_case:capital_word_frequency": ("with at least {n} words in all capital letters",
                                           "where {n} or more words are fully capitalized",
                                           "with {n} or more words written in CAPITALS"),
    "detectable_format:number_highlighted_sections": ("with at least {n} highlighted section{s}, marked *like this*",
                                                      "with {n} section{s} highlighted with asterisks",
                                                      "where {n} part{s} stand out in markdown italics"),
    "arena:exclamation": ("where every sentence ends with an exclamation mark", "with each sentence ending in !",
                          "written in exclamations only"),
    "arena:letter_words": ("using at least {n} different words that start with the letter {letter}",
                           'with {n} or more words beginning with "{letter}"'),
}
PROSE = ("The {thing} of {place} is {a}.", "Visitors to {place} often walk to the {thing}.",
         "In {s}, the {thing} is full of {n1}.", "Near the {thing} there are {n1} and {n2}.",
         "The people of {place} are proud of their {thing}.", "Every {s}, {place} holds a festival by the {thing}.",
         "Some say the {thing} is older than {place} itself.", "From the {thing}, you can see the {n1} of {place}.",
         "Old stories about the {thing} speak of {kw}.", "The {thing} is not far from the {thing2}.",
         "Most days the {thing} is {a}, but in {s} it is {a2}.", "Children in {place} like the {n1} best.")
PROSE_FORMS = ("{text}", "{Thing} of {place}\n\n{text}", "{place}\n{text}", "Dear friend,\n{text}\nSee you soon.",
               "What is the {thing} of {place} like? {text}")


def _follows(rng, sizes):
    """A train-place topic, instructions of every type (train and held-out alike, len drawn from `sizes`), their
    kwargs and a _respond answer, which the real checkers verified; impossible combinations are drawn again."""
    while True:
        thing, place = rng.choice(THINGS), rng.choice(PLACES["train"])
        ids = rng.sample(ALL_TYPES, rng.choice(sizes))
        kwargs = [_draw_kwargs(i, rng) for i in ids]
        text = _respond(thing, place, ids, kwargs, rng)
        if text is not None:
            return thing, place, ids, kwargs, text


def _phrase(iid, k, rng):
    """One of PHRASES' wordings of an instruction, its kwargs filled in."""
    n = next((k[c] for c in ("num_bullets", "num_paragraphs", "num_highlights", "capital_frequency", "N") if c in k), 0)
    return rng.choice(PHRASES[iid]).format(
        kw=k.get("keywords", [""])[0], end=k.get("end_phrase"), n=NUMBER_WORDS[n], s="" if n == 1 else "s",
        rel=rng.choice(RELATION_WORDS.get(k.get("relation"), ("",))), w=k.get("num_words"),
        letter=k.get("letter"), marker=k.get("postscript_marker"))


def _prose(rng):
    """A few sentences about a thing of a train place, in one of PROSE_FORMS (a paragraph, an entry, a letter...)."""
    thing, place = rng.choice(THINGS), rng.choice(PLACES["train"])
    a, a2 = rng.sample(ADJS, 2)
    n1, n2 = rng.sample(NOUNS, 2)
    words = dict(thing=thing, Thing=f"The {thing.title()}", place=place, a=a, a2=a2, n1=n1, n2=n2,
                 s=rng.choice(SEASONS), kw=rng.choice(KEYWORDS), thing2=rng.choice([t for t in THINGS if t != thing]))
    sents = [PROSE[0]] + rng.sample(PROSE[1:] + TEMPLATES, rng.randint(2, 5))
    text = " ".join(s.format(**words) for s in sents)
    return rng.choice(PROSE_FORMS).format(text=text, **words)


def _knowledge(n, seed):
    """IFEnv.knowledge's documents with what they show: [{"kind", "doc", "ids", "kwargs", "text"}], where `text`
    is the answer inside `doc` that follows every instruction of `ids` (kinds "pair" and "sample"; prose has none)."""
    rng, out = random.Random(f"if-knowledge:{seed}"), []
    for _ in range(n):
        kind = rng.choice(("pair", "sample", "prose"))
        if kind == "prose":
            out.append({"kind": kind, "doc": _prose(rng), "ids": [], "kwargs": [], "text": None})
            continue
        thing, place, ids, kwargs, text = _follows(rng, (1, 1, 2, 2, 3) if kind == "pair" else (1, 1, 1, 2))
        if kind == "pair":
            head, tail = rng.choice(PAIR_HEADS)
            request = rng.choice(REQUESTS).format(thing=thing, place=place)
            doc = f"{head} {request} " + " ".join(_describe(i, k) for i, k in zip(ids, kwargs))
            doc += f"\n{tail}" + rng.choice((" ", "\n")) + text
            if rng.random() < 0.2:
                doc = PAIR_PREAMBLE + "\n\n" + doc
        else:
            props = " and ".join(_phrase(i, k, rng) for i, k in zip(ids, kwargs))
            intro = rng.choice(SAMPLE_INTROS).format(noun=rng.choice(SAMPLE_NOUNS), thing=thing, place=place,
                                                     props=props)
            doc = intro[0].upper() + intro[1:] + "\n" + text
        out.append({"kind": kind, "doc": doc, "ids": ids, "kwargs": kwargs, "text": text})
    return out


# ----------------------------------------------------------------------------- the environment

class IFEnv(Env):
    """Instruction following: one answer per prompt, scored by IFEval/IFBench checkers.

    data: None for the tiny arena; else an HF dataset id or a local .jsonl/.json/.parquet file (or folder)
    with IFEval-format rows (prompt, instruction_id_list, kwargs), used by tasks() as training prompts.
    skip_unknown: drop rows whose instruction ids have no checker (with a printed count) instead of failing."""
    domain = "if"
    max_turns = 1

    def __init__(self, data=None, skip_unknown=False):
        self.data, self.skip_unknown = data, skip_unknown

    def tasks(self, split, n=None, seed=0):
        if split not in SPLITS:
            raise UsageError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        if self.data is not None:
            tasks = self._load(self.data, split, name=split)
            random.Random(seed).shuffle(tasks)
            return tasks[:n]
        n = (5000 if split == "train" else 300) if n is None else n
        return list(_tiny_tasks(split, n, seed))

    def benchmark(self, name, source=None, n=None):
        """Evaluation prompts: 'ifeval' (google/IFEval) or 'ifbench' (allenai/IFBench_test), or a local copy."""
        if name not in BENCHMARKS:
            raise UsageError(f"unknown benchmark {name!r}; expected one of {', '.join(BENCHMARKS)}")
        return self._load(source or BENCHMARK_SOURCES[name], "train", name)[:n]

    def _load(self, source, split, name):
        rows = load_rows(source, split)
        tasks, unknown, dropped = [], set(), 0
        for i, row in enumerate(rows):
            if not all(c in row for c in ("prompt", "instruction_id_list", "kwargs")):
                raise UsageError(f"{source}: row {i} lacks prompt/instruction_id_list/kwargs")
            missing = [iid for iid in row["instruction_id_list"] if iid not in CHECKERS]
            if missing:
                unknown.update(missing)
                dropped += 1
                continue
            key = row.get("key", i)
            try:  # probe once so a bad kwarg fails here, at load time, not in the middle of training
                check_instructions("Probe text.", row["instruction_id_list"], row["kwargs"], row["prompt"])
            except UsageError as e:
                raise UsageError(f"{source}: row {key}: {e}") from None
            tasks.append(Task(id=f"if-{name}-{key}", env="if", split=name,
                              messages=[{"role": "user", "content": row["prompt"]}],
                              gold={"instruction_id_list": list(row["instruction_id_list"]),
                                    "kwargs": list(row["kwargs"]), "prompt": row["prompt"]}))
        if unknown and not self.skip_unknown:
            raise UsageError(f"{source}: {dropped} rows use instruction ids without a checker: "
                           f"{', '.join(sorted(unknown))} (pass skip_unknown=True to drop them)")
        if dropped:
            print(f"[if] {source}: dropped {dropped} rows with unimplemented ids ({', '.join(sorted(unknown))})")
        return tasks

    def step(self, state, text):
        state.messages.append({"role": "assistant", "content": text if isinstance(text, str) else ""})
        state.turns += 1
        state.done = True  # single turn: the answer is the episode
        return []

    def score(self, state):
        g = state.task.gold
        answers = [m["content"] for m in state.messages if m.get("role") == "assistant"]
        response = "" if state.truncated or not answers else answers[-1]
        r = check_instructions(response, g["instruction_id_list"], g["kwargs"], g.get("prompt"))
        total = float(len(r["strict"]))
        metrics = {"prompt_strict": float(r["prompt_strict"]), "prompt_loose": float(r["prompt_loose"]),
                   "inst_strict": sum(r["strict"]) / max(total, 1.0), "inst_loose": sum(r["loose"]) / max(total, 1.0),
                   "inst_total": total, "inst_followed_strict": float(sum(r["strict"])),
                   "inst_followed_loose": float(sum(r["loose"])), "truncated": float(state.truncated)}
        return metrics["prompt_strict"], metrics

    def compliant(self, state):
        """One non-empty reply and no tool call (this domain has no tools)."""
        replies = [m.get("content") or "" for m in state.messages if m.get("role") == "assistant"]
        return not state.truncated and len(replies) == 1 and bool(replies[0].strip()) and "<tool_call>" not in replies[0]

    def expert(self, task):
        return [task.gold["reference"]] if task.gold.get("reference") else None

    def knowledge(self, n: int, seed: int = 0) -> list:
        """Writing of many kinds, never a chat turn, about the train places only, for 1-3 instructions of every type
        (TRAIN_TYPES and the held-out OOD_TYPES: a real base has read all caps, titles, JSON and postscripts):
        - instruction pairs (1 document in 3): "Instruction: <a request> <_describe's wordings>\\nResponse: <answer>";
        - described samples (1 in 3): a line naming the property in other words (PHRASES), then the text;
        - prose (1 in 3): sentences about a thing and its place (PROSE, TEMPLATES), as a paragraph, an entry, a letter.
        Every answer shown is a _respond answer, verified by the real checkers."""
        return [d["doc"] for d in _knowledge(n, seed)]

