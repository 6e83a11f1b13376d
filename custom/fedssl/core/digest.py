"""SHA-256 of a file: how the run summary names the exact initial weights a run started from (issue 13 item 2).

A path alone does not say which weights were used (files get replaced); the digest does, so two runs can be
compared and a reader can check a local copy against the one a run used.
"""

from __future__ import annotations

import hashlib

#: bytes read at a time: a ViT-B checkpoint (about 330 MB) is hashed without being held in memory
CHUNK = 1 << 20


def file_sha256(path: str) -> str:
    """Hex SHA-256 of the file's bytes; an unreadable file is a ValueError naming it."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                digest.update(block)
    except OSError as e:
        raise ValueError(f"cannot read {path} to record its SHA-256 ({type(e).__name__}: {e})") from None
    return digest.hexdigest()
