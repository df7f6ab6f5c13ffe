# Sourced by scripts/test.sh and scripts/quickstart.sh: installs the package in place, every
# package at the version requirements/test-lock.txt pins (what CI and a fresh machine resolve
# alike; pyproject.toml keeps the compatible ranges for users who install it themselves).
# $1 names an optional extra ("test", or "plot" for the quickstart).
#
# An installed torch (a CUDA, ROCm or CPU build) is kept, and with it the Triton and CUDA
# libraries it brings: the lock then pins everything else. Without one, the lock's torch is
# installed (TORCH_SPEC overrides it, e.g. TORCH_SPEC=torch==2.4.1).
#
# The lock is for one Python (its header says which) and the newest torch. Another Python, or a
# torch older than 2.6 (the ROCm image's 2.4), gets the newest versions pyproject.toml's ranges
# allow instead, with a note; with such a torch also numpy<2, pyarrow<26 and transformers<5:
# Triton 3.0's CPU interpreter, which the kernel tests run on, predates NumPy 2 (and pyarrow 26
# needs NumPy 2), and transformers 5 needs torch 2.6.
extra="${1:-}"
lock="$PWD/requirements/test-lock.txt"
constraints="$(mktemp "${TMPDIR:-/tmp}/megatron-dmoe-constraints.XXXXXX")"
pin() { grep -E "^$1==" "$lock"; }
# --no-compile: bytecode is written at first import for the modules a run imports; compiling
# every file of torch, transformers and lm-eval at install time costs about 45 s on 2 cores.
install() { python -m pip install --quiet --no-compile "$@"; }

lock_python="$(sed -n -E 's/.*Python ([0-9]+\.[0-9]+) .*/\1/p' "$lock" | head -1)"
this_python="$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if ! python -c "import torch" >/dev/null 2>&1; then
    if [ -n "${TORCH_SPEC:-}" ]; then
        install "$TORCH_SPEC"  # with the Triton it brings
    elif [ "$lock_python" = "$this_python" ]; then
        install -c "$lock" "$(pin torch)"  # torch's own dependencies pinned too
    else
        install "torch>=2.4"
    fi
    torch_kept=0
else
    torch_kept=1
fi
torch_version="$(python -c 'import torch; print(torch.__version__)' 2>/dev/null)"
older_torch="$(python -c 'import sys, torch; v = torch.__version__.split("+")[0].split(".")
sys.stdout.write("1" if (int(v[0]), int(v[1])) < (2, 6) else "0")' 2>/dev/null)"
if [ "$lock_python" != "$this_python" ] || [ "$older_torch" = 1 ]; then
    echo "note: requirements/test-lock.txt pins versions for Python $lock_python and torch" \
        "$(pin torch | cut -d= -f3); this is Python $this_python with torch $torch_version:" \
        "installing the newest versions that pyproject.toml's ranges allow instead"
    # The torch just installed or kept stays: without this, a package whose newest release
    # wants a newer torch would upgrade it (TORCH_SPEC=torch==2.4.1 ended with torch 2.15).
    # Its public version: "2.4.1" admits the installed "2.4.1+cu121", which pip cannot find
    # in an index under its own name.
    echo "torch==${torch_version%%+*}" > "$constraints"
    if [ "$older_torch" = 1 ]; then
        printf '%s\n' "numpy<2" "pyarrow<26" "transformers<5" >> "$constraints"
    fi
elif [ "$torch_kept" = 1 ]; then
    echo "keeping the installed torch $torch_version (the lock pins $(pin torch))"
    grep -v -E '^(torch|triton|pytorch-triton-rocm|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==' \
        "$lock" > "$constraints"
else
    # The lock's torch, or TORCH_SPEC's with the Triton it brought.
    grep -v -E '^(torch|triton)==' "$lock" > "$constraints"
    if [ -z "${TORCH_SPEC:-}" ]; then
        pin triton >> "$constraints"
    fi
fi
# Also read by the isolated environment that builds the C++ helper (setuptools, pybind11).
export PIP_CONSTRAINT="$constraints"
if [ -n "$extra" ]; then
    install -e ".[$extra]"
else
    install -e .
fi
unset PIP_CONSTRAINT
rm -f "$constraints"
