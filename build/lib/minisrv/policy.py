"""The scheduling policies, importable as ``minisrv.policy`` (they live in the scheduler
package, ``minisrv/scheduler/policy.py``, beside the loop that uses them)."""

from minisrv.scheduler.policy import *  # noqa: F403
from minisrv.scheduler.policy import __all__  # noqa: F401
