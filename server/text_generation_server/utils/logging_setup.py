"""Logging of `serve`'s processes: one stderr sink per process, plain or JSON.

Owns the loguru configuration the launcher and every rank set up first thing: the
`component` tag ("launcher", "rank 1") that keeps interleaved output readable, and the
flat JSON lines (TGI's launcher shape) that log collectors parse, into which the logging
module, Python warnings and uncaught exceptions are routed as well.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from datetime import timezone

from loguru import logger

from text_generation_server.settings.serve_flags import parse_log_level


def check_logger_level(level: str) -> str:
    """The loguru level name for ours or TGI's LOG_LEVEL spelling; ValueError naming --logger-level otherwise."""
    return parse_log_level(level, "--logger-level")


def json_log_line(record: dict) -> str:
    """One loguru record as the flat JSON object log collectors expect (TGI's launcher shape):
    timestamp (RFC 3339, UTC), level, message, target (the module), then the bound fields
    (component, request_id, ...) and the traceback, if any, as `exception`."""
    entry: dict[str, object] = {
        "timestamp": record["time"].astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "level": record["level"].name,
        "message": record["message"],
        "target": record["name"],
    }
    for key, value in record["extra"].items():
        if key not in entry:
            entry[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    if record["exception"] is not None:
        kind, value, tb = record["exception"]
        entry["exception"] = "".join(traceback.format_exception(kind, value, tb))
    return json.dumps(entry)


def _json_sink(message) -> None:
    # sys.stderr looked up per line, so a replaced stderr (pytest's capture) receives it.
    sys.stderr.write(json_log_line(message.record) + "\n")
    sys.stderr.flush()


class _StdlibToLoguru(logging.Handler):
    """Records of the logging module (grpc, torch.distributed, py.warnings) through loguru, so
    JSON output stays one object per line; the target is the stdlib logger's name."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.patch(lambda r: r.update(name=record.name)).opt(exception=record.exc_info).log(
            level, "{}", record.getMessage()
        )


def _log_uncaught(kind, value, tb) -> None:
    logger.opt(exception=(kind, value, tb)).critical("uncaught {}: {}", kind.__name__, value)


def configure_logging(level: str, json_output: bool, component: str) -> None:
    """One stderr sink; `component` ("launcher", "rank 1") tags every line so interleaved output stays readable.

    With json_output every line on stderr is a JSON object (`json_log_line`): Python warnings,
    the logging module and uncaught exceptions go through loguru too.
    """
    level = check_logger_level(level)
    logger.remove()
    logger.configure(extra={"component": component})
    if json_output:
        logger.add(_json_sink, level=level, format="{message}", backtrace=False, diagnose=False)
        logging.basicConfig(handlers=[_StdlibToLoguru()], level=logging.WARNING, force=True)
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        return
    fmt = (
        "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> | <level>{level: <8}</level> | "
        "<cyan>{extra[component]}</cyan> | {name}:{line} - <level>{message}</level>"
    )
    logger.add(sys.stderr, level=level, format=fmt, backtrace=False, diagnose=False)
