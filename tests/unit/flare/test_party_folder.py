"""Where a FLARE party keeps its secrets: its site config dir, or ``$FEDSSL_SECRETS_DIR/<its name>/`` (the
simulator)."""

import os

import pytest

from fedssl.flare.party_folder import SECRETS_DIR_ENV, flare_party_secret, party_folder
from tests.unit.flare.fakes import FakeEngine, context


@pytest.fixture(autouse=True)
def no_secrets_dir(monkeypatch):
    monkeypatch.delenv(SECRETS_DIR_ENV, raising=False)


def test_a_deployed_party_uses_its_site_config_dir(tmp_path):
    local = tmp_path / "site-1" / "local"
    ctx = context(engine=FakeEngine(local), site="site-1")
    assert party_folder(ctx, "X") == str(local)
    secret = flare_party_secret(ctx, "noise", "X")
    assert (local / "noise.secret").read_text() == f"{secret:032x}\n"


def test_the_simulator_case_uses_a_subfolder_per_party(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRETS_DIR_ENV, str(tmp_path / "ws_secrets"))
    server = context(engine=FakeEngine(tmp_path / "ws" / "server" / "local"), site="server")
    site = context(engine=FakeEngine(tmp_path / "ws" / "site-1" / "local"), site="site-1")
    assert party_folder(server, "X") == str(tmp_path / "ws_secrets" / "server")
    assert party_folder(site, "X") == str(tmp_path / "ws_secrets" / "site-1")
    assert flare_party_secret(server, "noise", "X") != flare_party_secret(site, "noise", "X")
    assert not (tmp_path / "ws").exists()  # nothing in the workspace the simulator clears


@pytest.mark.parametrize("name", ["", "..", "../site-2", "a/b"])
def test_a_party_name_that_is_no_folder_name_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.setenv(SECRETS_DIR_ENV, str(tmp_path))
    ctx = context(site=name) if name else context()
    with pytest.raises(RuntimeError, match=f"Shuttle: party name {name!r} is no folder name under {SECRETS_DIR_ENV}"):
        party_folder(ctx, "Shuttle")


def test_a_relative_secrets_dir_is_refused(monkeypatch):
    """The simulator moves each party into its own working directory: a relative path would point elsewhere."""
    monkeypatch.setenv(SECRETS_DIR_ENV, "ws_secrets")
    with pytest.raises(RuntimeError, match=f"Shuttle: {SECRETS_DIR_ENV}=ws_secrets is not an absolute path"):
        party_folder(context(site="server"), "Shuttle")


def test_without_an_engine_there_is_no_folder(tmp_path):
    with pytest.raises(RuntimeError, match="Shuttle: no FLARE engine in the context"):
        party_folder(context(site="server"), "Shuttle")
    assert os.listdir(tmp_path) == []
