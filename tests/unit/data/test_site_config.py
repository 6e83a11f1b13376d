import json

import pytest

from fedssl.data.site_config import ENV_DATA_ROOT, SITE_CONFIG_FILE, resolve_data_root, site_folders


def test_order_site_config_then_argument_then_env(tmp_path, monkeypatch):
    for d in ("arg", "cfg", "env", "env_site-2"):
        (tmp_path / d).mkdir()
    local = tmp_path / "local"
    local.mkdir()
    monkeypatch.setenv(ENV_DATA_ROOT, str(tmp_path / "env_{site}"))
    assert resolve_data_root("", "site-2", str(local)) == str(tmp_path / "env_site-2")
    assert resolve_data_root(str(tmp_path / "arg"), "site-2", str(local)) == str(tmp_path / "arg")
    (local / SITE_CONFIG_FILE).write_text(json.dumps({"data_root": str(tmp_path / "cfg")}))
    assert resolve_data_root("", "site-2", str(local)) == str(tmp_path / "cfg")
    # issue 45: a job that names a data root cannot point a site with its own config at other files
    assert resolve_data_root(str(tmp_path / "arg"), "site-2", str(local)) == str(tmp_path / "cfg")


def test_site_settings_beat_the_jobs(tmp_path):
    from fedssl.data.site_config import resolve_site_setting

    local = tmp_path / "local"
    local.mkdir()
    assert resolve_site_setting(["a", "b"], "classes", "site-1", str(local)) == (["a", "b"],
                                                                                 "executor argument classes")
    (local / SITE_CONFIG_FILE).write_text(json.dumps({"classes": {"site-1": ["own"]}}))
    value, source = resolve_site_setting(["a", "b"], "classes", "site-1", str(local))
    assert value == ["own"] and source.endswith(SITE_CONFIG_FILE)


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


def test_site_folders_in_site_number_order(tmp_path):
    for d in ("site-10", "site-2", "site-1", "site-b", "site-a", "other"):
        (tmp_path / d).mkdir()
    (tmp_path / "site-3").write_text("a file, not a site")
    found = site_folders(tmp_path)
    assert list(found) == ["site-1", "site-2", "site-10", "site-a", "site-b"]
    assert found["site-10"] == str(tmp_path / "site-10")


def test_site_folders_none_found(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(ValueError, match=r"no site-\* folder under .*data; run `make them`"):
        site_folders(tmp_path / "data", "run `make them`")
    assert site_folders(tmp_path / "data", required=False) == {}
    with pytest.raises(ValueError, match=r"data root .*nope is not a directory"):
        site_folders(tmp_path / "nope")
