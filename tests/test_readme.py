"""Every Python example in the README runs as written, and every file the README and
docs/ link to exists."""

import pathlib
import re
import runpy

import pytest

from tests.devices import needs_libtpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert EXAMPLES


# An example that compiles for a TPU target needs libtpu's compile-only TPUs.
@pytest.mark.parametrize(
    "index",
    [pytest.param(i, marks=needs_libtpu if '"tpu-' in e else ()) for i, e in enumerate(EXAMPLES)],
)
def test_readme_example_runs(index, tmp_path):
    # Run from a file, as a user pasting it would: `@triton.jit` reads its function's source.
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(EXAMPLES[index])
    runpy.run_path(str(script), run_name="__main__")


# A Markdown link to a file of the checkout: [text](path), no scheme, no bare #anchor.
LOCAL_LINK = re.compile(r"\]\((?![a-z]+:)([^)#\s]+)(?:#[^)]*)?\)")
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_local_links_resolve(page):
    links = LOCAL_LINK.findall(page.read_text())
    missing = [link for link in links if not (page.parent / link).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_readme_links_every_doc_page():
    linked = {(README.parent / link).resolve() for link in LOCAL_LINK.findall(README.read_text())}
    unlinked = [page.name for page in (ROOT / "docs").glob("*.md") if page.resolve() not in linked]
    assert not unlinked, f"docs/ pages the README never links to: {unlinked}"


def _github_anchor(heading):
    """The id GitHub gives a Markdown heading: lower case, punctuation but `-` and `_` dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_anchors_name_its_headings():
    text = README.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # a code block's `# comment` is no heading
    headings = {_github_anchor(h) for h in re.findall(r"^#+ (.+)$", prose, re.M)}
    anchors = re.findall(r"\]\(#([^)]+)\)", text)
    assert anchors
    assert not [a for a in anchors if a not in headings], sorted(set(anchors) - headings)
