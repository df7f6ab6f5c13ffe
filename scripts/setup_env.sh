# Sourced by scripts/test.sh and scripts/quickstart.sh: installs the package in place, every
# package at the version requirements/test-lock.txt pins (what CI and a fresh machine resolve
# alike; pyproject.toml keeps the compatible ranges for users who install it themselves).
# $1 names an optional extra ("test").
#
# An installed torch (a CUDA, ROCm or CPU build) is kept, and with it the Triton and CUDA
# libraries it brings: the lock then pins everything else. Without one, the lock's torch is
# installed (TORCH_SPEC overrides it, e.g. TORCH_SPEC=torch==2.11.0).
extra="${1:-}"
lock="$PWD/requirements/test-lock.txt"
constraints="$(mktemp "${TMPDIR:-/tmp}/megatron-dmoe-constraints.XXXXXX")"
lock_python="$(sed -n -E 's/.*Python ([0-9]+\.[0-9]+) .*/\1/p' "$lock" | head -1)"
this_python="$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$lock_python" != "$this_python" ]; then
    # Its pins may not exist for another Python (numpy 2.4 needs 3.11).
    echo "note: requirements/test-lock.txt pins versions for Python $lock_python; this is" \
        "Python $this_python: installing the newest that pyproject.toml's ranges allow instead"
    python -c "import torch" >/dev/null 2>&1 ||
        python -m pip install --quiet --no-compile "${TORCH_SPEC:-torch>=2.4}"
elif python -c "import torch" >/dev/null 2>&1; then
    echo "keeping the installed torch $(python -c 'import torch; print(torch.__version__)')" \
        "(the lock pins $(grep -E '^torch==' "$lock"))"
    grep -v -E '^(torch|triton|pytorch-triton-rocm|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==' \
        "$lock" > "$constraints"
elif [ -n "${TORCH_SPEC:-}" ]; then
    # Another torch than the lock's, with the Triton it brings.
    grep -v -E '^(torch|triton)==' "$lock" > "$constraints"
    python -m pip install --quiet --no-compile -c "$constraints" "$TORCH_SPEC"
else
    cp "$lock" "$constraints"
    python -m pip install --quiet --no-compile -c "$constraints" "$(grep -E '^torch==' "$lock")"
fi
# Also read by the isolated environment that builds the C++ helper (setuptools, pybind11).
export PIP_CONSTRAINT="$constraints"
# --no-compile: bytecode is written at first import for the modules a run imports; compiling
# every file of torch, transformers and lm-eval at install time costs about 45 s on 2 cores.
if [ -n "$extra" ]; then
    python -m pip install --quiet --no-compile -e ".[$extra]"
else
    python -m pip install --quiet --no-compile -e .
fi
unset PIP_CONSTRAINT
rm -f "$constraints"
