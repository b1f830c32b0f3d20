"""Fixtures shared by the tests/ files (the suite-wide settings live in the root conftest.py)."""

import pytest


@pytest.fixture
def native():
    """The native CPU kernels' extension, or the test skipped where it cannot be built (test_cpu_native's
    build test fails on such a machine and says why)."""
    from text_generation_server.kernels import cpu_native

    module = cpu_native.native()
    if module is None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    return module
