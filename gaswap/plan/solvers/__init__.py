"""Policies found without the genetic search: baselines from the literature, minimum cuts, the MILP optimum."""
