"""A party's own secret, kept in its own folder: drawn once from the operating system, read again on every run.

Randomness that protects privacy (a site's feature noise, the server's remote-bank order) must come from a secret
that no other party and no job configuration knows, or the receiver could regenerate it.  Drawn afresh in every
run, it also made every such run unrepeatable.  :func:`party_secret` keeps it in a file of the party's own folder
(``<folder>/<name>.secret``: 32 hex digits and a newline, 128 bits from ``secrets``, mode 0600), created on first
use and read on every later one, so the same party in the same folder repeats its draws, and a new folder (or
another party) draws a new secret.  Nothing here derives a secret from a seed or from another secret.

The file is written to a private temporary file and published with ``os.link``, which fails if the name exists:
two processes racing on a new folder both end up reading the one secret that won, never half a file.
"""

from __future__ import annotations

import os
import re
import secrets
import stat

#: bits of every secret
SECRET_BITS = 128
#: the file's content: the secret as 32 lowercase hex digits, then a newline
_FORMAT = re.compile(rb"[0-9a-f]{32}\n")
_SIZE = SECRET_BITS // 4 + 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class PartySecretError(RuntimeError):
    """A secret file that cannot be trusted (wrong size or format, readable by others); one line naming it."""


def party_secret(folder: str, name: str) -> int:
    """The 128-bit secret ``name`` of the party whose own folder is ``folder``: read from ``<folder>/<name>.secret``,
    or drawn from ``secrets`` and written there (mode 0600, the folder made with mode 0700) if the file is absent.
    Raises :class:`PartySecretError` if the file has the wrong size or format or any permission for group/others."""
    if not isinstance(folder, str) or not folder:
        raise ValueError(f"party_secret: folder={folder!r} is not a folder path; pass the party's own folder")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"party_secret: name={name!r} is not a plain file name; use letters, digits, '_', '.', '-'")
    path = os.path.join(folder, name + ".secret")
    if not os.path.lexists(path):
        _create(folder, path)
    return _read(path)


def _create(folder: str, path: str) -> None:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(f"{secrets.randbits(SECRET_BITS):032x}\n".encode())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic: fails if another process published its secret first, then that one holds
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def _read(path: str) -> int:
    fix = "delete it to draw a new secret (this party's draws then change)"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise PartySecretError(f"party secret {path} cannot be read ({e.strerror}); {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PartySecretError(f"party secret {path} is not a regular file; {fix}")
        if st.st_mode & 0o077:
            raise PartySecretError(f"party secret {path} has mode {stat.S_IMODE(st.st_mode):04o}, open to "
                                   f"group/others; restrict it (chmod 600) if no one else has read it, else {fix}")
        data = os.read(fd, _SIZE + 1)
    finally:
        os.close(fd)
    if len(data) != _SIZE or not _FORMAT.fullmatch(data):
        raise PartySecretError(f"party secret {path} is not {SECRET_BITS // 4} hex digits and a newline "
                               f"({len(data)} bytes); {fix}")
    return int(data[:-1], 16)
