"""Placement policies, one module each, built by name from configuration (`build_policy`)."""

from __future__ import annotations

from engine.router.core.policies.base import Policy
from engine.router.core.policies.least_load import LeastLoad
from engine.router.core.policies.longest_prefix import LongestPrefix
from engine.router.core.policies.round_robin import RoundRobin
from engine.router.core.policies.strata import Strata

POLICY_NAMES = ("strata", "round_robin", "least_load", "longest_prefix")
DEFAULT_POLICY = "strata"


def build_policy(name: str = DEFAULT_POLICY, **options: float) -> Policy:
    """A fresh policy object by name; `options` go to the policy (only `strata` takes any:
    `decode_weight`, `tie_tolerance`). Raises ValueError for an unknown name or option."""
    if name == "strata":
        unknown = sorted(set(options) - {"decode_weight", "tie_tolerance"})
        if unknown:
            raise ValueError(f"policy 'strata' has no option {', '.join(unknown)}")
        return Strata(**options)
    if options:
        raise ValueError(f"policy {name!r} takes no options (got {', '.join(sorted(options))})")
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "longest_prefix":
        return LongestPrefix()
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")


__all__ = ["DEFAULT_POLICY", "POLICY_NAMES", "Policy", "build_policy"]
