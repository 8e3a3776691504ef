"""Every exception the product defines stands in the documented tree (``ledger.errors``), or on
the short list of those that stay outside it on purpose (issue 9)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from api import dialects
from api.errors import status_for
from api.extract import MalformedTokenPayload, MissingTokenIds, TokenExtractionError
from ledger import errors

ROOT = Path(__file__).resolve().parent.parent

# Not refusals of the ledger: configuration and command-line errors, web-layer body limits,
# private control flow.  The ledger.errors docstring names them.
OUTSIDE = {
    "api.errors.BodyTooLarge",
    "api.limits.JsonProblem",
    "api.prefix.PrefixProofError",
    "api.prefix._Unrenderable",
    "api.ui.tokens.TokenizerError",
    "api.ui_cli.UiError",
    "api.upstream.UpstreamFailure",
    "ledger.cli_errors.CliError",
    "ledger.collect.CollectAborted",
    "ledger.collect.CollectFailed",
    "ledger.collect.CollectRefused",
    "ledger.config.ConfigError",
    "ledger.storage.writer._Replay",
}


def _product_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for pkg in ("ledger", "api"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            module = importlib.import_module(name)
            for value in vars(module).values():
                if (
                    isinstance(value, type)
                    and issubclass(value, BaseException)
                    and value.__module__ == name
                ):
                    found[f"{name}.{value.__qualname__}"] = value
    return found


def test_every_product_exception_is_in_the_tree_or_listed_outside() -> None:
    found = _product_exceptions()
    assert "ledger.errors.LedgerError" in found  # the walk sees real classes
    outside = {n for n, cls in found.items() if not issubclass(cls, errors.LedgerError)}
    assert outside == OUTSIDE


def test_domain_errors_keep_the_bases_their_callers_catch() -> None:
    for cls in (errors.BuildInputError, errors.ProjectionError):
        assert issubclass(cls, errors.BuildError)
        assert issubclass(cls, ValueError)  # delivery catches ValueError to mask the build
    assert issubclass(errors.ConformanceError, AssertionError)
    assert issubclass(dialects.InvalidRequest, errors.RequestRefused)
    assert issubclass(dialects.UnsupportedRequest, ValueError)
    for cls in (MissingTokenIds, MalformedTokenPayload):
        assert issubclass(cls, TokenExtractionError)
        assert issubclass(cls, errors.CaptureFailed)
    # The old homes still name the same classes.
    import ledger.builder
    import ledger.conformance
    import ledger.projection

    assert ledger.builder.BuildInputError is errors.BuildInputError
    assert ledger.projection.ProjectionError is errors.ProjectionError
    assert ledger.conformance.ConformanceError is errors.ConformanceError
    assert ledger.StaleSnapshot is errors.StaleSnapshot


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (errors.StaleSnapshot("x"), 409),
        (errors.RolloutRetired("x"), 410),
        (errors.BuildInputError("x"), 500),
        (errors.ConformanceError("check", "detail"), 500),
    ],
)
def test_http_status_of_the_tree(exc: errors.LedgerError, status: int) -> None:
    assert status_for(exc) == status


def test_conformance_error_keeps_its_fields() -> None:
    exc = errors.ConformanceError("roundtrip", "ids differ")
    assert (exc.check, exc.check_name, exc.detail) == ("roundtrip", "roundtrip", "ids differ")
    assert str(exc) == exc.message == "roundtrip: ids differ"
