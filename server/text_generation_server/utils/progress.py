"""Progress of a long command-line job: a live bar on a terminal, plain log lines elsewhere.

`quantize` runs for seconds on a toy model and for hours on a 70B one, and most of that
time is spent inside single torch calls. Silence of more than a few seconds reads as a
hang, so progress is reported by a small background thread rather than only when the
job reaches a checkpoint: on a terminal it redraws a tqdm bar every second (the elapsed
time and ETA keep moving during a long matmul); when stderr is a file or a pipe (CI
logs, `2> log.txt`) it writes one loguru line every `interval` seconds instead, since a
redrawn bar there is only noise.

The job is described as a number of work units known up front (calibration batches and
solves in `quantize`); the caller names the current item (a decoder layer) and step (a
calibration pass, a solve) and calls `advance` as units finish. The ETA is the average
time per unit so far times the units left.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

from loguru import logger


def clock(seconds: float) -> str:
    """h:mm:ss, the form every progress line uses."""
    seconds = int(round(max(0.0, seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _columns(stream: TextIO) -> int:
    """The terminal width behind `stream`, 0 when unknown."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class Progress:
    """One job's progress; use as a context manager so the reporter thread always stops."""

    def __init__(
        self,
        total: float,
        *,
        title: str = "progress",
        stream: TextIO | None = None,
        live: bool | None = None,
        interval: float = 5.0,
        refresh: float = 1.0,
        time_source: Callable[[], float] = time.monotonic,
    ):
        if total <= 0:
            raise ValueError(f"a job needs a positive amount of work, got {total}")
        if interval <= 0 or refresh <= 0:
            raise ValueError("progress intervals must be positive")
        self.total = float(total)
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty()) if live is None else live
        self.interval = interval
        self.refresh_every = refresh
        self._now = time_source
        self.started = self._now()
        self.done = 0.0
        self.item_label = ""
        self.step_label = ""
        self.step_done = 0
        self.step_total = 0
        self.unit = "batch"
        self._last_line = self.started
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._overall = self._step_bar = None
        if self.live:
            from tqdm import tqdm

            # Follow the terminal's size where it has one; a pseudo-terminal without a size (some CI
            # runners, `script`) reports 0 x 0, on which tqdm would draw nothing.
            dynamic = _columns(self.stream) > 0
            shape = dict(dynamic_ncols=True) if dynamic else dict(ncols=100, nrows=24)
            self._tqdm = tqdm
            self._overall = tqdm(total=self.total, file=self.stream, position=0, smoothing=0, mininterval=0.2,
                                 bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}", **shape)
            self._overall.set_description_str(title, refresh=False)
            self._step_bar = tqdm(total=1, file=self.stream, position=1, leave=False, mininterval=0.2, unit="steps",
                                  desc="starting", bar_format="  {desc}: {n_fmt}/{total_fmt} {unit} [{rate_fmt}]",
                                  **shape)
        self._thread = threading.Thread(target=self._report, name=f"{title}-progress", daemon=True)
        self._thread.start()

    # -- what the job calls -----------------------------------------------------------
    def item(self, label: str) -> None:
        """The top-level piece of work now running (e.g. 'layer 3/32')."""
        self.item_label = label
        if self._overall is not None:
            self._overall.set_description_str(f"{self.title} {label}")

    def step(self, label: str, count: int, unit: str = "batch") -> None:
        """A new step of the current item, made of `count` units (calibration batches, a solve)."""
        with self._lock:
            self.step_label, self.step_done, self.step_total, self.unit = label, 0, max(0, count), unit
        if self._step_bar is not None:
            self._step_bar.reset(total=max(1, count))
            self._step_bar.unit = unit + ("es" if unit.endswith("ch") else "s")
            self._step_bar.set_description_str(label)

    def advance(self, units: float = 1.0) -> None:
        """`units` of the current step finished."""
        with self._lock:
            self.done = min(self.total, self.done + units)
            self.step_done += 1
        if self._overall is not None:
            self._overall.update(units)
            self._step_bar.update(1)

    def log(self, message: str, *args) -> None:
        """An INFO line (loguru) that does not tear the live bar: the bar is cleared and redrawn."""
        self._last_line = self._now()
        if self._overall is not None:
            with self._tqdm.external_write_mode(file=self.stream):
                logger.opt(depth=1).info(message, *args)
        else:
            logger.opt(depth=1).info(message, *args)

    def status(self) -> str:
        """The one-line state: what is running, how far along, elapsed and ETA."""
        with self._lock:
            done, step, step_done, step_total, unit = (self.done, self.step_label, self.step_done, self.step_total,
                                                       self.unit)
        elapsed = self._now() - self.started
        eta = clock(elapsed / done * (self.total - done)) if done > 0 else "?"
        where = ", ".join(part for part in (self.item_label, step) if part)
        if step_total:
            where += f" {min(step_done, step_total)}/{step_total} {unit}" + ("es" if unit.endswith("ch") else "s")
        return f"{self.title}: {where}; {100 * done / self.total:.0f}% done, elapsed {clock(elapsed)}, ETA {eta}"

    # -- the reporter -----------------------------------------------------------------
    def _report(self) -> None:
        wait = self.refresh_every if self.live else min(self.interval, self.refresh_every)
        while not self._stop.wait(wait):
            if self.live:
                self._overall.refresh()
                self._step_bar.refresh()
            elif self._now() - self._last_line >= self.interval:
                self._last_line = self._now()
                logger.info("{}", self.status())

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self._overall is not None:
            self._step_bar.close()
            self._overall.close()
            self._overall = self._step_bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
