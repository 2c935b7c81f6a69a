"""What a run prints, and ``run.log``, where everything it and Ray say is kept.

At the default verbosity the console of a healthy run shows only mineonline's own output: the
progress display, the summary, and one line per warning or error that mineonline raises in the
driver or in any of the run's actors. Everything else (Ray's and Ray Train's messages, library
warnings, tracebacks, C++ log lines of the actor processes) goes to ``<run_dir>/run.log`` only, with
the mineonline lines. ``verbose`` (``mineonline run -v``) prints everything as Ray prints it too.

How, with Ray's own configuration rather than text filters:

* each of the run's actors calls ``setup_actor_logging`` when it is constructed (on a joined cluster
  it is also the job's ``worker_process_setup_hook``): a record of a ``mineonline*`` logger leaves
  the process as one stderr line starting with ``MARK``; other records are printed as Python's
  last-resort handler would print them;
* Ray streams every actor's output to the driver (``log_to_driver``); ``RunLog`` takes the place of
  Ray's printer on its stream dispatcher, writes every line to ``run.log`` and prints the marked
  lines, one each (a traceback's further lines go to the file);
* on the driver, Ray's logger and Python warnings are routed to the file, mineonline's records at
  WARNING and above to the console as one line each.

A write to ``run.log`` that fails (the disk full) is remembered, not printed: Python's logging would
print a "--- Logging error ---" traceback for every record after it, and closing the file would raise
the same ``OSError`` last. The console keeps the run's own message, whose log line then says the file
is incomplete and why.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

LOG_FILE = "run.log"
MARK = "[mineonline] "
#: Passed to ``ray.init(runtime_env=...)`` when joining a cluster, so that every process marks mineonline's records.
SETUP_HOOK = "mineonline_core.services.runlog.setup_actor_logging"
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _ours(record: logging.LogRecord) -> bool:
    return record.name.startswith("mineonline")  # the core, its plugins, the driver ("mineonline")


# ``package.Type: message`` (or Ray's ``package.Type(Cause): message``) at the start of a line: the
# line that ends a Python traceback.
_EXCEPTION_LINE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Failure|Fault|Exit|Interrupt)(?:\([\w.]+\))?): ?(?P<msg>.*)$"
)
# Errors that wrap another one: Ray's, and ours that carry a failure from another process.
_WRAPPERS = ("ray.", "RayTaskError", "RunFailedError", "EnvFailure", "ActorDiedError")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def one_line(text: str) -> str:
    """``text`` without colour codes and without a traceback that starts on its line."""
    text = _ANSI.sub("", text)
    return (
        text[: text.index("Traceback (most recent call last)")].rstrip()
        if "Traceback (most recent call last)" in text
        else text.strip()
    )


def console_error(exc: BaseException) -> str:
    """What the console shows for a failed run, from an error that may carry the tracebacks of the
    processes it crossed (``run.log`` keeps them): mineonline's innermost message, the log file,
    and last the root cause, the exception type and message of the process where it happened."""
    text = _ANSI.sub("", str(exc)).strip()
    log_path = getattr(exc, "run_log", None)
    log_line = [f"(full log: {log_path})"] if log_path else []
    if "Traceback (most recent call last)" not in text and '\n  File "' not in text:
        return "\n".join([text, *log_line])  # a message written for the user: as it is
    headline: list[str] = []
    cause = None
    collecting = False
    for line in text.splitlines():
        match = _EXCEPTION_LINE.match(line)
        if match and "mineonline" in match["type"]:
            headline, collecting = [match["msg"]], True
        elif match and match["type"].startswith("ray."):
            collecting = False
        elif (
            collecting
            and line.strip()
            and not line[:1].isspace()
            and not line.startswith(("During handling", "The above"))
        ):
            headline.append(line)
        if match and not any(w in match["type"] for w in _WRAPPERS):
            cause = f"{match['type'].rsplit('.', 1)[-1]}: {match['msg']}"
    body = " ".join(one_line(part) for part in headline if one_line(part)) or one_line(text.splitlines()[0])
    if cause is not None and cause.endswith(body):
        cause = None  # mineonline's own error is the root cause: said once, as for a driver-side error
    return "\n".join([body, *log_line, *([f"root cause: {cause}"] if cause else [])])


class _ActorFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{MARK}{record.levelname}: {text}" if _ours(record) else text


def setup_actor_logging() -> None:
    """In an actor process: records at WARNING and above go to stderr, mineonline's marked. Elsewhere
    (the driver, a test using an actor class as a plain object) nothing changes."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    root = logging.getLogger()
    if any(isinstance(h.formatter, _ActorFormatter) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_ActorFormatter("%(message)s"))
    root.addHandler(handler)


class _OneLine(logging.Formatter):
    """``LEVEL: message`` without the traceback (it is in the file)."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname}: {record.getMessage()}"

    def formatException(self, ei: Any) -> str:  # noqa: N802 - logging's name
        return ""


class _Console(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time, so rich's live display can move the line above itself."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class _FileHandler(logging.StreamHandler):
    """``run.log``'s handler: a failed write goes to ``on_failure`` instead of stderr."""

    def __init__(self, stream: TextIO, on_failure: Any) -> None:
        super().__init__(stream)
        self._on_failure = on_failure

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self._on_failure(error)
        else:
            super().handleError(record)


