"""The Docker images carry a torch that runs everything the README promises, and install the
package's own requirements: read from both Dockerfiles, against megatron/torch_floors.py (the
floors the flag checks enforce) and pyproject.toml. No image is built here (no Docker engine
on the CI machine); the build itself checks the base image's real torch
(`python -m megatron.torch_floors --image-torch`), tested below on its own."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron import torch_floors

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = ["Dockerfile", "Dockerfile.rocm"]

_spec = importlib.util.spec_from_file_location(
    "image_requirements", REPO / "scripts" / "image_requirements.py"
)
image_requirements_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(image_requirements_script)
image_requirements = image_requirements_script.image_requirements
requirement_name = image_requirements_script.requirement_name


def build_arguments(dockerfile: str) -> dict:
    """The ARG NAME=DEFAULT lines of a Dockerfile."""
    text = (REPO / dockerfile).read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def run_commands(dockerfile: str) -> str:
    """The RUN instructions of a Dockerfile, continuation lines joined."""
    text = (REPO / dockerfile).read_text().replace("\\\n", " ")
    return "\n".join(line for line in text.splitlines() if line.startswith("RUN "))


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_image_torch_meets_every_floor_the_code_enforces(dockerfile):
    arguments = build_arguments(dockerfile)
    assert "BASE_IMAGE" in arguments and "BASE_IMAGE_TORCH" in arguments, (
        f"{dockerfile} must declare ARG BASE_IMAGE and ARG BASE_IMAGE_TORCH (the base image's "
        f"torch, MAJOR.MINOR)"
    )
    image_torch = torch_floors.parse_version(arguments["BASE_IMAGE_TORCH"])
    for feature, floor in torch_floors.FEATURES.items():
        assert image_torch >= floor, (
            f"{dockerfile}: torch {arguments['BASE_IMAGE_TORCH']} is below {feature}'s "
            f"{torch_floors.spelled(floor)}"
        )
    # Where the tag names its torch (rocm/pytorch's ..._pytorch_release_2.8.0), it agrees.
    tagged = re.search(r"pytorch_release_(\d+\.\d+)", arguments["BASE_IMAGE"])
    if tagged is not None:
        assert torch_floors.parse_version(tagged.group(1)) == image_torch


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_build_checks_the_real_torch_after_installing_the_package(dockerfile):
    commands = run_commands(dockerfile)
    install = commands.index("pip install --no-cache-dir --no-deps --no-build-isolation -e .")
    check = commands.index('python -m megatron.torch_floors --image-torch "${BASE_IMAGE_TORCH}"')
    assert install < check


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_image_installs_the_requirements_pyproject_lists_and_no_copied_ones(dockerfile):
    commands = run_commands(dockerfile)
    assert "python /tmp/requirements/image_requirements.py" in commands
    installs = [found.strip() for found in re.findall(r"pip install ([^&\n]*)", commands)]
    assert installs == [
        "--no-cache-dir -r /tmp/requirements/requirements.txt",
        "--no-cache-dir --no-deps --no-build-isolation -e .",
    ]


def test_the_image_requirements_are_pyprojects_less_what_the_image_brings():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = project["build-system"]["requires"] + project["project"]["dependencies"]
    requirements = image_requirements(REPO / "pyproject.toml")
    assert {requirement_name(r) for r in requirements} == {requirement_name(r) for r in listed} - {
        "torch",
        "triton",
    }
    # The hand-copied list the images had lacked tiktoken.
    assert any(requirement_name(r) == "tiktoken" for r in requirements)
    assert requirement_name("Tokenizers>=0.15") == "tokenizers"
    assert requirement_name("pybind11 >= 2.10") == "pybind11"


def test_the_image_check_refuses_a_stale_statement_and_an_old_torch():
    assert torch_floors.check_image("2.10", torch_version="2.10.0a0+b4e4ee81d3") is None
    stale = torch_floors.check_image("2.8", torch_version="2.10.0a0+b4e4ee81d3")
    assert "says its base image carries torch 2.8" in stale
    assert "correct BASE_IMAGE_TORCH to 2.10" in stale
    old = torch_floors.check_image("2.5", torch_version="2.5.1")
    assert "torch 2.5.1 in the base image is older than 2.8" in old
    assert "--use-torch-fsdp2 (torch.distributed.fsdp.fully_shard) needs 2.6" in old
    assert "the dMoE compiled as one graph (torch._grouped_mm) needs 2.8" in old
    assert "the package" not in old


def test_the_image_check_exits_non_zero_with_one_line():
    stated = torch_floors.spelled(torch_floors.running_torch())
    passing = subprocess.run(
        [sys.executable, "-m", "megatron.torch_floors", "--image-torch", stated],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    failing = subprocess.run(
        [sys.executable, "-m", "megatron.torch_floors", "--image-torch", "1.13"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    meets = torch_floors.running_torch() >= torch_floors.NEWEST
    assert (passing.returncode, failing.returncode) == (0 if meets else 1, 1)
    assert failing.stderr.startswith("error: the Dockerfile says its base image carries torch 1.13")
    assert len(failing.stderr.strip().splitlines()) == 1
