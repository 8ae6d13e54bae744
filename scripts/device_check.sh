#!/usr/bin/env bash
# The device check on a machine without network: installs the project and the wheels carried in a folder (transformers,
# datasets, fla-core, einops, ...) next to the preinstalled torch (>= 2.8), then runs scripts/device_check.py.
#
#   scripts/device_check.sh --wheels /path/to/wheels            # one CUDA GPU: the table, and device_check.json
#   scripts/device_check.sh --device cpu --quick                # every part end to end on a CPU (what CI runs)
#
# Every other option goes to scripts/device_check.py (--device, --quick, --out).
set -euo pipefail
cd "$(dirname "$0")/.."

wheels=""
forwarded=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --wheels) wheels="${2:?--wheels needs a folder}"; shift 2 ;;
        *) forwarded+=("$1"); shift ;;
    esac
done

if [[ -n "$wheels" ]]; then
    [[ -d "$wheels" ]] || { echo "device_check.sh: --wheels $wheels is not a folder" >&2; exit 2; }
    python -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 8))" \
        || { echo "device_check.sh: needs torch >= 2.8 preinstalled" >&2; exit 2; }
    python -m pip install -q --no-index --find-links "$wheels" -e ".[dev]"
    for optional in fla-core einops; do  # the GPU kernels, where the folder carries them
        python -m pip install -q --no-index --find-links "$wheels" "$optional" \
            || echo "device_check.sh: $optional is not in $wheels; that part runs without it"
    done
fi
exec python scripts/device_check.py "${forwarded[@]}"
