#!/usr/bin/env bash
# The GPU check on a GPU machine, from the repository root: install the carried wheels
# (.kvframe-gpu-wheels/<group>/, made by tests/gpu/prepare_carry.py) and kvframe with its two
# plugins from this working tree, each into a site folder of its own under $KVFRAME_GPU_SITE,
# then run tests/gpu/gpu_check.py with the arguments given. Needs no network. The JSON report
# is also written to $OUT/gpu_check.json ($OUT: the device tool's folder; /tmp elsewhere).
#
#   bash tests/gpu/run.sh            # the GPU check
#   bash tests/gpu/run.sh --dry-run  # the same steps on host memory
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${KVFRAME_GPU_WHEELS:-.kvframe-gpu-wheels}
export KVFRAME_GPU_SITE=${KVFRAME_GPU_SITE:-/tmp/kvframe-gpu-site}
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile
     --no-cache-dir --upgrade)

install_group() {
    local group=$1 wheels
    shopt -s nullglob
    wheels=("$WHEELS/$group"/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "run.sh: $WHEELS/$group holds no wheels (not carried); the check says what is missing" >&2
        return 0
    fi
    local py=() libs=() w
    for w in "${wheels[@]}"; do
        # nvidia-* wheels hold shared libraries only: kept off PYTHONPATH, so that they can
        # never stand in front of the image's own nvidia packages (torch's CUDA libraries).
        case "$(basename "$w")" in nvidia_*) libs+=("$w") ;; *) py+=("$w") ;; esac
    done
    echo "run.sh: installing ${#wheels[@]} wheel(s) of $group under $KVFRAME_GPU_SITE" >&2
    if [ ${#py[@]} -gt 0 ]; then
        "${PIP[@]}" --target "$KVFRAME_GPU_SITE/$group" "${py[@]}" \
            || echo "run.sh: installing $group failed" >&2
    fi
    if [ ${#libs[@]} -gt 0 ]; then
        "${PIP[@]}" --target "$KVFRAME_GPU_SITE/libs" "${libs[@]}" \
            || echo "run.sh: installing the libraries of $group failed" >&2
    fi
}

t0=$SECONDS
for group in common nixl ucx; do install_group "$group"; done
# kvframe and the plugins, built here from the working tree (their entry points included).
"${PIP[@]}" --no-build-isolation --target "$KVFRAME_GPU_SITE/common" \
    . plugins/kvframe-nixl plugins/kvframe-ucx \
    || echo "run.sh: installing kvframe from the working tree failed" >&2
# The CUDA 12 runtime carried beside nixl-cu12: UCX's CUDA memory hooks link libcudart.so.12.
cudart="$KVFRAME_GPU_SITE/libs/nvidia/cuda_runtime/lib"
if [ -d "$cudart" ]; then export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
echo "run.sh: installed in $((SECONDS - t0)) s" >&2
export PYTHONUNBUFFERED=1
exec "$PY" tests/gpu/gpu_check.py --out "${OUT:-/tmp}/gpu_check.json" "$@"
