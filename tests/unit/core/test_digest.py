"""file_sha256: the digest of the bytes, read in chunks; an unreadable path is named."""

import hashlib

import pytest

from fedssl.core import digest
from fedssl.core.digest import file_sha256


def test_digest_of_a_file_larger_than_one_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "CHUNK", 4)
    path = tmp_path / "w.pt"
    path.write_bytes(b"0123456789")
    assert file_sha256(str(path)) == hashlib.sha256(b"0123456789").hexdigest()


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nowhere.pt"):
        file_sha256(str(tmp_path / "nowhere.pt"))
