"""The usage example of clients/python/README.md runs as documented."""

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "..", "..", "clients", "python", "README.md")


def test_readme_example_runs():
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks, "no python example in the README"
    out = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kept per layer: [64, 64]" in out.stdout
    assert "K (2, 64, 64) uint16" in out.stdout
