"""Kaggle paultimothymooney/chest-xray-pneumonia: the Mendeley v2 chest X-rays, re-split with a val folder.

Fetched through the official `kaggle` package. It is imported only when a
download is actually needed, because importing and authenticating it without
credentials prints a help text and exits; that becomes one actionable error.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Iterator

from covidxray.errors import UserError
from covidxray.sources import zhanglab
from covidxray.sources.base import Dropped, Record, register_source
from covidxray.sources.descriptors import Archive
from covidxray.sources.download import say_stderr, sha256_file, verify_sha256
from covidxray.sources.fetch import DescribedSource

CREDENTIALS_HELP = (
    "put your Kaggle API token in ~/.kaggle/kaggle.json (chmod 600), or set KAGGLE_USERNAME and KAGGLE_KEY "
    "(or KAGGLE_API_TOKEN); tokens are made at https://www.kaggle.com/settings/api"
)


def kaggle_api():
    """An authenticated KaggleApi, or UserError saying how to provide credentials."""
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            import kaggle  # authenticates (or fails) on import in every kaggle version

            api = kaggle.KaggleApi()
            api.authenticate()
    except ImportError:
        raise UserError("the `kaggle` package is not installed: pip install kaggle (or pass the downloaded zip with --from)") from None
    except (SystemExit, Exception) as err:  # kaggle signals missing credentials with exit(1), OSError or ValueError
        raise UserError(f"Kaggle authentication failed ({err.__class__.__name__}): {CREDENTIALS_HELP}; or download the zip yourself and pass it with --from") from None
    return api


def kaggle_download(dataset: str, folder: Path, file_name: str, sha256: str | None) -> tuple[Path, str]:
    """`<folder>/<slug>.zip` through the Kaggle API (which resumes partial downloads itself)."""
    path = folder / file_name
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        api = kaggle_api()
        say_stderr(f"downloading {dataset} from Kaggle -> {path}")
        try:
            api.dataset_download_files(dataset, path=str(folder), unzip=False, quiet=True)
        except Exception as err:  # network, HTTP and API errors from a third-party client
            raise UserError(
                f"Kaggle download of {dataset} failed: {err}. Re-run to retry, or download {file_name} from "
                f"https://www.kaggle.com/datasets/{dataset} and pass it with --from"
            ) from None
        if not path.is_file():
            raise UserError(f"the Kaggle API finished but {path} is missing; download it yourself and pass it with --from")
    digest = verify_sha256(path, sha256, origin=f"kaggle:{dataset}", delete=True) if sha256 else sha256_file(path)
    return path, digest


@register_source
class ChestXrayPneumoniaSource(DescribedSource):
    name = "chest-xray-pneumonia"
    archive_key = "kaggle"

    def download(self, archive: Archive, folder: Path) -> tuple[Path, str]:
        if self.options.url:  # a mirror over plain HTTP
            return super().download(archive, folder)
        return kaggle_download(self.descriptor.kaggle_dataset, folder, archive.file, self.options.sha256 or None)

    def is_root(self, folder: Path) -> bool:
        return zhanglab.is_split_tree(folder, ("PNEUMONIA",))

    def records(self, root: Path) -> Iterator[Record | Dropped]:
        return zhanglab.records(self.name, root, self.descriptor)
