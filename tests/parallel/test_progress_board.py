"""Which collective a timed-out rank names (megatron.parallel.progress_board)."""

from __future__ import annotations

from pathlib import Path

from megatron.parallel.progress_board import _collective_of

REPO_ROOT = Path(__file__).resolve().parents[2]


def _raise_from(filename: str, function: str) -> None:
    """Raise a collective's timeout from a frame that `filename` names."""
    code = compile(f"def {function}():\n    raise RuntimeError('timed out')\n", filename, "exec")
    scope: dict = {}
    exec(code, scope)
    scope[function]()


def test_a_library_installed_inside_the_checkout_is_not_the_project():
    """A virtual environment created in the repository (`.venv/`) holds torch under the
    repository root too: its autograd frame is the library's, and the project frame that
    called it is named."""
    autograd = REPO_ROOT / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "autograd"
    try:
        _raise_from(str(autograd / "graph.py"), "_engine_run_backward")
    except RuntimeError as error:
        described = _collective_of(error)
    assert described.startswith(
        "the gradient reduction during backward, called from tests/parallel/test_progress_board.py:"
    ), described
    assert described.endswith("(_raise_from)"), described
