"""Helpers shared by the data tests."""

import hashlib
import os


def tree_digests(root) -> dict[str, str]:
    """relative path -> md5 of every file under ``root``."""
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = hashlib.md5(fh.read()).hexdigest()
    return out
