import json

import pytest

from fedssl.data.site_config import ENV_DATA_ROOT, SITE_CONFIG_FILE, resolve_data_root


def test_order_argument_then_site_config_then_env(tmp_path, monkeypatch):
    for d in ("arg", "cfg", "env", "env_site-2"):
        (tmp_path / d).mkdir()
    local = tmp_path / "local"
    local.mkdir()
    monkeypatch.setenv(ENV_DATA_ROOT, str(tmp_path / "env_{site}"))
    assert resolve_data_root("", "site-2", str(local)) == str(tmp_path / "env_site-2")
    (local / SITE_CONFIG_FILE).write_text(json.dumps({"data_root": str(tmp_path / "cfg")}))
    assert resolve_data_root("", "site-2", str(local)) == str(tmp_path / "cfg")
    assert resolve_data_root(str(tmp_path / "arg"), "site-2", str(local)) == str(tmp_path / "arg")


def test_missing_root_names_site_and_path(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_DATA_ROOT, raising=False)
    with pytest.raises(ValueError, match="site-1: no data root configured"):
        resolve_data_root("", "site-1", str(tmp_path))
    with pytest.raises(ValueError, match=r"site-1: data root .*nope.* is not a directory"):
        resolve_data_root(str(tmp_path / "nope"), "site-1")


def test_corrupt_site_config(tmp_path):
    (tmp_path / SITE_CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_data_root("", "site-1", str(tmp_path))
