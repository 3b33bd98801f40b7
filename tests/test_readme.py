"""The README's code blocks marked runnable run as written, and print what they say they print.

A block is marked by the HTML comment `<!-- runnable -->` on the line right before its ```python fence (GitHub
renders the comment as nothing). What a block prints is written next to its `print` calls as `# prints: VALUE`, so
the reader sees it and this test checks it: stdout must be exactly those values, in order.

Each block runs in a fresh interpreter from the repository root in two ways: as `python -c BLOCK`, and as a file
`python FILE`, which is how a reader runs a copy. The second is the stricter one: Dask starts its worker processes
with `spawn`, and they import the main file (as `__mp_main__`), so a block that starts a cluster needs its
`if __name__ == "__main__":` guard there; under `-c` there is no file to import. In both, worker classes defined in
`__main__` reach the workers because cloudpickle pickles them by value.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = "<!-- runnable -->"
_PRINTS = re.compile(r"#.*\bprints: (.+?)\s*$")


@dataclass(frozen=True)
class Block:
    line: int  # of the ```python fence, 1-based
    code: str

    @property
    def expected_stdout(self) -> list[str]:
        return [m.group(1) for line in self.code.splitlines() if (m := _PRINTS.search(line))]


def runnable_blocks(text: str) -> list[Block]:
    """The ```python blocks right after a `<!-- runnable -->` line."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
            raise ValueError(f"README.md:{i + 1}: {MARKER} must be followed at once by a ```python fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"README.md:{i + 2}: the runnable block is never closed with ```")
        blocks.append(Block(i + 2, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


BLOCKS = runnable_blocks(README.read_text())


def test_marker_parsing():
    text = "intro\n<!-- runnable -->\n```python\nprint(1)  # prints: 1\n```\n```python\nnot_run()\n```\n"
    (block,) = runnable_blocks(text)
    assert (block.line, block.code, block.expected_stdout) == (3, "print(1)  # prints: 1\n", ["1"])
    with pytest.raises(ValueError, match=r"README.md:1: .* must be followed at once"):
        runnable_blocks("<!-- runnable -->\n\n```python\nx = 1\n```\n")


def test_the_controller_snippet_is_marked_runnable():
    assert any("fa.Controller.local" in b.code and "ctl.apply" in b.code for b in BLOCKS), (
        f"the README's 'single controller, in code' block lost its {MARKER} line"
    )


@pytest.mark.parametrize("how", ["-c", "file"])
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"README.md:{b.line}")
def test_runnable_block_runs_as_written(block: Block, how: str, tmp_path: Path):
    if "print(" in block.code:
        assert block.expected_stdout, f"README.md:{block.line}: write what the block prints as `# prints: VALUE`"
    if how == "-c":
        cmd = [sys.executable, "-c", block.code]
    else:
        script = tmp_path / "readme_block.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"README.md:{block.line} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    assert done.stdout.splitlines() == block.expected_stdout, done.stderr[-2000:]
