"""`.ci/run` runs exactly the test command the README gives a newcomer (developers' guide: a green CI that depends
on something installed by hand is a broken build), and that command installs the test extras it uses."""

from __future__ import annotations

import configparser
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    commands = [b.strip() for b in blocks if "pytest" in b]
    assert commands, "README.md has no ```bash block with the pytest command"
    return commands[0]


def test_ci_runs_the_readme_test_command():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [_readme_test_command()]


def test_the_test_extras_hold_the_plugins_the_command_uses():
    command = _readme_test_command()
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]["test"]
    assert '".[test]"' in command
    if re.search(r"pytest .*-n \w+", command):  # worker processes come from pytest-xdist
        assert "pytest-xdist" in extras
