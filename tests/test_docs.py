"""The documentation's checks (issue 43): README.md is a front page of at most 15 KB, and in every page (README.md,
jobs/**/*.md, provisioning/**/*.md and any other tracked Markdown outside tests/)

- every relative link ``[x](path)`` / ``[x](path#anchor)`` resolves to a file or folder next to the page, and an anchor
  names a heading of the target page (GitHub's slug rules);
- every ``fedssl ...`` / ``nvflare ...`` command quoted in a code block or in inline code parses: its verb path takes
  ``--help`` (fedssl in-process through ``fedssl.cli.main``, nvflare once per verb in a subprocess), fedssl's whole
  argument list goes through the real parser (placeholders such as ``<kit>`` read as a dummy value), and every option
  given to nvflare appears in that verb's help;
- no machine-local path (``/work/``, ``/tmp/``, ``/root/``, ``/home/``, a home folder, ``C:\\``) appears.

Each checker is also run on a small fake page with one fault of each kind, which it must report."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_BYTES = 15 * 1024

# ---------------------------------------------------------------------------------------------------- the pages


def doc_pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """README.md, every Markdown file under jobs/ and provisioning/, and every other tracked *.md outside tests/."""
    pages = {root / "README.md"} if (root / "README.md").is_file() else set()
    for folder in ("jobs", "provisioning"):
        if (root / folder).is_dir():
            pages.update(p for p in (root / folder).rglob("*.md") if p.is_file())
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.md"], cwd=root, capture_output=True, text=True,
                                check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    for rel in filter(None, listed.split("\0")):
        if pathlib.PurePosixPath(rel).parts[0] not in ("tests", ".git") and (root / rel).is_file():
            pages.add(root / rel)
    return sorted(pages)


def readme_size_problem(readme: pathlib.Path, limit: int = README_MAX_BYTES) -> str | None:
    size = readme.stat().st_size
    return f"{readme.name} is {size} bytes, more than {limit} ({limit // 1024} KB)" if size > limit else None


# ------------------------------------------------------------------------------------------- reading Markdown

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def split_markdown(text: str) -> tuple[str, list[tuple[int, list[str]]]]:
    """(the prose, with every fenced block's lines blanked so offsets keep their line numbers; the fenced blocks as
    (line number of their first body line, body lines))."""
    prose, blocks, fence, body, start = [], [], None, [], 0
    for number, line in enumerate(text.split("\n"), start=1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence, body, start = m.group(1), [], number + 1
            prose.append("")
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
                blocks.append((start, body))
                fence = None
            else:
                body.append(line)
            prose.append("")
        else:
            prose.append(line)
    if fence is not None:  # an unclosed fence runs to the end of the page
        blocks.append((start, body))
    return "\n".join(prose), blocks


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def inline_code(prose: str) -> list[tuple[int, str]]:
    """Inline code spans as (line number, content); a span may wrap within its paragraph."""
    spans = []
    for m in _INLINE_CODE.finditer(prose):
        if "\n\n" not in m.group(2):
            spans.append((_line_of(prose, m.start()), " ".join(m.group(2).split())))
    return spans


def _without_inline_code(prose: str) -> str:
    return _INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)


# ----------------------------------------------------------------------------------------------------- links

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup reduced to its text, lower case, punctuation other than '-' and '_'
    dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(text: str) -> list[str]:
    prose_lines = split_markdown(text)[0].split("\n")
    found = []
    for i, line in enumerate(prose_lines):
        m = _ATX.match(line)
        if m:
            found.append(m.group(2) or "")
        elif i and _SETEXT.match(line) and prose_lines[i - 1].strip() and not _ATX.match(prose_lines[i - 1]) \
                and not prose_lines[i - 1].lstrip().startswith(("|", "-", "*", "+", ">")):
            found.append(prose_lines[i - 1].strip())
    return found


def anchors(text: str) -> set[str]:
    """Every heading's slug, a repeated heading numbered as GitHub does (slug, slug-1, slug-2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(text):
        slug = github_slug(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def link_targets(text: str) -> list[tuple[int, str]]:
    prose = _without_inline_code(split_markdown(text)[0])
    targets = [(_line_of(prose, m.start()), m.group(1)) for m in _LINK.finditer(prose)]
    targets += [(_line_of(prose, m.start()), m.group(1)) for m in _REFERENCE.finditer(prose)]
    return sorted(targets)


def link_problems(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Each relative link of ``page`` that does not resolve: a missing file or folder, a path that leaves the
    repository, or an anchor that is no heading of the target Markdown page."""
    problems = []
    text = page.read_text(encoding="utf-8")
    for line, target in link_targets(text):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto, ...: not checked here
        path, _, anchor = target.partition("#")
        path, anchor = urllib.parse.unquote(path), urllib.parse.unquote(anchor)
        where = f"{page.relative_to(root) if page.is_relative_to(root) else page}:{line}: link {target!r}"
        resolved = (page.parent / path).resolve() if path else page.resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{where} leaves the repository")
            continue
        if not resolved.exists():
            problems.append(f"{where}: {path} does not exist")
            continue
        if not anchor:
            continue
        if resolved.is_dir():
            resolved = resolved / "README.md"
            if not resolved.is_file():
                problems.append(f"{where}: an anchor on a folder without README.md")
                continue
        if resolved.suffix.lower() == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            problems.append(f"{where}: no heading '#{anchor}' in {resolved.name}")
    return problems


# -------------------------------------------------------------------------------------------------- commands

_PLACEHOLDER = re.compile(r"<[^<>\n]+>")
_SEPARATORS = {"&&", "||", ";", "|", "&", ";;"}
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_MENTIONS = re.compile(r"\b(fedssl|nvflare)\b")


def _logical_lines(body: list[str], first: int) -> list[tuple[int, str]]:
    """A block's lines with backslash continuations joined, each with the number of its first line."""
    out, pending, start = [], "", first
    for number, line in enumerate(body, start=first):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            out.append((start, pending + line))
            pending = ""
    if pending:
        out.append((start, pending))
    return out


def _simple_commands(line: str) -> list[list[str]]:
    """Split one shell line into simple commands (at && || ; | &), redirections dropped; raises ValueError on a
    line shlex cannot read."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, words, skip = [], [], False
    for token in lexer:
        if skip:
            skip = False
        elif token in _SEPARATORS:
            commands.append(words)
            words = []
        elif set(token) <= set("<>&"):  # a redirection: drop it and its target
            if words and words[-1].isdigit():
                words.pop()
            skip = True
        else:
            words.append(token)
    commands.append(words)
    return [c for c in commands if c]


def _as_fedssl_or_nvflare(words: list[str]) -> tuple[str, list[str]] | None:
    words = list(words)
    if words and words[0] == "$":
        words = words[1:]
    while words and _ENV.match(words[0]):
        words = words[1:]
    if words and words[0] in ("fedssl", "nvflare"):
        return words[0], words[1:]
    if len(words) >= 3 and re.fullmatch(r"python3?(\.\d+)?", words[0]) and words[1:3] == ["-m", "fedssl.cli"]:
        return "fedssl", words[3:]
    return None


def quoted_commands(text: str) -> list[tuple[int, str, list[str], bool, str]]:
    """Every quoted fedssl / nvflare command: (line, program, its words, inline?, the quoted text). Placeholders
    such as ``<kit>`` read as ``1``, a value every argument type here accepts."""
    prose, blocks = split_markdown(text)
    candidates = [(line, code, True) for line, code in inline_code(prose)]
    for first, body in blocks:
        candidates += [(line, code, False) for line, code in _logical_lines(body, first)]
    found = []
    for line, code, inline in candidates:
        if not _MENTIONS.search(code):
            continue
        quoted = re.sub(r"^\s*\$\s+", "", code.strip())
        try:
            commands = _simple_commands(_PLACEHOLDER.sub("1", quoted))
        except ValueError as e:  # unbalanced quotes: a problem only where a command starts the line
            if re.match(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(fedssl|nvflare)\b", quoted):
                found.append((line, "shell", [str(e)], inline, quoted))
            continue
        for words in commands:
            command = _as_fedssl_or_nvflare(words)
            if command:
                found.append((line, command[0], command[1], inline, quoted))
    return found


@functools.lru_cache(maxsize=1)
def fedssl_parser() -> argparse.ArgumentParser:
    """The parser ``fedssl.cli.main`` builds, built the same way but never run."""
    from fedssl import cli

    parser = argparse.ArgumentParser(prog="fedssl")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for module in cli.COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def fedssl_verb_path(words: list[str]) -> tuple[list[str], list[str]]:
    """(the leading words that name (sub)commands, the rest)."""
    parser, path = fedssl_parser(), []
    for word in words:
        choices = _subcommands(parser)
        if word not in choices:
            break
        path.append(word)
        parser = choices[word]
    return path, words[len(path):]


@functools.lru_cache(maxsize=None)
def fedssl_help_problem(path: tuple[str, ...]) -> str | None:
    """``fedssl <path> --help`` through ``fedssl.cli.main``: None when it prints the help and exits 0."""
    from fedssl.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            main([*path, "--help"])
    except SystemExit as e:
        if e.code in (0, None):
            return None
        return f"exits {e.code}: {' '.join(err.getvalue().split())[-300:]}"
    except Exception as e:  # noqa: BLE001 - a crashing help text is what this check is for
        return f"crashes: {type(e).__name__}: {e}"
    return "returned instead of printing the help"


def _unknown_options(words: list[str]) -> list[str]:
    """The options in ``words`` that the verb's parser does not take (argparse's unambiguous prefixes allowed)."""
    parser = fedssl_parser()
    for word in fedssl_verb_path(words)[0]:
        parser = _subcommands(parser)[word]
    known = parser._option_string_actions
    unknown = []
    for word in words:
        if word == "--":
            break
        if re.match(r"^--?[A-Za-z]", word):
            flag = word.split("=", 1)[0]
            if flag not in known and not (flag.startswith("--") and any(k.startswith(flag) for k in known)):
                unknown.append(flag)
    return unknown


def fedssl_parse_problem(words: list[str], partial_ok: bool) -> str | None:
    """The whole argument list through the real parser: None when it parses (``partial_ok``: an inline mention may
    leave required arguments out)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            fedssl_parser().parse_args(words)
    except SystemExit as e:
        if e.code in (0, None):
            return None
        message = " ".join(err.getvalue().split())
        if partial_ok and "the following arguments are required" in message:  # the options given must still exist
            unknown = _unknown_options(words)
            return f"does not parse: unknown options {unknown}" if unknown else None
        return f"does not parse: {message[-300:]}"
    except Exception as e:  # noqa: BLE001
        return f"does not parse: {type(e).__name__}: {e}"
    return None


def _nvflare() -> list[str]:
    found = shutil.which("nvflare")
    return [found] if found else [sys.executable, "-m", "nvflare.cli"]


@functools.lru_cache(maxsize=None)
def nvflare_help(path: tuple[str, ...]) -> tuple[int, str]:
    """(exit code, output) of ``nvflare <path> --help``, once per verb path."""
    try:
        r = subprocess.run([*_nvflare(), *path, "--help"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    return r.returncode, r.stdout + r.stderr


def nvflare_problem(words: list[str]) -> str | None:
    """The verb path takes ``--help`` (exit 0), and every option given appears in that help."""
    path: list[str] = []
    for word in words:
        if word.startswith("-"):
            break
        if path:  # a further verb only where the current one lists it as a subcommand
            usage = nvflare_help(tuple(path))[1]
            choices = {c for group in re.findall(r"\{([\w,-]+)\}", usage) for c in group.split(",")}
            if word not in choices:
                break
        path.append(word)
    if not path:
        return "names no nvflare verb" if words and words[0] not in ("-h", "--help", "-V", "--version") else None
    code, output = nvflare_help(tuple(path))
    if code != 0:
        return f"'nvflare {' '.join(path)} --help' exits {code}: {' '.join(output.split())[-300:]}"
    unknown = [w.split("=", 1)[0] for w in words[len(path):] if re.match(r"^--?[A-Za-z]", w)
               and not re.search(rf"(?<![\w-]){re.escape(w.split('=', 1)[0])}(?![\w-])", output)]
    return f"options not in 'nvflare {' '.join(path)} --help': {unknown}" if unknown else None


def command_problems(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    problems = []
    name = page.relative_to(root) if page.is_relative_to(root) else page
    for line, program, words, inline, quoted in quoted_commands(page.read_text(encoding="utf-8")):
        where = f"{name}:{line}: {quoted!r}"
        if program == "shell":
            problems.append(f"{where}: unreadable shell line ({words[0]})")
        elif program == "nvflare":
            problem = nvflare_problem(words)
            if problem:
                problems.append(f"{where}: {problem}")
        else:
            path, rest = fedssl_verb_path(words)
            problem = fedssl_help_problem(tuple(path))
            if problem:
                problems.append(f"{where}: 'fedssl {' '.join(path)} --help' {problem}")
            elif rest:
                problem = fedssl_parse_problem(words, partial_ok=inline)
                if problem:
                    problems.append(f"{where}: {problem}")
    return problems


# ---------------------------------------------------------------------------------------- machine-local paths

MACHINE_PATH = re.compile(r"(?<![\w.~$}/-])(?:/(?:work|tmp|root|home|Users)(?![\w.-])|~/)|\b[A-Za-z]:\\")


def machine_path_problems(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    name = page.relative_to(root) if page.is_relative_to(root) else page
    return [f"{name}:{number}: machine-local path {m.group(0)!r} in: {line.strip()[:120]}"
            for number, line in enumerate(page.read_text(encoding="utf-8").split("\n"), start=1)
            for m in MACHINE_PATH.finditer(line)]


# ------------------------------------------------------------------------------------------------------ tests

PAGES = doc_pages()


def _id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_pages_are_found():
    names = {_id(p) for p in PAGES}
    assert {"README.md", "jobs/README.md", "provisioning/README.md"} <= names, names


def test_readme_is_a_front_page_of_at_most_15_kb():
    assert readme_size_problem(ROOT / "README.md") is None


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_relative_link_resolves(page):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_quoted_command_parses(page):
    problems = command_problems(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_no_machine_local_path(page):
    problems = machine_path_problems(page)
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------- the checkers fail where they should

FAKE_PAGE = """# Fake page

## Usage: the `demo` verb

[fine](other.md), [fine too](other.md#a-heading-with-punctuation_and-code), [folder](sub/),
[this page](#usage-the-demo-verb), [web](https://example.org/missing.md), [mail](mailto:a@b.org)
[missing file](nowhere.md) and [missing anchor](other.md#no-such-heading) and ![missing image](img/x.png)
[escape](../../outside.md)

[ref]: missing_reference.md

```bash
fedssl fcl demo --out runs/demo                  # fine
fedssl fcl nosuchverb
fedssl fcl demo --no-such-option
FEDSSL_DATA_ROOT="$PWD/d/{site}" nvflare simulator runs/job -w runs/ws -n 2 -t 2
nvflare simulator runs/job --no-such-flag
```

Inline: `fedssl site-local <kit>/local`, `fedssl fcl synth acdc`, `fedssl fcl finetune --bogus 1`,
`fedssl simulate` and `[not a link](nowhere_in_code.md)`.

Paths: /work/runs/cal2, `/tmp/ws_fcl`, (/root/.cache), /home/someone, ~/data, C:\\Users\\me; fine: runs/tmp/x,
$PWD/tmp/y, {site}/home/z, /data/acdc.
"""


def _fake(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "sub").mkdir()
    (tmp_path / "other.md").write_text("# Other\n\n### A heading, with punctuation_and `code`!\n")
    page = tmp_path / "fake.md"
    page.write_text(FAKE_PAGE)
    return page


def test_broken_links_and_anchors_are_reported(tmp_path):
    problems = "\n".join(link_problems(_fake(tmp_path), root=tmp_path))
    for bad in ("'nowhere.md'", "no heading '#no-such-heading'", "'img/x.png'", "'missing_reference.md'",
                "'../../outside.md' leaves the repository"):
        assert bad in problems, (bad, problems)
    for good in ("'other.md'", "a-heading-with-punctuation_and-code", "'sub/'", "usage-the-demo-verb",
                 "example.org", "mailto", "nowhere_in_code"):
        assert good not in problems, (good, problems)


def test_github_slugs():
    assert github_slug("3D segmentation: `jobs/acdc_seg3d`") == "3d-segmentation-jobsacdc_seg3d"
    assert github_slug("Authorisation: BYOC is off for every role; the class allow-list") == \
        "authorisation-byoc-is-off-for-every-role-the-class-allow-list"
    assert github_slug("Reproducing the paper's tables") == "reproducing-the-papers-tables"
    assert anchors("# A\n\n## A\n\nB\n---\n") == {"a", "a-1", "b"}


def test_bad_commands_are_reported(tmp_path):
    problems = command_problems(_fake(tmp_path), root=tmp_path)
    text = "\n".join(problems)
    assert "fedssl fcl nosuchverb" in text and "invalid choice: 'nosuchverb'" in text, text
    assert "--no-such-option" in text and "unrecognized arguments" in text, text
    assert "--no-such-flag" in text and "options not in 'nvflare simulator --help'" in text, text
    assert "--bogus" in text, text
    assert len(problems) == 4, text  # the good block lines, placeholders, partial inline mentions and verbs pass


def test_a_crashing_help_text_is_reported(monkeypatch):
    import fedssl.cli

    def crash(argv):
        raise ValueError("unsupported format character '(' (0x28) at index 104")

    monkeypatch.setattr(fedssl.cli, "main", crash)
    fedssl_help_problem.cache_clear()
    try:
        assert "crashes: ValueError: unsupported format character" in fedssl_help_problem(("fedclf",))
    finally:
        fedssl_help_problem.cache_clear()


def test_machine_local_paths_are_reported(tmp_path):
    found = machine_path_problems(_fake(tmp_path), root=tmp_path)
    problems = "\n".join(found)
    for bad in ("'/work'", "'/tmp'", "'/root'", "'/home'", "'~/'", "'C:\\\\'"):
        assert bad in problems, (bad, problems)
    assert len(found) == 6, problems  # runs/tmp/x, $PWD/tmp/y, {site}/home/z and /data/acdc pass


def test_an_oversized_readme_is_reported(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_bytes(b"x" * README_MAX_BYTES)
    assert readme_size_problem(readme) is None
    readme.write_bytes(b"x" * (README_MAX_BYTES + 1))
    assert "more than 15360 (15 KB)" in readme_size_problem(readme)
