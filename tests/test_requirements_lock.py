"""requirements/test-lock.txt, the versions scripts/test.sh installs, against pyproject.toml's
ranges: every requirement of the package and of its `test` and `hf` extras that applies here
is pinned, to a version its range allows. A dependency added to pyproject.toml without a pin,
or a range moved past the pin, fails here rather than on a fresh machine."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

requirements = pytest.importorskip("packaging.requirements")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.9 and 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "test-lock.txt"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{LOCK.name}: {line!r} is not a name==version pin"
            pins[_normalized(name)] = version
    return pins


def _declared() -> list:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = [*project["dependencies"], *extras["test"], *extras["hf"]]
    return [requirements.Requirement(text) for text in declared]


def test_every_requirement_is_pinned_within_its_range():
    pins = _pins()
    for requirement in _declared():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = _normalized(requirement.name)
        assert name in pins, f"{requirement} has no pin in {LOCK.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{LOCK.name} pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )


def test_the_lock_names_its_python_and_pins_each_package_once():
    header = LOCK.read_text().split("\n", 3)[:3]
    assert any(re.search(r"Python \d+\.\d+ ", line) for line in header), header
    names = [
        _normalized(line.partition("==")[0])
        for line in LOCK.read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert len(names) == len(set(names))
