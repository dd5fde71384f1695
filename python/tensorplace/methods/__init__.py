"""Planning methods implemented in Python (the others live in rust_core/src/methods/).

- :mod:`tensorplace.methods.milp`: the exact optimum of a linear model of the cost model
  (AutoTM's flow formulation with Checkmate's recomputation), solved by HiGHS.
"""

from .milp import MILP_METHODS, milp_plan

__all__ = ["MILP_METHODS", "milp_plan"]
