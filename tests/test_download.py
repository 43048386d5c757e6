"""Downloads against a local HTTP server, and safe archive extraction."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import zipfile

import pytest
from layouts import FileServer

from covidxray.errors import UserError
from covidxray.sources.archive import MARKER, extract
from covidxray.sources.download import download

PAYLOAD = os.urandom(3 * (1 << 20) + 12345)  # spans several read chunks
SHA = hashlib.sha256(PAYLOAD).hexdigest()


def quiet(_message: str) -> None:
    pass


def test_download_verifies_checksum_and_renames_only_when_complete(tmp_path):
    with FileServer({"/data.zip": PAYLOAD}) as server:
        path, digest = download(server.url("/data.zip"), tmp_path / "data.zip", SHA, say=quiet)
        assert path.read_bytes() == PAYLOAD and digest == SHA
        assert not (tmp_path / "data.zip.partial").exists()
        requests = len(server.requests)
        download(server.url("/data.zip"), tmp_path / "data.zip", SHA, say=quiet)  # already there: no traffic
        assert len(server.requests) == requests


def test_dropped_connection_resumes_with_a_range_request(tmp_path):
    with FileServer({"/big.bin": PAYLOAD}) as server:
        server.drop_after["/big.bin"] = 1_500_000
        path, digest = download(server.url("/big.bin"), tmp_path / "big.bin", SHA, backoff=0, say=quiet)
    assert digest == SHA and path.read_bytes() == PAYLOAD
    ranges = [r for p, r in server.requests if p == "/big.bin"]
    assert ranges[0] is None and ranges[1] == "bytes=1500000-"


def test_interrupted_run_resumes_from_the_partial_file(tmp_path):
    (tmp_path / "big.bin.partial").write_bytes(PAYLOAD[:777_000])  # what a killed run left behind
    with FileServer({"/big.bin": PAYLOAD}) as server:
        path, _ = download(server.url("/big.bin"), tmp_path / "big.bin", SHA, say=quiet)
    assert path.read_bytes() == PAYLOAD
    assert server.requests == [("/big.bin", "bytes=777000-")]


def test_complete_partial_file_is_accepted_on_416(tmp_path):
    (tmp_path / "big.bin.partial").write_bytes(PAYLOAD)  # killed between last byte and rename
    with FileServer({"/big.bin": PAYLOAD}) as server:
        path, digest = download(server.url("/big.bin"), tmp_path / "big.bin", SHA, say=quiet)
    assert digest == SHA and path.is_file()


def test_server_errors_are_retried_then_reported(tmp_path):
    with FileServer({"/flaky.bin": PAYLOAD}) as server:
        server.errors["/flaky.bin"] = [503, 500]
        path, _ = download(server.url("/flaky.bin"), tmp_path / "flaky.bin", SHA, backoff=0, say=quiet)
        assert path.read_bytes() == PAYLOAD
        server.errors["/down.bin"] = [503] * 10
        server.files["/down.bin"] = PAYLOAD
        with pytest.raises(UserError, match=r"failed after 3 attempts.*--from"):
            download(server.url("/down.bin"), tmp_path / "down.bin", None, retries=2, backoff=0, say=quiet)


def test_missing_file_is_not_retried(tmp_path):
    with FileServer({}) as server:
        with pytest.raises(UserError, match="HTTP 404"):
            download(server.url("/nope.zip"), tmp_path / "nope.zip", None, backoff=0, say=quiet)
        assert len(server.requests) == 1


def test_wrong_checksum_deletes_the_file_and_names_both_hashes(tmp_path):
    wrong = "0" * 64
    with FileServer({"/data.zip": PAYLOAD}) as server:
        with pytest.raises(UserError) as err:
            download(server.url("/data.zip"), tmp_path / "data.zip", wrong, say=quiet)
    message = str(err.value)
    assert "data.zip" in message and wrong in message and SHA in message
    assert not (tmp_path / "data.zip").exists() and not (tmp_path / "data.zip.partial").exists()


def test_unknown_checksum_is_reported_not_invented(tmp_path):
    said = []
    with FileServer({"/data.zip": PAYLOAD}) as server:
        _, digest = download(server.url("/data.zip"), tmp_path / "data.zip", None, say=said.append)
    assert digest == SHA and any(SHA in line for line in said)


# ---------------------------------------------------------------- extraction


def _zip(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as bundle:
        for name, data in members.items():
            bundle.writestr(name, data)
    return path


def _tar(path, add):
    with tarfile.open(path, "w:gz") as bundle:
        add(bundle)
    return path


def _tar_member(bundle, name, data=b"x", kind=tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    bundle.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def test_zip_and_tar_extract_once(tmp_path):
    archive = _zip(tmp_path / "a.zip", {"top/images/x.png": b"png", "top/metadata.csv": b"a,b\n"})
    target = extract(archive, tmp_path / "out", say=quiet)
    assert (target / "top" / "images" / "x.png").read_bytes() == b"png" and (target / MARKER).is_file()
    (target / "top" / "mine.txt").write_text("kept")  # a second call must not unpack again
    extract(archive, tmp_path / "out", say=quiet)
    assert (target / "top" / "mine.txt").is_file()
    tgz = _tar(
        tmp_path / "b.tar.gz",
        lambda b: (
            _tar_member(b, "OCT2017/train/CNV/CNV-1-1.jpeg", b"j"),
            _tar_member(b, "OCT2017/link", kind=tarfile.SYMTYPE, link="train/CNV"),
        ),
    )
    out = extract(tgz, tmp_path / "tgz", say=quiet)
    assert (out / "OCT2017" / "train" / "CNV" / "CNV-1-1.jpeg").read_bytes() == b"j"


@pytest.mark.parametrize(
    "name, build",
    [
        ("zip-dotdot", lambda p: _zip(p / "evil.zip", {"ok.txt": b"1", "../../escaped.txt": b"x"})),
        ("zip-absolute", lambda p: _zip(p / "evil.zip", {"/tmp/escaped.txt": b"x"})),
        ("tar-dotdot", lambda p: _tar(p / "evil.tar.gz", lambda b: _tar_member(b, "a/../../escaped.txt"))),
        ("tar-absolute", lambda p: _tar(p / "evil.tar.gz", lambda b: _tar_member(b, "/tmp/escaped.txt"))),
        (
            "tar-symlink-out",
            lambda p: _tar(
                p / "evil.tar.gz", lambda b: _tar_member(b, "data/link", kind=tarfile.SYMTYPE, link="../../../etc")
            ),
        ),
        (
            "tar-symlink-absolute",
            lambda p: _tar(
                p / "evil.tar.gz", lambda b: _tar_member(b, "data/link", kind=tarfile.SYMTYPE, link="/etc/passwd")
            ),
        ),
        (
            "tar-hardlink-out",
            lambda p: _tar(
                p / "evil.tar.gz", lambda b: _tar_member(b, "data/hard", kind=tarfile.LNKTYPE, link="../outside")
            ),
        ),
    ],
)
def test_members_escaping_the_target_stop_extraction(tmp_path, name, build):
    archive = build(tmp_path)
    with pytest.raises(UserError, match="refusing to extract"):
        extract(archive, tmp_path / "work" / "out", say=quiet)
    assert not (tmp_path / "work" / "out").exists()
    assert not any(p.name == "escaped.txt" for p in tmp_path.rglob("*"))


def test_corrupt_and_truncated_archives_name_the_file(tmp_path):
    good = _zip(tmp_path / "good.zip", {f"d/{i}.bin": os.urandom(20000) for i in range(5)})
    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(good.read_bytes()[:30000])
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"definitely not an archive" * 100)
    tgz = _tar(tmp_path / "full.tar.gz", lambda b: [_tar_member(b, f"d/{i}", os.urandom(50000)) for i in range(4)])
    cut_tgz = tmp_path / "cut.tar.gz"
    cut_tgz.write_bytes(tgz.read_bytes()[: len(tgz.read_bytes()) // 2])
    crc = bytearray(good.read_bytes())
    crc[200] ^= 0xFF  # flip a byte inside the first member's data
    bad_crc = tmp_path / "badcrc.zip"
    bad_crc.write_bytes(bytes(crc))
    for archive in (truncated, garbage, cut_tgz, bad_crc):
        with pytest.raises(UserError, match=archive.name) as err:
            extract(archive, tmp_path / f"out-{archive.name}", say=quiet)
        assert "download again" in str(err.value) or "--from" in str(err.value)
        assert not (tmp_path / f"out-{archive.name}").exists()
