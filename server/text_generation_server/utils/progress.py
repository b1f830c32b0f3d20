"""Progress of a long command-line job (`quantize`) and of a rank's startup: a live bar or line on a
terminal, plain log lines elsewhere.

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


class StartupProgress:
    """A rank's startup, phase by phase (loading weights n/N, building kernels, warmup).

    Starting a server is a few seconds to minutes of silence otherwise. On a terminal, one live
    line is redrawn every `refresh` seconds ("startup: loading weights 120/291 tensors, 3.2 s")
    and cleared before every log line of this process (a loguru patcher runs before the sinks
    write), so log lines never tear it; elsewhere (a file, a pipe, a log collector) each phase
    ends with one log line saying what it did and how long it took, as `quantize` does.

    Code deep in loading reaches the running instance through `current_startup()`, so no
    argument is threaded through every loader; with none running, reporting does nothing.
    """

    def __init__(self, *, stream: TextIO | None = None, live: bool | None = None, refresh: float = 0.5,
                 time_source: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty()) if live is None else live
        self._now = time_source
        self.started = self._now()
        self.phases: list[tuple[str, float]] = []  # (name, seconds) of the phases ended
        self._phase: str | None = None
        self._phase_started = self.started
        self._done = 0
        self._total = 0
        self._unit = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._drawn = False
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.live:
            logger.configure(patcher=self._before_log)
            self._thread = threading.Thread(target=self._redraw, args=(refresh,), name="startup-progress",
                                            daemon=True)
            self._thread.start()

    # -- what startup calls -----------------------------------------------------------------
    def phase(self, name: str, total: int = 0, unit: str = "") -> None:
        """A new phase begins (the previous one ends); `total` units of it when known."""
        self._end_phase()
        with self._lock:
            self._phase, self._phase_started = name, self._now()
            self._done, self._total, self._unit = 0, max(total, 0), unit

    def advance(self, units: int = 1) -> None:
        with self._lock:
            self._done += units

    def status(self) -> str:
        """The live line's text."""
        with self._lock:
            name, done, total, unit, since = self._phase, self._done, self._total, self._unit, self._phase_started
        if name is None:
            return f"startup: {self._now() - self.started:.1f} s"
        count = f" {done}/{total} {unit}" if total else (f" {done} {unit}" if unit else "")
        return f"startup: {name}{count}, {self._now() - since:.1f} s (total {self._now() - self.started:.1f} s)"

    def close(self) -> None:
        """Ends the last phase; clears the live line and stops its thread (once)."""
        if self._closed:
            return
        self._closed = True
        self._end_phase()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
            logger.configure(patcher=None)
        self._clear()
        if _current and _current[-1] is self:
            _current.pop()

    def __enter__(self) -> "StartupProgress":
        _current.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside -------------------------------------------------------------------------------
    def _end_phase(self) -> None:
        with self._lock:
            name, done, unit, since = self._phase, self._done, self._unit, self._phase_started
            self._phase = None
        if name is None:
            return
        seconds = self._now() - since
        self.phases.append((name, seconds))
        count = f": {done} {unit}" if unit else ""
        logger.info("startup: {}{} in {:.1f} s", name, count, seconds)

    def _before_log(self, record) -> None:
        self._clear()

    def _clear(self) -> None:
        if self.live and self._drawn:
            self._drawn = False
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _redraw(self, every: float) -> None:
        while not self._stop.wait(every):
            text = self.status()
            columns = _columns(self.stream) or 100
            self.stream.write("\r\x1b[K" + text[: columns - 1])
            self.stream.flush()
            self._drawn = True


_current: list[StartupProgress] = []


def current_startup() -> StartupProgress | None:
    """The startup being reported in this process, if any."""
    return _current[-1] if _current else None


def startup_phase(name: str, total: int = 0, unit: str = "") -> None:
    """Begins a phase of the running startup; does nothing when none is reported."""
    progress = current_startup()
    if progress is not None:
        progress.phase(name, total, unit)


def startup_advance(units: int = 1) -> None:
    progress = current_startup()
    if progress is not None:
        progress.advance(units)


def finish_startup(summary: str = "") -> None:
    """Ends the running startup's report (a rank is serving); logs `summary` with its total time."""
    progress = current_startup()
    if progress is not None:
        progress.close()
        if summary:
            logger.info("startup: {} after {:.1f} s", summary, progress._now() - progress.started)


class CountingSource:
    """A checkpoint's tensor source (quantizers.sources.TensorSource) that advances the running
    startup's count once per tensor opened, for the live "loading weights n/N tensors" line."""

    wraps_source = True  # Weights.stored looks through it (a GGUF loader needs the GGUFSource itself)

    def __init__(self, inner, progress: StartupProgress):
        self.inner = inner
        self.progress = progress
        self._seen: set[str] = set()

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name: str):
        if name not in self._seen:
            self._seen.add(name)
            self.progress.advance()
        return self.inner.get_slice(name)

    def describe(self, name: str) -> str:
        return self.inner.describe(name)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
