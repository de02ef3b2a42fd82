"""The torch tests' one import rule: torch, or a skip where it is not installed, except in CI.

scripts/test.sh installs torch (python/requirements-test.txt) and sets CI, so there a missing torch
is an error, never a skip that would let CI pass without the torch front door tested
(test_edges.py::test_torch_tests_fail_in_ci_without_torch checks the message).
"""

import os

import pytest


def import_torch(module_level=False):
    """torch, after importing sdpa.torch (its operators registered); a test module calls it at
    import time with module_level=True (the whole module skips), a test function without."""
    try:
        import torch
    except ImportError as e:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            raise RuntimeError(f"CI is set but torch cannot be imported ({e}): scripts/test.sh installs it from "
                               "python/requirements-test.txt, and CI must not skip the torch tests") from e
        pytest.skip(f"torch is not installed ({e})", allow_module_level=module_level)
    import sdpa.torch  # noqa: F401
    return torch
