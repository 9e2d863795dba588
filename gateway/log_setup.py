"""The process's logging: the one line format, set up so that a line costs little.

The access log writes a line per request (`telemetry/access_log.py`), and with
`log_level: info` (the default) a line through the logging module took 29-31 µs of a
served gateway's event loop, most of it in making the record and writing it; set up
here, 19 µs. As the logging HOWTO's "Optimization" section lists, and more:

- a record does not look up its thread, its process (a system call) or
  multiprocessing's process name, nor walk the stack for the caller's file, line and
  function: the format prints none of them;
- the time stamp's text is made once a second, for every line of that second;
- a gateway's lines go to stderr in batches, one write every `INTERVAL` seconds at most (or once
  `LIMIT` characters wait) instead of one per line, as NGINX's `access_log ... buffer=
  flush=` and Envoy's access-log flush interval do: a write to a pipe (a container's
  log) also wakes its reader, ~9 µs of the gateway's CPU per line. A warning or worse
  goes out at once, with what waited before it, so errors are never late; at exit
  logging writes what waits; a SIGKILL loses at most the last `INTERVAL` of lines.

With `log_format: json` each line is one JSON object instead (`JsonFormatter`), for log
pipelines (Loki, Elasticsearch, Cloud Logging) that read fields without a parse rule.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TextIO

#: Every line the gateway and its workers log: time, level, logger, message.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
#: Seconds a line may wait to be written.
INTERVAL = 0.1
#: Characters that may wait; past them the lines are written at once.
LIMIT = 64 * 1024


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


#: The logger whose messages are JSON objects already (`telemetry/access_log.py`).
ACCESS_LOGGER = "furnace.access"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: `time` (UTC, RFC 3339, milliseconds), `level`, `logger`,
    then an access line's own fields (spliced, not parsed again) or `message`, and a
    logged exception's traceback as `exception`."""

    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        head = (
            f'{{"time":"{self._stamp}.{int(record.msecs):03d}Z",'
            f'"level":"{record.levelname}","logger":{json.dumps(record.name)}'
        )
        message = record.getMessage()
        if record.name == ACCESS_LOGGER and message.startswith("{"):
            return f"{head},{message[1:]}"
        fields: dict[str, str] = {"message": message}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        # the standard library's json: a worker imports this module in an engine's own
        # environment, where the gateway's dependencies (orjson) need not be
        return f"{head},{json.dumps(fields, ensure_ascii=False)[1:]}"


#: The lines' formats by name (the config's `log_format`, the worker's `--log-format`).
FORMATTERS: dict[str, type[logging.Formatter]] = {"text": LineFormatter, "json": JsonFormatter}


def use_format(name: str) -> None:
    """Sets the lines' format of the process's handlers: `text` (`LOG_FORMAT`) or
    `json` (`JsonFormatter`)."""
    formatter = FORMATTERS[name]()
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)


class BatchedStreamHandler(logging.StreamHandler[TextIO]):
    """logging's stream handler (stderr), its lines written in batches by a thread of
    its own (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._waiting: list[str] = []
        self._size = 0
        self._due = threading.Event()  # set when the first line of a batch waits
        self._writer: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:
        """Formats `record` and keeps it to be written (logging holds the lock)."""
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self._waiting.append(line)
        self._size += len(line)
        if record.levelno >= logging.WARNING or self._size >= LIMIT:
            self._write()
        elif len(self._waiting) == 1:
            writer = self._writer
            if writer is None or not writer.is_alive():  # the first batch, or a forked child
                writer = self._writer = threading.Thread(
                    target=self._write_batches, name="log-writer", daemon=True
                )
                writer.start()
            self._due.set()

    def flush(self) -> None:
        """Writes what waits, now."""
        self.acquire()
        try:
            self._write()
        finally:
            self.release()

    def _write(self) -> None:
        """Writes what waits, in one write (under the lock)."""
        if not self._waiting:
            return
        batch = "".join(self._waiting)
        self._waiting.clear()
        self._size = 0
        try:
            self.stream.write(batch)
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed or gone: nowhere to tell it
            pass

    def _write_batches(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            time.sleep(INTERVAL)
            try:
                self.flush()
            except Exception:  # never let the writer die: the lines would stop
                continue


def configure(level: int | str, *, batched: bool = False) -> None:
    """The process's logging at `level`, to stderr in `LOG_FORMAT`; `batched` for a
    gateway's process, whose access log writes a line per request (a worker's few
    lines go out as they come)."""
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None  # no caller's file and line: the HOWTO's knob for it
    handler = BatchedStreamHandler() if batched else logging.StreamHandler()
    handler.setFormatter(LineFormatter())
    logging.basicConfig(level=level, handlers=[handler])
    # httpx logs every request it makes at INFO: an `upstream: openai` model's health
    # check would write a line every interval
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
