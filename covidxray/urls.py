"""A URL may carry a user name and password (a mirror behind HTTP Basic auth): used, never shown or stored.

urllib cannot use `http://user:password@host/...` itself (it would look up a
host named `user:password@host`), so `without_credentials` splits them off
into the Authorization header a request sends; `redacted` is what every
message, receipt, manifest and saved config shows instead.

Imports only the standard library.
"""

from __future__ import annotations

import base64
import re
from urllib.parse import unquote, urlsplit, urlunsplit

HIDDEN = "***"
_USERINFO = re.compile(r"(?<=://)[^@\s/]*@")


def redacted(text: str) -> str:
    """`text` with the user:password@ of every URL in it replaced by ***@."""
    return _USERINFO.sub(f"{HIDDEN}@", text)


def without_credentials(url: str) -> tuple[str, str | None]:
    """(`url` without user:password@, the Authorization header value for them, or None when it has none)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # urllib reports a malformed URL where it is used
        return url, None
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    return urlunsplit(parts._replace(netloc=host)), f"Basic {token}"
