#!/usr/bin/env bash
# The tests, in the project's own environment (venv.sh creates .venv/ the first time, ~1 min; ACL_PYTHON=... uses
# another as it is). Two tiers (pyproject.toml's `slow` marker):
#   bash test.sh                        # the fast tier, every hour: each script end to end at micro size, every refusal
#   bash test.sh -m slow                # the slow tier: the QUICK arena killed and resumed, torchrun on 2 ranks,
#                                       # kill-and-resume of every trainer, the benches (CI runs both)
#   bash test.sh -m ""                  # both at once
#   bash test.sh tests/test_report.py   # any pytest arguments (the fast tier unless -m is given)
set -euo pipefail
cd "$(dirname "$0")"
source ./venv.sh
tier=(-m "not slow")
for arg in "$@"; do
    case "$arg" in -m|-m*) tier=();; esac
done
exec python -m pytest -q "${tier[@]}" "$@"
