"""`python -m flashvjp check`: help written for users, rows printed as they finish, exit status."""
import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

import flashvjp
from flashvjp import _selfcheck
from flashvjp import cli


def _run_main(argv):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  return exit_info.value.code


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["bench", "--help"]])
def test_help_is_for_users(argv, capsys):
  assert _run_main(argv) == 0
  out = capsys.readouterr().out
  assert "Room:" not in out and "public API only" not in out  # no internal notes
  assert "usage: python -m flashvjp" in out
  if argv[0] == "check":
    assert "float64" in out and "interpret mode" in out and "minute" in out
    assert "Exit status" in out and "--skip-pallas" in out and "--feature" in out
  if argv[0] == "bench":
    assert "about a minute" in out and "--budget" in out


def _words(text):
  return " ".join(text.split())


def test_pass_rule_is_stated_once_everywhere(capsys):
  """--help, docs/testing.md and the banner (below) state the rule _compare implements."""
  from flashvjp.testing._compare import PASS_RULE
  assert _run_main(["check", "--help"]) == 0
  assert _words(PASS_RULE) in _words(capsys.readouterr().out)
  docs = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "testing.md").read_text()
  assert _words(PASS_RULE) in _words(docs)


def test_features_match_the_checked_list():
  import jax.numpy as jnp  # noqa: F401
  assert tuple(name for name, _ in _selfcheck._features(1, 4, 70)) == _selfcheck.FEATURES


def test_check_prints_each_row_and_a_summary(capsys):
  code = _run_main(["check", "--skip-pallas", "--feature", "plain", "causal"])
  out = capsys.readouterr().out
  assert code == 0
  lines = out.splitlines()
  rows = [l for l in lines if l.startswith("blockwise ")]
  assert [r.split()[1] for r in rows] == ["plain", "causal"]
  assert all("PASS" in r for r in rows)
  assert "[1/2," in rows[0] and "[2/2," in rows[1] and "elapsed]" in rows[1]  # progress per row
  assert "Expect about" in out  # a duration hint before the first row
  assert out.index("Expect about") < out.index(rows[0])
  assert "not checked (--skip-pallas)" in out
  assert "2 passed, 0 failed" in out
  from flashvjp.testing._compare import PASS_RULE
  assert _words(PASS_RULE) in _words(out)  # the banner states the one pass rule


def test_check_rejects_unknown_feature(capsys):
  assert _run_main(["check", "--feature", "flash"]) == 2  # argparse's usage error
  assert "unknown feature 'flash'" in capsys.readouterr().err
  assert _run_main(["check", "--feature", "s"]) == 2  # segment_ids or softcap
  assert "ambiguous feature 's'" in capsys.readouterr().err


def test_feature_names_by_their_start():
  assert cli._feature_arg("dropout") == "dropout 0.2"
  assert cli._feature_arg("window") == "window(8,4)"
  assert cli._feature_arg("causal") == "causal"


def test_run_reports_rows_as_they_finish_and_unsupported_features(monkeypatch):
  """on_row sees each row before run returns; a feature the limits refuse is 'not run'."""
  real_explain = flashvjp.explain

  def explain(q, k, v, **kw):
    if kw.get("implementation") == "naive" and kw.get("causal"):
      raise ValueError("implementation='naive' cannot run this input: test refusal")
    return real_explain(q, k, v, **kw)

  monkeypatch.setattr(flashvjp, "explain", explain)
  seen = []
  rows = _selfcheck.run(["naive"], features=["plain", "causal"], S=20, D=8,
                        on_row=lambda r: seen.append((r.feature, r.passed, r.skipped)))
  assert seen == [("plain", True, None),
                  ("causal", False, "implementation='naive' cannot run this input: test refusal")]
  assert rows[1].errors == () and rows[0].seconds > 0
  with pytest.raises(ValueError, match="features"):
    _selfcheck.run(["naive"], features=["nope"])


def test_check_fails_loudly(monkeypatch, capsys):
  """A row over tolerance prints FAIL, is named at the end, and the exit status is 1."""
  from flashvjp.testing import _check as testing_check
  real = testing_check.compare
  monkeypatch.setattr(testing_check, "compare", lambda n, g, r, t, *floor: dataclasses.replace(
      real(n, g, r, t, *floor), error=1.0 if n == "dk" else 0.0))
  code = _run_main(["check", "--skip-pallas", "--feature", "plain"])
  out = capsys.readouterr().out
  assert code == 1
  assert "FAIL" in out and "0 passed, 1 failed" in out and "FAILED: blockwise plain" in out
  assert "FAILED dk" in out  # the report's table follows the row and names dk
  assert any(l.split()[:1] == ["dk"] and "FAIL" in l for l in out.splitlines())


def test_check_json(capsys):
  """--json: one JSON document with every row and quantity (dbias for the bias feature)."""
  code = _run_main(["check", "--json", "--skip-pallas", "--feature", "plain", "bias"])
  doc = json.loads(capsys.readouterr().out)
  assert code == 0 and doc["passed"] is True
  assert [r["feature"] for r in doc["rows"]] == ["plain", "bias"]
  names = [q["name"] for q in doc["rows"][1]["report"]["quantities"]]
  assert names == ["out", "dq", "dk", "dv", "dbias"]
  assert all(q["error"] <= q["tolerance"] for q in doc["rows"][1]["report"]["quantities"])


_USER_MODULE = """
import jax, flashvjp
def good(q, k, v, **kw):
  return flashvjp.flash_attention(q, k, v, implementation="blockwise", **kw)

@jax.custom_vjp
def _ident(x):
  return x
_ident.defvjp(lambda x: (x, None), lambda _, g: (1.01 * g,))

def bad_dk(q, k, v, **kw):
  return flashvjp.flash_attention(q, _ident(k), v, implementation="blockwise", **kw)
"""


def test_check_a_users_function(tmp_path, monkeypatch, capsys):
  """`python -m flashvjp check module:fn` checks the user's function: passes or names dk."""
  (tmp_path / "my_attention_mod.py").write_text(_USER_MODULE)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  assert _run_main(["check", "my_attention_mod:good", "--feature", "causal", "alibi"]) == 0
  out = capsys.readouterr().out
  assert "my_attention_mod:good" in out and "2 passed, 0 failed" in out
  assert "d score_mod[0]" in out  # alibi's slopes are differentiated
  assert _run_main(["check", "my_attention_mod:bad_dk", "--json", "--feature", "plain"]) == 1
  doc = json.loads(capsys.readouterr().out)
  assert doc["rows"][0]["report"]["failed"] == ["dk"]
  with pytest.raises(SystemExit, match="no attribute"):
    cli.main(["check", "my_attention_mod:nope"])


def test_module_entry_point():
  """`python -m flashvjp` is wired to the CLI (exit status 2 and usage without a command)."""
  res = subprocess.run([sys.executable, "-m", "flashvjp"], capture_output=True, text=True,
                       timeout=120)
  assert res.returncode == 2 and "usage: python -m flashvjp" in res.stderr
