"""Kaggle paultimothymooney/chest-xray-pneumonia: the Mendeley v2 chest X-rays, re-split with a val folder.

Fetched through the official `kaggle` package. It is imported only when a
download is actually needed, because importing and authenticating it without
credentials prints a help text and exits; that becomes one actionable error.
A failure says whether the network, the credentials or Kaggle itself is at
fault: kaggle 2.x checks a KAGGLE_API_TOKEN over the network, so without a
network a bogus token and a good one fail alike, with a connection error.
"""

from __future__ import annotations

import contextlib
import io
import socket
from collections.abc import Iterator
from pathlib import Path

from covidxray.errors import UserError
from covidxray.files import sha256_file
from covidxray.records import Dropped, Record
from covidxray.sources import zhanglab
from covidxray.sources.archive import Say
from covidxray.sources.base import register_source
from covidxray.sources.descriptors import Archive
from covidxray.sources.download import verify_sha256
from covidxray.sources.fetch import DescribedSource, DownloadOptions

CREDENTIALS_HELP = (
    "put your Kaggle API token in ~/.kaggle/kaggle.json (chmod 600), or set KAGGLE_USERNAME and KAGGLE_KEY "
    "(or KAGGLE_API_TOKEN); tokens are made at https://www.kaggle.com/settings/api"
)


def _causes(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and the exceptions it was raised from or while handling (clients wrap connection errors)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def failure_kind(err: BaseException) -> tuple[str, str]:
    """(kind, detail) of what the kaggle client raised; kind is network, credentials, not-found, service or other.

    kaggle 2.x: no network -> requests.ConnectionError (or Timeout); a token the server
    rejects -> HTTP 401, or no usable credentials at all -> exit(1) (SystemExit) after its
    help text; kaggle <= 1.7 -> OSError naming kaggle.json.
    """
    import requests

    for cause in _causes(err):
        if isinstance(cause, requests.HTTPError) and cause.response is not None:
            status = cause.response.status_code
            kind = (
                "credentials"
                if status in (401, 403)
                else "not-found"
                if status == 404
                else "service"
                if status >= 500
                else "other"
            )
            return kind, f"HTTP {status}"
        if isinstance(
            cause, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError, socket.gaierror)
        ):
            return "network", _short(cause)
    if isinstance(err, SystemExit) or (isinstance(err, OSError) and "kaggle.json" in str(err)):
        return "credentials", "no usable Kaggle credentials found"
    return "other", f"{err.__class__.__name__}: {_short(err)}"


def _short(err: BaseException, limit: int = 240) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def explain_failure(err: BaseException, doing: str, dataset: str) -> str:
    """What went wrong while `doing` (e.g. 'authenticating') and what to do about it."""
    kind, detail = failure_kind(err)
    manual = f"or download it from https://www.kaggle.com/datasets/{dataset} on a machine with internet and pass the zip with --from"
    if kind == "network":
        return (
            f"could not reach Kaggle while {doing} ({detail}): a network problem, not a credentials one. Check this "
            f"machine's connection, DNS and proxy (HTTPS_PROXY), then re-run; {manual}"
        )
    if kind == "credentials":
        return f"Kaggle did not accept the credentials while {doing} ({detail}): {CREDENTIALS_HELP}; {manual}"
    if kind == "not-found":
        return f"Kaggle has no dataset {dataset} ({detail}); check datasets/chest-xray-pneumonia.yaml kaggle_dataset, {manual}"
    if kind == "service":
        return f"Kaggle itself failed while {doing} ({detail}); re-run later, {manual}"
    return f"the Kaggle client failed while {doing} ({detail}); re-run to retry, {manual}"


def kaggle_api(dataset: str):
    """An authenticated KaggleApi, or UserError saying what failed (network or credentials) and what to do."""
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            import kaggle  # authenticates (or fails) on import in every kaggle version

            api = kaggle.KaggleApi()
            api.authenticate()
    except ImportError:
        raise UserError(
            "the `kaggle` package is not installed: pip install kaggle (or pass the downloaded zip with --from)"
        ) from None
    except (SystemExit, Exception) as err:  # exit(1), OSError, requests errors: see failure_kind
        raise UserError(explain_failure(err, "authenticating", dataset)) from None
    return api


def kaggle_download(dataset: str, folder: Path, file_name: str, sha256: str | None, say: Say) -> tuple[Path, str]:
    """`<folder>/<slug>.zip` through the Kaggle API (which resumes partial downloads itself)."""
    path = folder / file_name
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        api = kaggle_api(dataset)
        say(f"downloading {dataset} from Kaggle -> {path}")
        try:
            api.dataset_download_files(dataset, path=str(folder), unzip=False, quiet=True)
        except Exception as err:  # network, HTTP and API errors from a third-party client
            raise UserError(
                f"download of {file_name} failed: " + explain_failure(err, f"downloading {dataset}", dataset)
            ) from None
        if not path.is_file():
            raise UserError(
                f"the Kaggle API finished but {path} is missing; download it yourself and pass it with --from"
            )
    digest = verify_sha256(path, sha256, origin=f"kaggle:{dataset}", delete=True) if sha256 else sha256_file(path)
    return path, digest


@register_source
class ChestXrayPneumoniaSource(DescribedSource[DownloadOptions]):
    name = "chest-xray-pneumonia"
    archive_key = "kaggle"

    def download(self, archive: Archive, folder: Path) -> tuple[Path, str]:
        if self.options.url:  # a mirror over plain HTTP
            return super().download(archive, folder)
        return kaggle_download(
            self.descriptor.kaggle_dataset, folder, archive.file, self.options.sha256 or None, self.context.say
        )

    def is_root(self, folder: Path) -> bool:
        return zhanglab.is_split_tree(folder, ("PNEUMONIA",))

    def records(self, root: Path) -> Iterator[Record | Dropped]:
        return zhanglab.records(self.record, root, self.descriptor)
