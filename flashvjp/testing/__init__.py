"""flashvjp.testing: gradient checks of attention functions, for your own test suite.

Like `numpy.testing` and `jax.test_util.check_grads`: `check` compares an attention
function (flashvjp's, a wrapper of yours, jax.nn's, ...) and its gradients with autodiff
of naive attention in float64 and returns a `Report`; `assert_close` raises
AssertionError with the report's table. `flashvjp.testing.strategies` (needs
hypothesis: ``pip install flashvjp[testing]``) draws random valid attention problems.
See docs/testing.md.

  >>> from flashvjp import testing
  >>> testing.assert_close(my_attention, query=q, key=k, value=v, causal=True)  # doctest: +SKIP
"""
from flashvjp.testing._check import assert_close
from flashvjp.testing._check import check
from flashvjp.testing._compare import Quantity
from flashvjp.testing._compare import Report

__all__ = ["Quantity", "Report", "assert_close", "check"]
