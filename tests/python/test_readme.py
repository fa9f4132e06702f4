"""The README's Python quick start runs as written."""

from __future__ import annotations

import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_python_quick_start(capsys) -> None:
    text = open(README, encoding="utf-8").read()
    section = text.split("## Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the README's Python section has no python code block"
    exec(compile(blocks[0], "README.md", "exec"), {})
    assert "(6, 512)" in capsys.readouterr().out
