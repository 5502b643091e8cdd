# Sourced by benchmarks/gpu_check.sh and gpu_modes.sh, from the tree's root. The lent machine runs the tree
# uninstalled: the tree and the carried wheels (.whl/, from benchmarks/gpu_wheels.sh), installed into a folder
# of their own, go on PYTHONPATH.
#   use_carried_wheels SITE LOG    returns 1 when the install failed (pip's output is in LOG)
use_carried_wheels() {
    local site=$1 log=$2
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
    compgen -G ".whl/*.whl" > /dev/null || return 0
    python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" .whl/*.whl >> "$log" 2>&1
}
