"""Every Python example in the README runs as written."""

import pathlib
import re
import runpy

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert EXAMPLES


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, tmp_path):
    # Run from a file, as a user pasting it would: `@triton.jit` reads its function's source.
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(EXAMPLES[index])
    runpy.run_path(str(script), run_name="__main__")
