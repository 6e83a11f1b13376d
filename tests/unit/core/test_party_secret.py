"""party_secret: a party's secret drawn once from the operating system into its own folder (mode 0600), read again
on every later use; another folder draws another; a file that cannot be trusted is refused in one line naming it."""

import os
import stat
import subprocess
import sys

import pytest

from fedssl.core import party_secret as ps
from fedssl.core.party_secret import PartySecretError, party_secret

READ = "from fedssl.core.party_secret import party_secret; import sys; print(party_secret(sys.argv[1], 'noise'))"


def test_first_use_creates_a_private_file_that_later_uses_read_again(tmp_path):
    folder = tmp_path / "site-1" / "local"  # made on first use
    secret = party_secret(str(folder), "noise")
    path = folder / "noise.secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) & 0o077 == 0
    assert path.read_text() == f"{secret:032x}\n" and 0 <= secret < 2 ** 128
    assert party_secret(str(folder), "noise") == secret and path.read_text() == f"{secret:032x}\n"
    assert sorted(os.listdir(folder)) == ["noise.secret"]  # no temporary file left behind


def test_another_process_on_the_same_folder_reads_the_same_secret_another_folder_draws_anew(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    mine = party_secret(str(tmp_path / "a"), "noise")
    other = subprocess.run([sys.executable, "-c", READ, str(tmp_path / "a")], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert int(other) == mine
    fresh = subprocess.run([sys.executable, "-c", READ, str(tmp_path / "b")], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert int(fresh) != mine and int(fresh) == party_secret(str(tmp_path / "b"), "noise")
    assert party_secret(str(tmp_path / "a"), "order") != mine  # another name, another draw


def test_a_process_that_loses_the_race_keeps_the_winners_secret(tmp_path):
    """Both saw no file; the first published its secret; the second's creation must neither overwrite it nor fail."""
    folder = str(tmp_path)
    won = party_secret(folder, "noise")
    ps._create(folder, os.path.join(folder, "noise.secret"))  # the late process's own attempt
    assert party_secret(folder, "noise") == won and os.listdir(folder) == ["noise.secret"]


def test_the_secret_comes_from_the_operating_system_not_a_seed(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(ps.secrets, "randbits", lambda bits: drawn.append(bits) or 0xABC)
    assert party_secret(str(tmp_path), "noise") == 0xABC and drawn == [128]
    assert (tmp_path / "noise.secret").read_text() == "0" * 29 + "abc\n"


@pytest.mark.parametrize("content, problem", [
    (b"", "0 bytes"), (b"1234\n", "5 bytes"), (b"0" * 32, "32 bytes"), (b"0" * 33 + b"\n", "34 bytes"),
    (b"g" * 32 + b"\n", "33 bytes"), (b"0" * 31 + b"A\n", "33 bytes"), (b"0" * 32 + b"\r", "33 bytes"),
])
def test_a_corrupt_file_is_refused_in_one_line_naming_it(tmp_path, content, problem):
    path = tmp_path / "noise.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(PartySecretError) as e:
        party_secret(str(tmp_path), "noise")
    msg = str(e.value)
    assert str(path) in msg and problem in msg and "delete it" in msg and "\n" not in msg
    assert path.read_bytes() == content  # never silently replaced


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_file_open_to_group_or_others_is_refused(tmp_path, mode):
    secret = party_secret(str(tmp_path), "noise")
    path = tmp_path / "noise.secret"
    os.chmod(path, mode)
    with pytest.raises(PartySecretError, match=f"{path} has mode {mode:04o}, open to group/others"):
        party_secret(str(tmp_path), "noise")
    os.chmod(path, 0o600)
    assert party_secret(str(tmp_path), "noise") == secret


def test_a_link_or_folder_in_place_of_the_file_is_refused(tmp_path):
    party_secret(str(tmp_path / "other"), "noise")
    (tmp_path / "mine").mkdir()
    os.symlink(tmp_path / "other" / "noise.secret", tmp_path / "mine" / "noise.secret")
    with pytest.raises(PartySecretError, match="mine/noise.secret cannot be read"):
        party_secret(str(tmp_path / "mine"), "noise")
    (tmp_path / "dir" / "noise.secret").mkdir(parents=True)
    with pytest.raises(PartySecretError, match="dir/noise.secret"):
        party_secret(str(tmp_path / "dir"), "noise")


@pytest.mark.parametrize("folder, name", [("", "noise"), (None, "noise"), ("x", "../noise"), ("x", ".noise"),
                                          ("x", "a/b"), ("x", ""), ("x", 3)])
def test_arguments_are_checked(tmp_path, folder, name):
    with pytest.raises(ValueError, match="party_secret: "):
        party_secret(folder if folder is None or folder == "" else str(tmp_path / folder), name)
