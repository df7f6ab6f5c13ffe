"""Where a run's data comes from (megatron/config/validation.py's data checks): --mock-data
in place of the dataset paths, each refusal one line naming its flags."""

from __future__ import annotations

import pytest

from tests.config.command_lines import config, error_message


def test_mock_data_needs_no_data_path():
    data = config("--mock-data", drop=("--data-path",)).data
    assert data.mock_data and data.data_path is None


@pytest.mark.parametrize(
    "extra, kwargs, expected",
    [
        (
            ("--mock-data",),
            {},
            "--mock-data and --data-path were both given: --mock-data trains on synthetic "
            "tokens instead of a dataset; drop one of them",
        ),
        (
            ("--mock-data", "--train-data-path", "a", "--valid-data-path", "b"),
            {"drop": ("--data-path",)},
            "--mock-data and --train-data-path, --valid-data-path were both given: --mock-data "
            "trains on synthetic tokens instead of a dataset; drop one of them",
        ),
    ],
)
def test_mock_data_refusals(extra, kwargs, expected):
    assert error_message(*extra, **kwargs) == expected
