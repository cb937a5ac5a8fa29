"""Where the engines run: one in a thread of the server process (``LocalEngine``,
``--engine-thread``), or supervised worker processes (``DataParallelEngines``, ``--dp N``).

Both answer the front end the same way (``start``, ``submit``, ``abort``, ``done``,
``close``; ``ready``, ``up``, ``failed``, ``limits``, ``workers()``), and both deliver
every outcome, errors included, as ``TokenEvent`` messages (``minisrv.server.messages``).
"""

from __future__ import annotations

from minisrv.server.config import EngineOptions, ServerConfig, check_engine_options
from minisrv.server.dataparallel import DataParallelEngines
from minisrv.server.worker import LocalEngine, Unavailable, build_engine

__all__ = ["DataParallelEngines", "EngineOptions", "LocalEngine", "ServerConfig",
           "Unavailable", "build_engine", "check_engine_options"]
