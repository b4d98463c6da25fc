"""The documentation stays true: README.md and docs/*.md.

* Every relative link resolves to a file in the repository, and every `#anchor` to a
  heading of the page it names, by GitHub's slug rules (what a reader clicking it on the
  code host gets).
* Every page in docs/ is linked from the README's Documentation table.
* What the pages say that the code can check is the code's: the settings table names
  exactly the environment variables handler.py reads; the deploy page lists every
  template parameter with its default; the adoption table's ranges end at the last
  ledger file.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

import handler
from markdown_pages import DOCS, FENCE, ROOT, prose, table_column
from sam_template import load_template

# Uses no PostgreSQL (conftest.py holds it to that): CI's second pass leaves it out.
pytestmark = pytest.mark.no_database

PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (github-slugger): the rendered text, lower case,
    punctuation removed but for `-` and `_`, each space a `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, title in HEADING.findall(prose(markdown)):
        slug = github_slug(title)
        if slug in seen:
            seen[slug] += 1
            slug = f"{slug}-{seen[slug]}"
        else:
            seen[slug] = 0
        found.add(slug)
    return found


def links(markdown: str) -> list[str]:
    """The targets of the page's inline links and images, outside code."""
    return INLINE_LINK.findall(CODE_SPAN.sub("", prose(markdown)))


def broken_links(page: Path, markdown: str, root: Path = ROOT) -> list[str]:
    """What a reader of `page` would find broken: a relative link to no file, or out of
    the repository, or an anchor no heading of its page has."""
    broken = []
    for target in links(markdown):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.is_relative_to(root.resolve()):
            broken.append(f"{target}: outside the repository")
        elif not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked.read_text())):
            broken.append(f"{target}: no such heading")
    return broken


# --------------------------------------------------------------------------- the checker


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Run it locally with `sam local`", "run-it-locally-with-sam-local"),
        ("1. Put the RDS CA bundle in place", "1-put-the-rds-ca-bundle-in-place"),
        ("Cold starts (`bench/cold_start.py`)", "cold-starts-benchcold_startpy"),
        (
            "Deploys that cannot hang, and say why they failed",
            "deploys-that-cannot-hang-and-say-why-they-failed",
        ),
        ("The checkout's embedded PostgreSQL", "the-checkouts-embedded-postgresql"),
        ("What `migrate` refuses", "what-migrate-refuses"),
        ("A [linked](other.md) heading", "a-linked-heading"),
        ("Two  spaces", "two--spaces"),
    ],
)
def test_slugs_follow_githubs_rules(heading, slug):
    assert github_slug(heading) == slug


def test_the_checker_finds_each_kind_of_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Same\n\n## Same\n")
    page = tmp_path / "docs" / "page.md"
    markdown = """# Page

[fine](other.md#same-1) [fine](#page) [fine](https://example.com/x#y) `[not a](link.md)`

    [indented code](nowhere.md)

```sh
# not a heading
[fenced code](nowhere.md)
```

[missing file](nothing.md) [missing heading](other.md#same-2) [missing here](#not-a-heading)
[outside](../../elsewhere.md) [code heading](#not-a-heading-1)
"""
    page.write_text(markdown)
    assert broken_links(page, markdown, root=tmp_path) == [
        "nothing.md: no such file",
        "other.md#same-2: no such heading",
        "#not-a-heading: no such heading",
        "../../elsewhere.md: outside the repository",
        "#not-a-heading-1: no such heading",
    ]


# --------------------------------------------------------------------------- the pages


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page, page.read_text()) == []


def test_the_readme_is_a_landing_page_linking_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(readme)}
    pages = set(DOCS.glob("*.md"))
    assert len(pages) >= 10
    assert {page.resolve() for page in pages} - linked == set()


def test_every_docs_page_opens_with_a_title_and_its_reader():
    for page in DOCS.glob("*.md"):
        first, _, second = page.read_text().partition("\n\n")
        assert first.startswith("# ") and "\n" not in first, page.name
        assert second.startswith("For "), page.name


# --------------------------------------------------------------------------- claims the code checks


def test_the_settings_table_names_every_variable_handler_reads():
    source = (ROOT / "handler.py").read_text()
    setting = r"(?:\.get|_int_setting|_bool_setting)\(\s*(?:env,\s*)?\"([A-Z][A-Z0-9_]+)\""
    read = set(re.findall(setting, source))
    assert {"DATABASE_URL", "STALE_ANALYSIS_DAYS", "XDG_RUNTIME_DIR"} <= read
    read_by_powertools = {"LOG_LEVEL"}
    documented = set()
    for cell in table_column((DOCS / "configuration.md").read_text(), "## Settings"):
        documented |= {name.strip() for name in cell.split(",")}
    assert documented == read | read_by_powertools


def template_default(parameter: dict) -> str:
    if "Default" not in parameter:
        return "(required)"
    return f"`{parameter['Default']}`" if parameter["Default"] != "" else "empty"


def test_the_deploy_page_lists_every_template_parameter_with_its_default():
    parameters = load_template()["Parameters"]
    text = (DOCS / "deploy.md").read_text()
    section = text.split("\n## Parameters\n", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", section, re.MULTILINE)
    assert dict(rows) == {name: template_default(p) for name, p in parameters.items()}


def test_the_adoption_ranges_end_at_the_last_ledger_file():
    last = sorted(handler.SQL_DIR.glob("*.sql"))[-1].name[:3]
    text = (DOCS / "adopting.md").read_text()
    applied = table_column(text, "## What each state gets", column=2)
    ends = [re.match("\\d{3}\u2013(\\d{3})", cell) for cell in applied if cell != "the same"]
    assert ends and all(end and end.group(1) == last for end in ends), applied


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_paragraph_ends_on_a_colon_with_nothing_after_it(page):
    """A paragraph that ends on a colon is followed by what it announces: a list, a
    table, or code."""
    blocks = re.split(r"\n\s*\n", FENCE.sub("```", page.read_text()))
    dangling = []
    for block, following in itertools.pairwise(blocks):
        if block.startswith(("    ", "#")) or not block.rstrip().endswith(":"):
            continue
        if not re.match(r"\s*(?:[-*|]|\d+\.|```| {4})", following):
            dangling.append(block.rstrip().splitlines()[-1])
    assert dangling == []
