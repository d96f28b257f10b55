#!/usr/bin/env bash
# The wheels that a lent GPU machine's image lacks, into .whl/ (ignored by git) for the device tool to carry: that
# image has torch, transformers, peft, accelerate, pytest and hypothesis but not bm25s and langdetect (imported by
# envs/search.py and envs/instruct.py: every search and IF rollout, the GPU tier's kept-cache checks), math-verify or
# datasets, and it reaches no package registry. Run it here (it needs one), then carry .whl; gpu_check.sh installs
# what it finds there first (checked on this CPU with the image's versions: docs/LOG.md, 2026-12-07 fifth session).
#   bash bench/gpu_wheels.sh                                       # -> .whl/*.whl (about 2.3 MB)
#   WHL=DIR bash bench/gpu_wheels.sh                               # -> DIR/*.whl (the tests)
#   device run: command "bash bench/gpu_check.sh", carry [".whl"]
# The pins are requirements.txt's (bm25s, math-verify, datasets, langdetect) and those of their own needs that the
# image lacks, as in .venv; every wheel is pure Python for the image's CPython 3.12 (langdetect has no wheel on the
# index: pip builds its pure-Python one from the sdist). Other needs (numpy, scipy, sympy, six, pyarrow, pandas, ...)
# are the image's own. pip skips a wheel already there; two versions of one in .whl stop the script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pin() { grep -E "^$1==" requirements.txt | head -n 1; }
WANT=("$(pin bm25s)" "$(pin math-verify)" "$(pin datasets)" latex2sympy2_extended==1.11.0
      antlr4-python3-runtime==4.13.2 dill==0.4.1 multiprocess==0.70.19)
for w in "${WANT[@]}"; do [[ "$w" == *==* ]] || { echo "gpu_wheels.sh: a pin is missing from requirements.txt" >&2; exit 2; }; done
WHL=${WHL:-.whl}
mkdir -p "$WHL"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHL" "${WANT[@]}"
"$PY" -m pip wheel --quiet --no-deps -w "$WHL" "$(pin langdetect)"
twice=$(ls "$WHL"/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
[ -z "$twice" ] || { echo "gpu_wheels.sh: two versions of $twice in $WHL (the device's install stops on that): keep the pinned one" >&2; exit 2; }
ls -1 "$WHL"
du -sh "$WHL"
