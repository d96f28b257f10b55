"""venv.sh, the set-up that arena.sh and test.sh source: it installs into the project's own environment when the
stamp (requirement files, torch pin, Python version) differs, not when it matches, and a failed install leaves no
stamp. A fake interpreter stands in for the environment's Python, so nothing is downloaded."""
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = """#!/usr/bin/env bash
if [ "$1" = -c ]; then echo "3.11.7 (fake)"; exit 0; fi
echo "$@" >> "$(dirname "$0")/../calls.log"
exit ${FAKE_PIP_RC:-0}
"""


def setup(tmp_path, rc=0):
    """Source a copy of venv.sh beside a copy of requirements.txt with the fake environment; -> (exit code, output,
    the pip calls made)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").write_text(FAKE)
    os.chmod(venv / "bin" / "python", 0o755)
    (venv / "calls.log").unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "ACL_PYTHON"}   # (the tests may run under ACL_PYTHON=...)
    r = subprocess.run(["bash", "-c", f"source {tmp_path}/venv.sh && echo READY $(command -v python)"],
                       env=dict(env, ACL_VENV=str(venv), FAKE_PIP_RC=str(rc)), capture_output=True, text=True,
                       timeout=60)
    calls = (venv / "calls.log").read_text().splitlines() if (venv / "calls.log").exists() else []
    return r.returncode, r.stdout + r.stderr, calls


def test_the_stamp_decides_whether_to_install(tmp_path):
    for f in ("venv.sh", "requirements.txt"):
        (tmp_path / f).write_text(open(os.path.join(ROOT, f)).read())
    rc, out, calls = setup(tmp_path)                       # first time: torch pinned first, then the requirements
    assert rc == 0 and f"READY {tmp_path}/venv/bin/python" in out, out
    assert calls == ["-m pip install --quiet torch==2.13.0", f"-m pip install --quiet -r {tmp_path}/requirements.txt"]
    t0 = time.time()
    rc, out, calls = setup(tmp_path)                       # the stamp matches: nothing installed, nothing said
    assert rc == 0 and calls == [] and out.strip() == f"READY {tmp_path}/venv/bin/python" and time.time() - t0 < 5
    with open(tmp_path / "requirements.txt", "a") as f:   # a changed requirement file: installed again
        f.write("tqdm>=4.67\n")
    rc, out, calls = setup(tmp_path)
    assert rc == 0 and len(calls) == 2
    with open(tmp_path / "requirements.txt", "a") as f:
        f.write("somethingelse\n")
    rc, out, calls = setup(tmp_path, rc=1)                 # a failed install: one line, exit 1, no stamp
    assert rc == 1 and "READY" not in out and out.strip().count("\n") == 1 and "the install into" in out, out
    assert not (tmp_path / "venv" / ".acl-stamp").exists()
    rc, out, calls = setup(tmp_path)                       # so the next call tries again
    assert rc == 0 and len(calls) == 2


def test_acl_python_uses_an_environment_as_it_is(tmp_path):
    import sys
    r = subprocess.run(["bash", "-c", f"source {ROOT}/venv.sh && python -c 'import sys; print(sys.prefix)'"],
                       env=dict(os.environ, ACL_PYTHON=sys.executable), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == sys.prefix and not os.path.exists(tmp_path / ".venv"), r.stderr
    r = subprocess.run(["bash", "-c", f"source {ROOT}/venv.sh"], env=dict(os.environ, ACL_PYTHON=str(tmp_path / "no")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not an executable Python" in r.stderr
