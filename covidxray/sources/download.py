"""HTTP(S) downloads that survive flaky links: resume, retry, verify.

Collections are gigabytes and boards sit on slow Wi-Fi, so a dropped
connection must cost only the bytes not yet received: data goes to
`<file>.partial` and a retry asks the server for the rest with an HTTP Range
request. The finished file is renamed into place only after its sha256
matched (when the descriptor knows one), so a file without `.partial` is
always complete. A user name and password in the URL travel in an
Authorization header (not to another host on a redirect) and are shown
nowhere (covidxray/urls.py).
"""

from __future__ import annotations

import http.client
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from covidxray.errors import UserError
from covidxray.files import sha256_file
from covidxray.urls import redacted, without_credentials

CHUNK = 1 << 20
USER_AGENT = "covidxray-fetch/0.1 (python urllib)"
Say = Callable[[str], None]


def say_stderr(message: str) -> None:
    """Default reporter: stderr, which a live rich progress bar prints above itself."""
    print(message, file=sys.stderr, flush=True)


class _Retry(Exception):
    """A transient failure: the link dropped or the server had a bad moment."""


class _Meter:
    """Prints `file: 35% (420 of 1200 MB)` at most every `interval` seconds."""

    def __init__(self, name: str, say: Say, interval: float = 10.0):
        self.name, self.say, self.interval, self.last = name, say, interval, 0.0

    def __call__(self, done: int, total: int | None, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.interval:
            return
        self.last = now
        if total:
            self.say(f"  {self.name}: {100 * done // total}% ({done / 1e6:.0f} of {total / 1e6:.0f} MB)")
        else:
            self.say(f"  {self.name}: {done / 1e6:.0f} MB")


def _total_from(response, offset: int) -> int | None:
    content_range = response.headers.get("Content-Range", "")  # "bytes 100-999/1000"
    if response.status == 206 and "/" in content_range and not content_range.endswith("*"):
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return int(length) + (offset if response.status == 206 else 0) if length else None


def _transfer(url: str, partial: Path, timeout: float, meter: _Meter) -> None:
    """Append the missing bytes of `url` to `partial`; raise _Retry when the link fails midway."""
    offset = partial.stat().st_size if partial.exists() else 0
    headers = {"User-Agent": USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    plain_url, authorization = without_credentials(url)
    shown = redacted(url)
    try:
        request = urllib.request.Request(plain_url, headers=headers)
        if authorization:  # unredirected: a redirect to another host must not carry the password there
            request.add_unredirected_header("Authorization", authorization)
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        if err.code == 416 and offset:  # nothing left to send: the partial file may already be whole
            promised = err.headers.get("Content-Range", "").rpartition("/")[2]
            if promised.isdigit() and int(promised) == offset:
                return
            partial.unlink()
            raise _Retry(f"server refused to resume at byte {offset}; starting over") from None
        if err.code in (408, 429) or err.code >= 500:
            raise _Retry(f"HTTP {err.code} {err.reason}") from None
        refused = (
            f" ({'the user name and password in the URL were' if authorization else 'no credentials were'} not accepted)"
            if err.code in (401, 403)
            else ""
        )
        raise UserError(
            f"download of {shown} failed: HTTP {err.code} {err.reason}{refused}. Check the URL (datasets/*.yaml or the "
            "source option `url:`), or download the file yourself and pass it with --from"
        ) from None
    except ValueError as err:
        raise UserError(f"cannot download {shown!r}: {redacted(str(err))}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        raise _Retry(redacted(str(getattr(err, "reason", err)))) from None
    with response:
        resumed = offset > 0 and response.status == 206
        done = offset if resumed else 0
        total = _total_from(response, done)
        try:
            with open(partial, "ab" if resumed else "wb") as handle:
                while block := response.read(CHUNK):
                    handle.write(block)
                    done += len(block)
                    meter(done, total)
        except (OSError, http.client.HTTPException) as err:
            raise _Retry(f"connection lost after {done} bytes ({err.__class__.__name__})") from None
    if total is not None and done < total:
        raise _Retry(f"connection closed after {done} of {total} bytes")


def download(
    url: str,
    dest: Path,
    sha256: str | None = None,
    *,
    retries: int = 5,
    backoff: float = 2.0,
    timeout: float = 60.0,
    say: Say = say_stderr,
) -> tuple[Path, str]:
    """Fetch `url` to `dest` (resuming `dest.partial`); returns (path, sha256 of the file).

    A wrong checksum deletes the file and raises UserError naming the file and
    both hashes, because re-running must not trust it again.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    if not dest.is_file():
        meter = _Meter(dest.name, say)
        resume_note = f", resuming at {partial.stat().st_size / 1e6:.0f} MB" if partial.exists() else ""
        say(f"downloading {redacted(url)} -> {dest}{resume_note}")
        for attempt in range(retries + 1):
            try:
                _transfer(url, partial, timeout, meter)
                break
            except _Retry as err:
                if attempt == retries:
                    raise UserError(
                        f"download of {redacted(url)} failed after {retries + 1} attempts ({err}). The bytes received so far "
                        f"are kept in {partial}: re-run to resume, or download the file yourself and pass it with --from"
                    ) from None
                wait = backoff * 2**attempt
                say(f"  {dest.name}: {err}; retrying in {wait:.0f} s")
                time.sleep(wait)
        meter(partial.stat().st_size, None, final=True)
        os.replace(partial, dest)
    if not sha256:
        actual = sha256_file(dest)
        say(f"  {dest.name}: sha256 {actual} (no checksum known to verify it; set the source option sha256 to pin it)")
        return dest, actual
    return dest, verify_sha256(dest, sha256, origin=redacted(url), delete=True)


def verify_sha256(path: Path, expected: str, origin: str = "", delete: bool = False) -> str:
    """sha256 of `path`, or UserError naming the file and both hashes when it is not `expected`.

    Downloaded files are deleted on a mismatch (a re-run must not trust them);
    a file the user passed with --from is left alone.
    """
    actual = sha256_file(path)
    if actual == expected.strip().lower():
        return actual
    source = f" (from {origin})" if origin else ""
    if delete:
        path.unlink()
        action = (
            "The file was deleted. Re-run to download it again; if it fails the same way, the upstream file changed"
        )
    else:
        action = "Check that this is the right file (a complete, unmodified download)"
    raise UserError(
        f"checksum mismatch for {path}{source}: expected sha256 {expected.strip().lower()}, got {actual}. "
        f"{action}; the expected value comes from the source option `sha256:` or datasets/*.yaml"
    )
