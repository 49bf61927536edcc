"""README.md is a front door: short, its links and the docs pages' links resolve, and its test
command is the one CI runs (.ci/run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
MAX_README_LINES = 250
TEST_COMMAND = "bash tools/in_venv.sh python -m pytest tests"
FRONT_DOOR_PAGES = ["commands.md", "config.md", "models.md", "conversion.md", "reward-model.md", "sft.md",
                    "ppo.md", "multi-agent.md", "rollouts.md", "scaling.md", "checkpoints.md",
                    "monitoring.md", "planner.md", "benchmarks.md", "testing.md", "architecture.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    return LINK.findall(_prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` that name no file or folder, or no heading of a markdown file."""
    bad = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.name}")
    return bad


def test_the_link_checker_sees_links_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: (with) punctuation\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#a-code-heading-with-punctuation) [ok](#top)\n"
                    "# Top\n[bad](missing.md) [bad](other.md#nope) `[not a link](missing.md)`\n"
                    "```\n[not a link](missing2.md)\n```\n[web](https://example.com/x.md)\n")
    assert broken_links(page) == ["missing.md: no such file",
                                  "other.md#nope: no heading with that anchor in other.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_readme_fits_on_a_few_screens():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; the reference belongs in docs/"


def test_the_readme_links_its_docs_pages():
    linked = {t.partition("#")[0] for t in links(README.read_text(encoding="utf-8"))
              if t.startswith("docs/")}
    missing = sorted(f"docs/{name}" for name in FRONT_DOOR_PAGES if f"docs/{name}" not in linked)
    assert missing == [], f"README.md does not link {missing}"
    assert all((REPO / page).is_file() for page in linked)


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = README.read_text(encoding="utf-8")
    setup = re.search(r"^## Set-up: two commands\n.*?```bash\n(.*?)```", readme, re.M | re.S)
    assert setup, "README.md lost its 'Set-up: two commands' block"
    commands = [line.split("#")[0].strip() for line in setup.group(1).splitlines() if line.strip()]
    assert commands == ["bash tools/in_venv.sh megatron-rlhf demo", TEST_COMMAND]
    tests_section = readme.split("\n## Tests\n", 1)
    assert len(tests_section) == 2 and f"`{TEST_COMMAND}`" in tests_section[1]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if "pytest" in line and not line.lstrip().startswith(("#", "echo"))]
    assert ci == [TEST_COMMAND], ci
