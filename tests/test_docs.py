"""Every ```python snippet of README.md and docs/*.md runs on its own.

Each markdown file's snippets run in one fresh Python process (no conftest settings: no
x64, a user's defaults), each snippet in a fresh namespace, so a snippet that uses a name
defined only in an earlier one fails. The process gets eight virtual CPU devices, as the
sharding snippets say to set up. A snippet that cannot run on one machine is preceded by
an HTML comment `<!-- not run: reason -->`; the reason is required.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"(?:<!--\s*not run:(?P<why>[^>]*)-->\s*\n)?^```python[^\n]*\n(?P<code>.*?)^```",
                    re.S | re.M)
TIMEOUT_S = 600

_RUNNER = r"""
import json, sys, time, traceback
snippets = json.load(sys.stdin)
for line, code in snippets:
  t0 = time.perf_counter()
  try:
    exec(compile(code, f"snippet at line {line}", "exec"), {"__name__": "__snippet__"})
  except BaseException:
    print(f"FAILED: the snippet at line {line}:\n{code}\n{traceback.format_exc()}")
    sys.exit(1)
  print(f"ok: line {line} ({time.perf_counter() - t0:.1f} s)", flush=True)
"""


def snippets(path: pathlib.Path):
  """[(line, code, skip_reason or None)] of the ```python blocks of a markdown file."""
  text = path.read_text()
  out = []
  for m in _BLOCK.finditer(text):
    line = text[:m.start("code")].count("\n") + 1
    why = m.group("why")
    out.append((line, m.group("code"), why.strip() if why is not None else None))
  return out


def test_snippets_found():
  found = {p.name: snippets(p) for p in FILES}
  assert len(found["README.md"]) >= 3, found["README.md"]
  assert sum(len(v) for v in found.values()) >= 10
  for name, snips in found.items():
    for line, _, why in snips:
      assert why != "", f"{name}:{line}: '<!-- not run: -->' needs a reason"


# The user-facing pages whose snippets must run (a page that lost its runnable snippets, or
# left FILES, would silently stop being checked).
PAGES = ("README.md", "getting_started.md", "implementations.md", "distributed.md", "testing.md",
         "ecosystem.md", "forward_mode.md", "decoding.md")


def test_user_pages_have_running_snippets():
  runnable = {p.name: [s for s in snippets(p) if s[2] is None] for p in FILES}
  for name in PAGES:
    assert runnable.get(name), f"{name}: no runnable ```python snippet (or not in FILES)"


# Statements that contradicted the code (issue 31). Each is false now; the pages must not
# make it again. (phrase, what is true instead)
STALE = [
    ("one `jax.custom_vjp`", "the op is a custom_jvp whose tangent is transposed by the backward"),
    ("same `jax.custom_vjp`", "the op is a custom_jvp whose tangent is transposed by the backward"),
    ("custom_vjp and no forward mode", "ring attention has forward mode"),
    ("carry no custom_partitioning rule", "the tangent pass is partitioned like fwd / bwd"),
    ("max |error| <= tolerance x max |reference|", "flashvjp.testing._compare.PASS_RULE"),
]


def test_no_statement_that_contradicts_the_code():
  for path in FILES + [ROOT / "BUILD.md"]:
    text = " ".join(path.read_text().split())
    for phrase, truth in STALE:
      assert phrase not in text, f"{path.name} says {phrase!r}; true: {truth}"


def test_flax_extra_and_the_readme_says_to_install_it():
  import tomllib
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]
  assert extras.get("flax") == ["flax"], extras.get("flax")
  readme = (ROOT / "README.md").read_text()
  dropin = readme[readme.index("## Drop-in for jax.nn and Flax"):]
  assert dropin.index('".[flax]"') < dropin.index("import flax.linen")


@pytest.mark.parametrize("path", [p for p in FILES if snippets(p)], ids=lambda p: p.name)
def test_snippets_run_standalone(path):
  todo = [(line, code) for line, code, why in snippets(path) if why is None]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  env["PYTHONPATH"] = str(ROOT)
  res = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(todo), text=True,
                       capture_output=True, cwd=str(ROOT), env=env, timeout=TIMEOUT_S)
  print(res.stdout)
  assert res.returncode == 0, f"{path.name}: {res.stdout[-6000:]}\n{res.stderr[-3000:]}"
  assert res.stdout.count("ok: line") == len(todo)
