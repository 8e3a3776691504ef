"""The capture proxy (design §5.1, §5.2): routing, custody, capture and answering.

- ``routing``: training capture vs evaluation correlation vs plain pass-through, the
  pass-through itself, unrecognised training routes;
- ``capture``: one generating call (intent before dispatch, upstream, record before answer);
- ``handlers``: one ``DialectHandler`` per dialect in a ``Dialect -> handler`` table, so no other
  module branches on the dialect;
- ``reply``: answers and refusals in the harness's dialect (JSON or SSE);
- ``headers``: what a proxied request carries upstream.
"""

from api.proxy.routing import DEFAULT_NON_GENERATING, install_proxy

__all__ = ["DEFAULT_NON_GENERATING", "install_proxy"]
