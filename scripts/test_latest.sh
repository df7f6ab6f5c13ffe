#!/usr/bin/env bash
# The test suite against the newest release of every package pyproject.toml allows, in a
# throwaway virtual environment: version drift found on purpose rather than by a user. Prints
# each package whose newest version differs from requirements/test-lock.txt, then runs what
# scripts/test.sh runs. Extra arguments go to pytest.
#   bash scripts/test_latest.sh [--write-lock] [pytest arguments]
# --write-lock: when the run passes, that environment's versions become the lock.
# TORCH_SPEC picks the torch (default: the newest pip resolves, which on Linux x86_64 is a
# CUDA build of several GB; TORCH_SPEC=torch==2.13.0 keeps a CPU build where one is at hand).
set -euo pipefail
cd "$(dirname "$0")/.."
write_lock=0
if [ "${1:-}" = --write-lock ]; then
    write_lock=1
    shift
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m venv "$work/venv"
source "$work/venv/bin/activate"
echo "== installing the newest allowed versions into $work/venv"
python -m pip install --quiet "${TORCH_SPEC:-torch}"
python -m pip install --quiet --upgrade -e '.[test]' setuptools wheel pybind11
# Everything but pip and this project, names normalized (PEP 503) and local labels (+cpu)
# dropped: what a constraint matches.
python -m pip freeze --all --exclude-editable | python -c '
import re, sys
pins = set()
for line in sys.stdin:
    name, _, version = line.strip().partition("==")
    name = re.sub(r"[-_.]+", "-", name).lower()
    if version and name not in ("pip", "megatron-dmoe"):
        pins.add(name + "==" + version.split("+")[0])
print("\n".join(sorted(pins)))' > "$work/latest.txt"
echo "== newest versions that differ from requirements/test-lock.txt (lock -> newest)"
python - "$work/latest.txt" requirements/test-lock.txt <<'PY'
import sys

def pins(path):
    lines = (line.split("#")[0].strip() for line in open(path))
    return dict(line.lower().split("==", 1) for line in lines if "==" in line)

latest, lock = pins(sys.argv[1]), pins(sys.argv[2])
changed = [(name, lock.get(name, "-"), latest.get(name, "-"))
           for name in sorted(set(latest) | set(lock)) if lock.get(name) != latest.get(name)]
for name, old, new in changed:
    print(f"  {name}: {old} -> {new}")
print(f"  {len(changed)} of {len(latest)} packages differ")
PY
python -m ruff check .
python -m pytest -q -n auto --dist loadfile "$@"
if [ "$write_lock" = 1 ]; then
    {
        echo "# The versions scripts/test.sh installs (pip constraints): the newest each range of"
        echo "# pyproject.toml allowed on $(date -u +%Y-%m-%d), with which the suite passed on"
        echo "# Python $(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
             "$(uname -m). Written by: bash scripts/test_latest.sh --write-lock"
        cat "$work/latest.txt"
    } > requirements/test-lock.txt
    echo "== wrote requirements/test-lock.txt"
fi
