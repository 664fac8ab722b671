"""Every ```python block of README.md and docs/*.md runs, so the docs cannot go stale.

A block runs in its own process, in an empty directory, with the deprecated forms of the API
turned into errors. An HTML comment just before a block sets how it runs (never whether):

    <!-- doctest: setup=NAME ranks=N s3 continue -->

* ``setup=NAME``: the code of ``tests/doc_setups.py``'s ``SETUPS[NAME]`` runs first (the
  objects a snippet assumes: a model, an optimizer, a state, the process group; nothing the
  snippet shows), and ``TEARDOWNS[NAME]`` after it (the process group destroyed);
* ``ranks=N``: under ``torchrun --nproc-per-node N`` (gloo, 127.0.0.1);
* ``s3``: with the loopback S3 server's environment and a bucket ``bucket``;
* ``continue``: after the previous block of the same file (its state, its files).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests import dist
from tests.doc_setups import PREAMBLE, SETUPS, TEARDOWNS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
BLOCK = re.compile(r"(?:<!--\s*doctest:(?P<opts>[^>]*)-->[ \t]*\n)?```python[ \t]*\n(?P<code>.*?)^```", re.S | re.M)
KNOWN = {"setup", "ranks", "s3", "continue"}


def _blocks():
    out = []
    for rel in FILES:
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        prev = None
        for i, m in enumerate(BLOCK.finditer(text)):
            opts: dict[str, str] = {}
            for tok in (m.group("opts") or "").split():
                k, _, v = tok.partition("=")
                opts[k] = v or "1"
            unknown = set(opts) - KNOWN
            assert not unknown, f"{rel}: unknown doctest option(s) {sorted(unknown)}"
            line = text[: m.start("code")].count("\n") + 1
            code = m.group("code")
            if "continue" in opts:
                assert prev is not None, f"{rel}:{line}: 'continue' on the first block"
                setup, ranks, s3, code = prev[0], prev[1], prev[2], prev[3] + "\n" + code
            else:
                setup, ranks, s3 = opts.get("setup"), int(opts.get("ranks", "1")), "s3" in opts
            assert setup is None or setup in SETUPS, f"{rel}:{line}: no setup {setup!r} in tests/doc_setups.py"
            prev = (setup, ranks, s3, code)
            out.append(pytest.param(rel, line, setup, ranks, s3, code, id=f"{rel}:{line}"))
    return out


def test_every_doc_has_its_blocks_found():
    """The pattern finds every ```python fence (a typo in a doctest comment hides none)."""
    for rel in FILES:
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        assert text.count("```python") == len(BLOCK.findall(text)), rel


@pytest.mark.parametrize("rel,line,setup,ranks,s3_needed,code", _blocks())
def test_doc_snippet_runs(rel, line, setup, ranks, s3_needed, code, tmp_path, request):
    script = (PREAMBLE + textwrap.dedent(SETUPS[setup] if setup else "") + "\n# --- the snippet ---\n" + code
              + TEARDOWNS.get(setup or "", ""))
    path = tmp_path / "snippet.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=ROOT, UNICKPT_TIMEOUT_S="120", OMP_NUM_THREADS="1")
    if s3_needed:
        s3 = request.getfixturevalue("s3")
        s3.bucket("bucket")
        env = s3.environ(base=env)
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--nnodes=1",
               "--master-addr=127.0.0.1", f"--master-port={dist.free_port()}", str(path)]
    else:
        cmd = [sys.executable, str(path)]
    work = tmp_path / "work"
    work.mkdir()
    try:
        p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    finally:  # a snippet's memory tier lives in /dev/shm (host memory): not left behind
        for name in set(re.findall(r"/dev/shm/([\w.-]+)", code)):
            shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)
    assert p.returncode == 0, f"{rel}:{line} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
