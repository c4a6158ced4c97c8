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
