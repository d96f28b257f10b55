#!/usr/bin/env bash
# The tests, in the project's own environment (venv.sh creates .venv/ the first time, ~1 min; ACL_PYTHON=... uses
# another as it is):
#   bash test.sh                        # the tests
#   bash test.sh tests/test_report.py   # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")"
source ./venv.sh
exec python -m pytest -q "$@"
