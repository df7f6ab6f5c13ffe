"""What a Docker image installs for the package, read from pyproject.toml so that the images never
keep a hand-copied list: the build requirements and the runtime dependencies, one per line, less
torch and triton, which the base image brings in its own build (a PyPI wheel would replace it).
The Dockerfiles then install the package itself with --no-deps.

Usage: python scripts/image_requirements.py [PYPROJECT] > requirements.txt
(Python 3.11+, for tomllib: the base images carry 3.12.)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List

import tomllib

# Installed by the base image, built for its CUDA or ROCm.
FROM_THE_IMAGE = ("torch", "triton")


def requirement_name(requirement: str) -> str:
    """The distribution a requirement names, normalized: 'Tokenizers>=0.15' -> 'tokenizers'."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"{requirement!r} names no distribution")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def image_requirements(pyproject: Path) -> List[str]:
    project = tomllib.loads(pyproject.read_text())
    requirements = project["build-system"]["requires"] + project["project"]["dependencies"]
    return [
        requirement
        for requirement in requirements
        if requirement_name(requirement) not in FROM_THE_IMAGE
    ]


def main() -> None:
    pyproject = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
    print("\n".join(image_requirements(pyproject)))


if __name__ == "__main__":
    main()