class RunLog:
    """Context manager around one run: installs the routing above, restores everything on exit."""

    def __init__(self, run_dir: str | Path, *, verbose: bool = False) -> None:
        self.path = Path(run_dir) / LOG_FILE
        self.verbose = verbose
        self._file: TextIO | None = None
        self._lock = threading.Lock()
        self._handlers: list[tuple[logging.Logger, logging.Handler]] = []
        self._ray_handlers: list[logging.Handler] = []
        self._levels: list[tuple[logging.Logger, int]] = []
        self._ray_printer: Any = None
        self.write_failure: OSError | None = None  # the first failed write to run.log

    def __enter__(self) -> RunLog:
        import ray  # noqa: F401 - Ray's logger gets its console handler when ray is imported

        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed in __exit__
        file_handler = _FileHandler(self._file, self._failed)
        file_handler.setFormatter(logging.Formatter(_FILE_FORMAT))
        console = _Console()
        console.setFormatter(_OneLine())
        if self.verbose:
            console.setLevel(logging.INFO)
            console.addFilter(lambda r: not r.name.startswith("ray"))  # Ray's own handler prints those
        else:
            console.setLevel(logging.WARNING)
            console.addFilter(_ours)
        root, ray_logger = logging.getLogger(), logging.getLogger("ray")
        for logger, handler in ((root, file_handler), (root, console)):
            logger.addHandler(handler)
            self._handlers.append((logger, handler))
        if not ray_logger.propagate:
            ray_logger.addHandler(file_handler)
            self._handlers.append((ray_logger, file_handler))
        for name in ("mineonline", "mineonline_core"):
            logger = logging.getLogger(name)
            self._levels.append((logger, logger.level))
            logger.setLevel(logging.INFO)
        if not self.verbose:
            # Ray's driver-side messages (token auth, "Started a local Ray instance", Ray Train's
            # progress) are for the file; -v keeps Ray's own console handler.
            self._ray_handlers = [h for h in ray_logger.handlers if h is not file_handler]
            for handler in self._ray_handlers:
                ray_logger.removeHandler(handler)
        logging.captureWarnings(True)
        self.attach_actor_output()
        return self

    def attach_actor_output(self) -> None:
        """Take over Ray's printer of actor output (call again after ``ray.init`` installed it)."""
        if self._ray_printer is not None:
            return
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        printers = [h for name, h in dispatcher.handlers if name == "ray_print_logs"]
        if not printers:
            return  # Ray not started yet, or started with log_to_driver=False
        self._ray_printer = printers[0]
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("mineonline_run_log", self._on_actor_output)

    def _on_actor_output(self, data: dict[str, Any]) -> None:
        if self.verbose:
            self._ray_printer(data)
        if data.get("pid") == "autoscaler":
            return  # the local autoscaler's status table every 5 s: Ray prints only its events, so do we (-v)
        source = f"{data.get('actor_name') or data.get('task_name') or 'ray'} pid={data.get('pid')}"
        lines = data.get("lines", [])
        with self._lock:
            if self._file is not None:
                try:
                    self._file.writelines(f"({source}) {line}\n" for line in lines)
                except OSError as exc:
                    self._failed(exc)
        if self.verbose:
            return
        who = data.get("actor_name") or data.get("task_name") or "ray"
        for line in lines:
            if line.startswith(MARK):
                print(f"{one_line(line[len(MARK) :])} ({who})", file=sys.stderr, flush=True)

    def _failed(self, exc: OSError) -> None:
        if self.write_failure is None:
            self.write_failure = exc

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            # The console gets the error's message from the CLI; the file keeps its traceback.
            logging.getLogger("mineonline").info("run ended with %s", type(exc).__name__, exc_info=(exc_type, exc, tb))
        if self._ray_printer is not None:
            import ray
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

            dispatcher.remove_handler("mineonline_run_log")
            if ray.is_initialized():  # a cluster the caller started: give Ray its printer back
                dispatcher.add_handler("ray_print_logs", self._ray_printer)
        ray_logger = logging.getLogger("ray")
        for handler in self._ray_handlers:
            ray_logger.addHandler(handler)
        for logger, handler in self._handlers:
            logger.removeHandler(handler)
        for logger, level in self._levels:
            logger.setLevel(level)
        logging.captureWarnings(False)
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()  # flushes what a full disk refused, and fails the same way
                except OSError as error:
                    self._failed(error)
                self._file = None
        failure = self.write_failure
        note = f"writing it failed ([Errno {failure.errno}] {failure.strerror})" if failure is not None else ""
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            # Read by console_error, which names the run log in the failure it prints.
            exc.run_log = f"{self.path}, incomplete: {note}" if note else str(self.path)  # type: ignore[attr-defined]
        elif note:
            print(f"WARNING: {self.path} is incomplete: {note}", file=sys.stderr, flush=True)
