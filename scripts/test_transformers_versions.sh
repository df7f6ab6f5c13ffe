#!/usr/bin/env bash
# The Hugging Face tools (gpt_pretraining/huggingface: the exported dMoE's modeling file, export, import)
# under each transformers the `hf` extra allows: for every version named (default: the lowest
# allowed, 5.17.0 and the newest), a throwaway virtual environment with the pinned test
# environment (requirements/test-lock.txt) but that transformers and the tokenizers and
# huggingface-hub it needs, then the remote-code, generation-equality and export/import tests.
# "latest" is the newest release pip resolves. Prints one summary line per version; exits
# non-zero if any version fails.
#   bash scripts/test_transformers_versions.sh [VERSION ...]   e.g. 4.57.1 5.0.0 latest
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(4.57.1 5.17.0 latest)
tests=(tests/tools/test_remote_code_dmoe.py tests/inference/test_matches_transformers.py
       tests/tools/test_hf_convert.py)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Everything pinned but the Hugging Face libraries whose versions follow transformers'.
grep -v -E '^(transformers|tokenizers|huggingface-hub|hf-xet)==' requirements/test-lock.txt \
    > "$work/constraints.txt"
python="${PYTHON:-python3}"
summary=()
status=0
for version in "${versions[@]}"; do
    spec="transformers==$version"
    [ "$version" = latest ] && spec="transformers"
    echo "== $spec: a new virtual environment in $work/$version"
    "$python" -m venv "$work/$version"
    pip=("$work/$version/bin/python" -m pip install --quiet --no-compile -c "$work/constraints.txt")
    "${pip[@]}" "$(grep -E '^torch==' requirements/test-lock.txt)"
    "${pip[@]}" -e '.[hf]' pytest "$spec"
    resolved="$("$work/$version/bin/python" -c 'import transformers; print(transformers.__version__)')"
    if "$work/$version/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"; then
        summary+=("transformers $resolved: passed")
    else
        summary+=("transformers $resolved: FAILED")
        status=1
    fi
done
echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$status"
