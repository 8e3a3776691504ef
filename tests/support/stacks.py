"""Fixtures a test module opts into by importing them (this module is not a pytest plugin).

``from tests.support.stacks import shared_stack_as_stack`` makes ``stack`` in that module the
session's shared proxy + simulated engine (``tests.proxy_support.shared_stack``, reset for each
test) instead of a fresh stack per test.
"""

from __future__ import annotations

import pytest

from tests.proxy_support import Stack


@pytest.fixture(name="stack")
def shared_stack_as_stack(shared_stack: Stack) -> Stack:
    """The session's proxy and engine for this backend (shared, reset for each test)."""
    return shared_stack
