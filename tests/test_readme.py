"""Every Python example in the README runs as written."""

import pathlib
import re
import runpy

import pytest

from tests.devices import needs_libtpu

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
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
