"""Helpers for tests that need more than one OS process (run as ``python -m tests.helpers.…``)."""
