"""Reading the table of ``policy_rate_sweep`` (the server chapter's simulated H100 against the
request rate): the requests completed per second, the goodput under a TTFT target as
``minisrv bench --goodput`` counts it, the share of the requests that met the target
(DistServe's SLO attainment), and the table the page prints.
"""

from __future__ import annotations

import pandas as pd

__all__ = ["completion_rate", "goodput", "policy_sweep_table", "slo_attainment"]


def completion_rate(sweep: pd.DataFrame) -> pd.Series:
    """Per row of ``policy_rate_sweep``: the requests completed per second, all of them over
    the run's duration. A server that keeps up completes the rate it is offered; one that
    falls behind drains its queue after the last arrival and completes fewer."""
    done = sweep["ttfts (ms)"].map(len)
    return (done / sweep["duration (s)"]).rename("completed (req/s)")


def goodput(sweep: pd.DataFrame, ttft_slo_ms: float) -> pd.Series:
    """Per row of ``policy_rate_sweep``: the requests per second whose TTFT met ``ttft_slo_ms``, as
    ``minisrv bench --goodput ttft:MS`` (and vLLM's ``--goodput``) counts them: requests
    that met the target over the run's duration."""
    met = _met(sweep, ttft_slo_ms)
    return (met / sweep["duration (s)"]).rename(f"goodput at ttft <= {ttft_slo_ms:g} ms")


def slo_attainment(sweep: pd.DataFrame, ttft_slo_ms: float) -> pd.Series:
    """Per row of ``policy_rate_sweep``: the share of its requests whose TTFT met
    ``ttft_slo_ms``, DistServe's SLO attainment. DistServe's goodput is the highest rate whose
    attainment reaches its goal (90%), one number per GPU, where ``goodput`` is one per run."""
    met = _met(sweep, ttft_slo_ms) / sweep["ttfts (ms)"].map(len)
    return met.rename(f"met ttft <= {ttft_slo_ms:g} ms")


def _met(sweep: pd.DataFrame, ttft_slo_ms: float) -> pd.Series:
    """Per row of ``policy_rate_sweep``: how many of its requests' TTFTs met ``ttft_slo_ms``."""
    return sweep["ttfts (ms)"].map(lambda ttfts: sum(t <= ttft_slo_ms for t in ttfts))


def policy_sweep_table(sweep: pd.DataFrame, ttft_slo_ms: float) -> pd.DataFrame:
    """``policy_rate_sweep``'s table as the page prints it: one row per rate offered, and per
    configuration (its first word) the output tokens per second, the TTFT p99 and the goodput
    at ``ttft_slo_ms``, rounded to whole numbers."""
    columns = {"out tok/s": sweep["out tok/s"], "TTFT p99 (ms)": sweep["ttft p99 (ms)"],
               "goodput (req/s)": goodput(sweep, ttft_slo_ms)}
    names = list(sweep.index.unique(level=0))
    table = pd.DataFrame({f"{name.split(',')[0]} {column}": values.xs(name, level=0)
                          for column, values in columns.items() for name in names})
    table = table.round(0).astype(int).rename(index=lambda rate: f"{rate:g}")
    return table.rename_axis(index=None, columns="req/s offered")
