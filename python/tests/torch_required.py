"""The optional test dependencies' one import rule: the module, or a skip where it is not
installed, except in CI.

scripts/test.sh installs torch (python/requirements-test.txt) and sets CI, so there a missing torch
is an error, never a skip that would let CI pass without the torch front door tested
(test_edges.py::test_torch_tests_fail_in_ci_without_torch checks the message).
"""

import importlib
import os

import pytest


def required(module, name, tests, module_level=False):
    """`module` imported, or a skip where `name` is not installed, except where CI is set: there
    an error, so that CI never passes with `tests` skipped (torch's, and the ONNX adapter's)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            raise RuntimeError(f"CI is set but {name} cannot be imported ({e}): scripts/test.sh installs it from "
                               f"python/requirements-test.txt, and CI must not skip the {tests}") from e
        pytest.skip(f"{name} is not installed ({e})", allow_module_level=module_level)


def import_torch(module_level=False):
    """torch, after importing sdpa.torch (its operators registered); a test module calls it at
    import time with module_level=True (the whole module skips), a test function without."""
    torch = required("torch", "torch", "torch tests", module_level)
    import sdpa.torch  # noqa: F401
    return torch
