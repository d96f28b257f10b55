# The project's own Python, sourced by arena.sh and test.sh (never run alone): creates or reuses .venv/ (torch pinned to
# the CPU build first, then requirements.txt, the order CI uses) and puts it first on the PATH, so `python` and
# `torchrun` below are the project's. A stamp (a hash of the requirement files, the torch pin and the Python version)
# decides whether to install: a second call costs well under a second and prints nothing; a changed requirement file
# reinstalls; a failed install stops with one line and leaves no stamp.
#   ACL_PYTHON=/path/to/python   use that environment as it is (a cluster's modules or conda; setup_gpu.sh builds one)
#   ACL_VENV=DIR                 where the virtual environment lives (default .venv beside this file)
#   ACL_VENV=0                   the `python` on the PATH as it is (arena.sh's default at full scale: setup_gpu.sh's)
ACL_TORCH=${ACL_TORCH:-torch==2.13.0}   # the CPU build here (an unpinned torch pulls the multi-GB CUDA build)
acl_root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -n "${ACL_PYTHON:-}" ]; then
    [ -x "$ACL_PYTHON" ] || { echo "ACL_PYTHON=$ACL_PYTHON: not an executable Python" >&2; exit 2; }
    acl_bin=$(mktemp -d)   # `python` and `torchrun` of that environment first on the PATH, as scripts that exec it
    # by its own path (a symlink elsewhere would lose a virtual environment: Python finds it beside its executable)
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$ACL_PYTHON" > "$acl_bin/python"
    printf '#!/bin/sh\nexec "%s" -m torch.distributed.run "$@"\n' "$ACL_PYTHON" > "$acl_bin/torchrun"
    chmod +x "$acl_bin/python" "$acl_bin/torchrun"
    export PATH="$acl_bin:$PATH"
elif [ "${ACL_VENV:-}" != 0 ]; then
    acl_venv=${ACL_VENV:-$acl_root/.venv}
    if [ ! -x "$acl_venv/bin/python" ]; then
        python3 -m venv "$acl_venv" || { echo "could not create the virtual environment $acl_venv (python3 -m venv)" >&2; exit 1; }
    fi
    acl_want=$( { echo "$ACL_TORCH"; "$acl_venv/bin/python" -c 'import sys; print(sys.version)';
                  cat "$acl_root/requirements.txt"; } | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$acl_venv/.acl-stamp" 2>/dev/null)" != "$acl_want" ]; then
        rm -f "$acl_venv/.acl-stamp"
        echo "setting up $acl_venv ($ACL_TORCH, then requirements.txt; once)"
        acl_log=$acl_venv/.acl-install.log
        if ! { "$acl_venv/bin/python" -m pip install --quiet "$ACL_TORCH" &&
               "$acl_venv/bin/python" -m pip install --quiet -r "$acl_root/requirements.txt"; } > "$acl_log" 2>&1; then
            echo "the install into $acl_venv failed: $(grep -m1 -E 'ERROR|error' "$acl_log" || tail -n 1 "$acl_log") (log: $acl_log)" >&2
            exit 1
        fi
        echo "$acl_want" > "$acl_venv/.acl-stamp"
    fi
    export PATH="$acl_venv/bin:$PATH"
fi
