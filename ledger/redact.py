"""Keep secrets out of logs, banners, health answers and error messages.

Database and upstream URLs may carry credentials in their userinfo
(``postgresql://user:PASSWORD@host/db``, ``http://user:KEY@vllm:8000``).  Anything that shows a
URL to a person or a log goes through :func:`redact_url` (one URL) or :func:`redact_text` (free
text that may contain URLs, such as a driver's error message).  The user name stays: it helps a
person see which account was meant; the password never does.
"""

from __future__ import annotations

import logging
import re

__all__ = ["MASK", "RedactingFilter", "install_log_redaction", "redact_text", "redact_url"]

MASK = "***"
# scheme://userinfo@ : userinfo is everything up to the last "@" before the host part.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/\s@]*)@")
# Query parameters that carry a secret (libpq's password=, an api_key= on an upstream URL).
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&;](?:password|passwd|pwd|api[_-]?key|key|token|secret|access_token)=)"
    r"(?P<value>[^&;#\s]*)",
    re.IGNORECASE,
)


def _mask_userinfo(match: re.Match[str]) -> str:
    user, sep, _password = match.group("userinfo").partition(":")
    if not sep:
        # A bare token in the user position (http://TOKEN@host) is a secret too.
        return f"{match.group('scheme')}{MASK}@" if user else match.group(0)
    return f"{match.group('scheme')}{user}:{MASK}@"


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it (and secret query values) masked."""
    if "@" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(_mask_userinfo, text)
    return _SECRET_PARAM.sub(lambda m: m.group("key") + MASK, text)


def redact_url(url: str | None) -> str | None:
    """One URL, safe to show: ``postgresql://app:***@db:5432/ledger``."""
    return None if url is None else redact_text(url)


class RedactingFilter(logging.Filter):
    """Rewrites a record's message so that no URL password reaches a handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string is the logger's problem, not ours
            return True
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_FILTER = RedactingFilter()


def install_log_redaction(*names: str) -> None:
    """Attach the filter to the named loggers (idempotent).

    Logger filters apply to records created on that logger; ``httpx`` logs one INFO line per
    request with the full URL, so it is named here by the service.
    """
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
