"""The house's layer rule, read off the import graph (every import, function-level ones too): three floors with
arrows only downward (scripts at the root -> the acl/ library -> envs/), a script imports another script only where
it composes that method, and there is no import circle anywhere."""
import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the script -> script arrows allowed: a method run inside another (mle.py trains its experts with train_seq.py's
# GRPO loop and, --continual, refreshes its backbone with sdft.py's SFT; train_seq.py evaluates after each stage and
# merge.py scores its candidates with evaluate.py)
COMPOSES = {"mle": {"train_seq", "sdft"}, "train_seq": {"evaluate"}, "merge": {"evaluate"}}


def graph(root: str) -> dict:
    """{module: {project modules it imports}} for the root's scripts, acl/ and envs/ (names as 'acl.step')."""
    paths = glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "acl", "*.py")) + \
        glob.glob(os.path.join(root, "envs", "*.py"))
    names = {os.path.relpath(p, root)[:-3].replace(os.sep, ".").removesuffix(".__init__"): p for p in paths}
    out = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                mods = [n.name for n in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module] + [f"{node.module}.{n.name}" for n in node.names]
            else:
                continue
            found |= {m for m in mods if m in names}
        out[name] = found - {name, "envs", "acl"} if name not in ("envs", "acl") else found - {name}
    return out


def floor(name: str) -> int:
    return 0 if name.split(".")[0] == "envs" else 1 if name.split(".")[0] == "acl" else 2


def violations(g: dict) -> list:
    bad = []
    for a, targets in g.items():
        for b in targets:
            if floor(b) > floor(a):
                bad.append(f"{a} imports {b}: an upward arrow")
            elif floor(a) == floor(b) == 2 and b not in COMPOSES.get(a, set()):
                bad.append(f"{a} imports the script {b}, which it does not compose")
    # a circle: a strongly connected component of more than one module (Tarjan's, iteratively small enough)
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return bad + [f"an import circle: {' <-> '.join(c)}" for c in comps]


def test_the_house_has_three_floors_arrows_downward_and_no_circle():
    assert violations(graph(ROOT)) == []


def test_the_rule_sees_an_upward_arrow_a_stray_script_import_and_a_circle(tmp_path):
    for d, files in {"envs": {"__init__": "", "base": "", "math": "from acl.common import x\n"},
                     "acl": {"__init__": "", "common": "import envs.base\n", "step": "import acl.engine\n",
                             "engine": "from acl import step\n"},
                     ".": {"report": "import mmopd\n", "mmopd": "import acl.step\n", "mle": "import train_seq\n",
                           "train_seq": ""}}.items():
        os.makedirs(tmp_path / d, exist_ok=True)
        for name, text in files.items():
            (tmp_path / d / f"{name}.py").write_text(text)
    assert sorted(violations(graph(str(tmp_path)))) == [
        "an import circle: acl.engine <-> acl.step", "envs.math imports acl.common: an upward arrow",
        "report imports the script mmopd, which it does not compose"]
