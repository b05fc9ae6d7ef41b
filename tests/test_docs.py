"""Every ```python block in docs/*.md runs as written (each block is self-contained).

Shell examples are run by the tests of the pages that have them (README: ``test_readme.py``;
tasks and score: ``tests/tasks/test_docs.py``)."""

import re
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).resolve().parent.parent / "docs").glob("*.md"))
BLOCKS = [(doc, i, code) for doc in DOCS
          for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", doc.read_text(), flags=re.S | re.M))]


def test_the_references_have_examples():
    pages = {doc.name for doc, _, _ in BLOCKS}
    assert {"algorithms.md", "memory.md"} <= pages, pages


@pytest.mark.parametrize("doc, index, code", BLOCKS, ids=[f"{d.stem}-{i}" for d, i, _ in BLOCKS])
def test_doc_example_runs(doc, index, code, capsys):
    exec(compile(code, f"{doc.name}[block {index}]", "exec"), {"__name__": "__doc_example__"})
