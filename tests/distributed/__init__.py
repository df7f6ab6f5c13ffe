"""Multi-process tests on CPU with the gloo backend (see launch.run_distributed)."""
