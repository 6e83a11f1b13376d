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


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]


def test_ci_runs_the_readme_test_command():
    assert _ci_commands()[-1] == _readme_test_command()


def test_ci_runs_it_in_a_fresh_virtual_environment():
    """A new venv made in a new folder and activated before anything is installed: a package left on the machine by
    hand (scipy was) cannot make CI pass.  The venv must not see the system's site-packages."""
    commands = _ci_commands()
    made = [i for i, c in enumerate(commands) if re.match(r'python3 -m venv "\$VENV"$', c)]
    activated = [i for i, c in enumerate(commands) if c == 'source "$VENV/bin/activate"']
    assert made and activated and made[0] < activated[0] < len(commands) - 1, commands
    assert any(re.match(r'VENV="\$\(mktemp -d\)/venv"$', c) for c in commands[:made[0]]), commands
    assert not any("system-site-packages" in c for c in commands)


def test_the_test_extras_hold_the_plugins_the_command_uses():
    command = _readme_test_command()
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]["test"]
    assert '".[test]"' in command
    if re.search(r"pytest .*-n \w+", command):  # worker processes come from pytest-xdist
        assert "pytest-xdist" in extras
