"""Routing requests across workers: the router and its approximate tree.

``Router`` chooses a worker per request (``POLICIES``); ``ApproxTree`` is its memory of
which prefixes went where. The router is part of the serving runtime (``--dp N`` workers
behind it); the routing chapter's cluster simulation, ``simulate_cluster`` and
``serve_cluster``, lives on the book side in ``minisrv.experiments.routing``.
"""

from minisrv.router.policy import (
    BRANCHES,
    LAUNCHER_DEFAULTS,
    MATCH_RULES,
    MATCH_SOURCES,
    MISS_RULES,
    POLICIES,
    Router,
)
from minisrv.router.tree import ApproxTree, TreeMatch, common_prefix_length

__all__ = [
    "ApproxTree",
    "BRANCHES",
    "LAUNCHER_DEFAULTS",
    "MATCH_RULES",
    "MATCH_SOURCES",
    "MISS_RULES",
    "POLICIES",
    "Router",
    "TreeMatch",
    "common_prefix_length",
]
