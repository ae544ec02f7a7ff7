"""The documents a newcomer reads: the README lists every script there is and every module
and folder at charengine/'s top, and nothing in the repository's documents or code cites a
document outside it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_lists_every_script():
    readme = (ROOT / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
    assert scripts and [s for s in scripts if f"`{s}`" not in readme] == []


def test_the_readme_lists_what_charengine_holds():
    readme = (ROOT / "README.md").read_text()
    top = ROOT / "charengine"
    modules = sorted(p.name for p in top.glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert len(modules) > 10 and [m for m in modules if f"`{m}`" not in readme] == []
    assert len(folders) > 5 and [f for f in folders if f"`charengine/{f}/`" not in readme
                                 and f"`{f}/`" not in readme] == []


def test_nothing_cites_a_document_outside_the_repository():
    outside = re.compile(r"\.\./shared|DESIGN\.md|LIVETALK\.md|\bissue[- ]#?\d", re.I)
    files = [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"),
             *(p for d in ("charengine", "scripts", "tests", "tinychar")
               for p in (ROOT / d).rglob("*.py"))]
    cited = [f"{p.relative_to(ROOT)}:{i}" for p in files if p.name != "test_docs.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert len(files) > 100 and cited == []


def test_the_current_performance_page_stays_short_and_points_at_its_log():
    page = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    assert len(page.splitlines()) <= 400
    assert "PERFORMANCE_LOG.md" in page and (ROOT / "docs" / "PERFORMANCE_LOG.md").is_file()
