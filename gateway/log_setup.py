"""The process's logging: the one line format, set up so that a line costs little.

The access log writes a line per request (`telemetry/access_log.py`), and with
`log_level: info` (the default) a line through the logging module took 29-31 µs of a
served gateway's CPU, most of it in making the record; set up here, 21-22 µs. As the
logging HOWTO's "Optimization" section lists:

- a record does not look up its thread, its process (a system call) or
  multiprocessing's process name, nor walk the stack for the caller's file, line and
  function: the format prints none of them;
- the time stamp's text is made once a second, for every line of that second.
"""

from __future__ import annotations

import logging
import time

#: Every line the gateway and its workers log: time, level, logger, message.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class LineFormatter(logging.Formatter):
    """`LOG_FORMAT`, its time stamp's text made once a second (a handler formats under
    its lock: one line at a time)."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        if second != self._second:
            self._stamp = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = second
        return f"{self._stamp},{int(record.msecs):03d}"


def configure(level: int | str) -> None:
    """The process's logging at `level`, to stderr, in `LOG_FORMAT`."""
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None  # no caller's file and line: the HOWTO's knob for it
    handler = logging.StreamHandler()
    handler.setFormatter(LineFormatter())
    logging.basicConfig(level=level, handlers=[handler])
