"""The one atomic write and the one file hash (covidxray/files.py), and the run folder's checkpoint pointer."""

from __future__ import annotations

import hashlib
import json

import pytest

from covidxray.errors import UserError
from covidxray.files import atomic_open, atomic_path, atomic_write, sha256_file
from covidxray.run_folder import read_latest, write_latest


def test_a_failed_write_leaves_the_old_file_and_no_partial(tmp_path):
    target = tmp_path / "report.json"
    atomic_write(target, "old")
    with pytest.raises(RuntimeError), atomic_open(target) as handle:
        handle.write("half of the new")
        raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_the_new_content_appears_only_when_the_write_is_done(tmp_path):
    target = tmp_path / "shard.bin"
    atomic_write(target, b"old")
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # a reader meanwhile sees the old file whole
    assert target.read_bytes() == b"new" and not tmp.exists()


def test_a_folder_is_published_whole(tmp_path):
    target = tmp_path / "saved_model"
    with atomic_path(target) as tmp:
        (tmp / "variables").mkdir(parents=True)
        (tmp / "variables" / "data").write_text("weights")
    assert (target / "variables" / "data").read_text() == "weights" and not tmp.exists()


def test_sha256_file_is_the_sha256_of_the_bytes(tmp_path):
    payload = bytes(range(256)) * 9000  # over 2 MB: more than one read block
    (tmp_path / "f").write_bytes(payload)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(payload).hexdigest()


def test_checkpoint_pointer_round_trip_and_damage(tmp_path):
    assert read_latest(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    write_latest(tmp_path, {"epoch": 3, "path": "epoch-0003-ab12cd34", "best": {"epoch": 2}})
    assert read_latest(tmp_path) == {"epoch": 3, "path": "epoch-0003-ab12cd34", "best": {"epoch": 2}}
    (tmp_path / "checkpoints" / "latest.json").write_text(json.dumps({"epoch": "3"}))
    with pytest.raises(UserError, match="latest.json is damaged .* start over without --resume"):
        read_latest(tmp_path)
