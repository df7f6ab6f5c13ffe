"""Which torch each part of the project needs, in one place: the package's floor and the newer
releases that some features need. Flag checks refuse with these numbers; the Docker images must
carry a torch at or above the newest of them, so that an image runs everything the README
promises (tests/test_docker_images.py reads the Dockerfiles, and `python -m
megatron.torch_floors --image-torch X.Y` checks the image's own torch while it is built).

Features are still detected where they are used (`hasattr(torch, "_grouped_mm")`): a version
number says what a release should have, the attribute what this build has.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Dict, Optional, Sequence, Tuple

Version = Tuple[int, int]

# pyproject.toml's torch>=2.4: the CPU test suite passes on 2.4.1 (README, "Supported versions").
PACKAGE = (2, 4)
# --use-torch-fsdp2: fully_shard is public (torch.distributed.fsdp) from 2.6. The private one
# before it does not do what FullyShard needs: 2.5's runs on CUDA streams only (no gloo run, so
# no CPU test), 2.4's has no explicit prefetch.
FULLY_SHARD = (2, 6)
# The dMoE compiled as one graph on NVIDIA Hopper: torch._grouped_mm, from 2.8.
GROUPED_MM = (2, 8)

FEATURES: Dict[str, Version] = {
    "the package": PACKAGE,
    "--use-torch-fsdp2 (torch.distributed.fsdp.fully_shard)": FULLY_SHARD,
    "the dMoE compiled as one graph (torch._grouped_mm)": GROUPED_MM,
}
NEWEST = max(FEATURES.values())


def parse_version(text: str) -> Version:
    """(major, minor) of a torch version string: '2.10.0a0+b4e4ee8' -> (2, 10)."""
    match = re.match(r"\s*(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"{text!r} is not a torch version (MAJOR.MINOR...)")
    return int(match.group(1)), int(match.group(2))


def spelled(version: Version) -> str:
    return ".".join(map(str, version))


def running_torch() -> Version:
    import torch

    return parse_version(torch.__version__)


def check_image(image_torch: str, torch_version: Optional[str] = None) -> Optional[str]:
    """Why an image whose Dockerfile says it carries torch `image_torch` cannot serve, in one
    line, or None: the statement must match the torch installed (`torch_version`, default this
    process's) and reach the newest floor."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    stated, actual = parse_version(image_torch), parse_version(torch_version)
    if stated != actual:
        return (
            f"the Dockerfile says its base image carries torch {image_torch} "
            f"(BASE_IMAGE_TORCH) but it has torch {torch_version}: correct BASE_IMAGE_TORCH "
            f"to {spelled(actual)}"
        )
    if actual < NEWEST:
        needs = ", ".join(
            f"{feature} needs {spelled(floor)}"
            for feature, floor in FEATURES.items()
            if actual < floor
        )
        return (
            f"torch {torch_version} in the base image is older than {spelled(NEWEST)} ({needs}): "
            f"choose a BASE_IMAGE with torch {spelled(NEWEST)} or newer"
        )
    return None


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.torch_floors",
        description="Check a Docker image's torch against the project's floors.",
    )
    parser.add_argument(
        "--image-torch",
        required=True,
        help="the torch the Dockerfile says its base image carries (BASE_IMAGE_TORCH)",
    )
    args = parser.parse_args(argv)
    problem = check_image(args.image_torch)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(1)
    print(f"torch {args.image_torch}: meets every floor ({spelled(NEWEST)})")


if __name__ == "__main__":
    main()
