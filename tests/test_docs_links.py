"""Every relative link of the README and docs/ names a file of the repository (the ten-minute path in
docs/start.md, and the "On this page" line of each reference page, point into them)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_name_files_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # commands, not links
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img src="([^"]+)"', text)
    missing = [
        target
        for target in targets
        if not target.startswith(("http://", "https://", "#", "mailto:"))
        and not (page.parent / target.split("#")[0]).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_every_reference_page_opens_with_what_it_holds():
    for page in (ROOT / "docs").glob("*.md"):
        if page.name == "start.md":
            continue
        assert page.read_text().split("\n")[2].startswith("**On this page:**"), page.name
