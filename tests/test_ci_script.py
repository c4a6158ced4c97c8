"""CI's exit handler (`.ci/run`'s `cleanup`): CI's status is the status of its steps.

The handler runs under `set -euo pipefail`. Its first version killed step 2a's background job
with a bare `kill`, which fails once the job has ended, so a run whose every step passed exited
with status 1. These tests run the handler, cut from `.ci/run`, in small scripts.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import textwrap

import pytest

CI_RUN = pathlib.Path(__file__).resolve().parents[1] / ".ci" / "run"


def _handler() -> str:
  text = CI_RUN.read_text()
  m = re.search(r"^cleanup\(\) \{\n.*?^\}\n", text, re.S | re.M)
  assert m, ".ci/run has no cleanup() function"
  assert re.search(r"^trap cleanup EXIT$", text, re.M), ".ci/run does not trap cleanup on EXIT"
  return m.group(0)


def _run(body: str, tmp_path: pathlib.Path) -> tuple[int, pathlib.Path]:
  work = tmp_path / "work"
  work.mkdir()
  script = "\n".join(
    [
      "set -euo pipefail",
      f'WORK="{work}"',
      'SMOKE_PID=""',
      'VENV_PIDS=""',
      'BG_PIDS=""',
      _handler(),
      "trap cleanup EXIT",
      textwrap.dedent(body),
    ]
  )
  rc = subprocess.run(["bash", "-c", script], timeout=60).returncode
  return rc, work


def test_passing_run_exits_zero_after_its_background_job_ended(tmp_path):
  rc, work = _run(
    """
        sleep 0.1 &
        SMOKE_PID=$!
        wait "$SMOKE_PID"
        echo done
        """,
    tmp_path,
  )
  assert rc == 0
  assert not work.exists()


@pytest.mark.parametrize("status", [1, 3])
def test_failing_step_keeps_its_status(tmp_path, status):
  rc, work = _run(f"(exit {status})\necho unreachable", tmp_path)
  assert rc == status
  assert not work.exists()


def test_background_jobs_still_running_are_stopped(tmp_path):
  markers = [tmp_path / f"alive{i}" for i in range(3)]
  rc, _ = _run(
    f"""
        (sleep 2; touch "{markers[0]}") &
        SMOKE_PID=$!
        (sleep 2; touch "{markers[1]}") &
        VENV_PIDS="$!"
        (sleep 2; touch "{markers[2]}") &
        VENV_PIDS="$VENV_PIDS $!"
        exit 4
        """,
    tmp_path,
  )
  assert rc == 4
  subprocess.run(["sleep", "3"], check=True)
  alive = [m.name for m in markers if m.exists()]
  assert not alive, f"background jobs outlived CI: {alive}"


def test_children_of_background_jobs_are_stopped(tmp_path):
  """A background step is a subshell running pip or python: its children stop with it."""
  marker = tmp_path / "grandchild"
  rc, _ = _run(
    f"""
        (bash -c 'sleep 2; touch "{marker}"'; echo finished) &
        BG_PIDS="$!"
        sleep 0.5
        exit 5
        """,
    tmp_path,
  )
  assert rc == 5
  subprocess.run(["sleep", "3"], check=True)
  assert not marker.exists(), "a background job's child outlived CI"


ROOT = CI_RUN.parents[1]


def _readme_cmd(name: str) -> str:
  text = CI_RUN.read_text()
  m = re.search(r"^readme_cmd\(\) \{.*?^\}\n", text, re.S | re.M)
  assert m, ".ci/run has no readme_cmd() function"
  script = f'set -euo pipefail\nROOT="{ROOT}"\n{m.group(0)}\nreadme_cmd {name}\n'
  return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                        check=True).stdout.strip()


@pytest.mark.parametrize("name,must", [
    ("main", ["python3 -m venv .venv", "pip install -e .", "python -m flashvjp check"]),
    ("test", ["python3 -m venv .venv", 'pip install -e ".[test]" -c test-constraints.txt',
              "python -m pytest"])])
def test_ci_runs_the_readme_commands_verbatim(name, must):
  """CI reads the command it runs from the README (the line after `<!-- .ci/run: NAME -->`),
  so the README's command and CI's cannot drift apart; and CI runs it (readme_run NAME)."""
  cmd = _readme_cmd(name)
  readme = (ROOT / "README.md").read_text().splitlines()
  i = readme.index(f"<!-- .ci/run: {name} -->")
  assert readme[i + 1].startswith("```") and readme[i + 2] == cmd
  for part in must:
    assert part in cmd, (name, cmd)
  assert re.search(rf"^readme_run {name} ", CI_RUN.read_text(), re.M), f"CI never runs {name}"


def test_constraints_pin_one_jax_release_per_python():
  """test-constraints.txt pins jax, jaxlib and the CUDA plugin + PJRT at one release for each
  Python marker (jax loads the plugin only at jaxlib's exact version), and libtpu."""
  pins: dict[str, dict[str, str]] = {}
  for line in (ROOT / "test-constraints.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    m = re.fullmatch(r"([\w.-]+)==([\w.*]+);\s*(python_version\s*[<>=]+\s*\"[\d.]+\")", line)
    assert m, f"not a marked pin: {line!r}"
    pins.setdefault(m.group(3), {})[m.group(1)] = m.group(2)
  assert len(pins) >= 2, pins
  for marker, p in pins.items():
    assert set(p) == {"jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "libtpu"}, marker
    assert len({p["jax"], p["jaxlib"], p["jax-cuda12-plugin"], p["jax-cuda12-pjrt"]}) == 1, p


def test_getting_started_has_the_readme_commands():
  page = (ROOT / "docs" / "getting_started.md").read_text()
  for name in ("main", "test"):
    assert _readme_cmd(name) in page, name
