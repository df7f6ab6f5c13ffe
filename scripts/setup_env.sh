# Sourced by scripts/test.sh and scripts/quickstart.sh: installs the package in place.
# $1 names an optional extra ("test"). An existing torch (CUDA, ROCm or CPU build) is kept;
# without one, TORCH_SPEC (default torch==2.13.0) is installed first, so pip does not pick
# an unpinned multi-GB build on its own.
extra="${1:-}"
if ! python -c "import torch" >/dev/null 2>&1; then
    python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
if [ -n "$extra" ]; then
    python -m pip install --quiet -e ".[$extra]"
else
    python -m pip install --quiet -e .
fi
