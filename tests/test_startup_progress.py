"""A rank's startup report (utils/progress.py StartupProgress): a log line per phase off a
terminal, a live line on one that log lines never tear, and the tensor count of loading."""

from __future__ import annotations

import io
import time

from loguru import logger

from text_generation_server.utils.progress import (
    CountingSource,
    StartupProgress,
    current_startup,
    finish_startup,
    startup_advance,
    startup_phase,
)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def capture():
    lines: list[str] = []
    return lines, logger.add(lambda m: lines.append(m.record["message"]), level="INFO")


def test_off_a_terminal_each_phase_ends_with_one_line():
    clock = Clock()
    lines, sink = capture()
    try:
        with StartupProgress(stream=io.StringIO(), time_source=clock) as progress:
            assert current_startup() is progress
            startup_phase("loading weights", 3, "tensors")
            startup_advance(3)
            clock.now += 2.5
            assert progress.status() == "startup: loading weights 3/3 tensors, 2.5 s (total 2.5 s)"
            startup_phase("warmup")
            clock.now += 1.0
            finish_startup("ready")
        assert current_startup() is None
    finally:
        logger.remove(sink)
    assert lines == ["startup: loading weights: 3 tensors in 2.5 s", "startup: warmup in 1.0 s",
                     "startup: ready after 3.5 s"]
    assert progress.phases == [("loading weights", 2.5), ("warmup", 1.0)]


def test_without_a_startup_reporting_does_nothing():
    assert current_startup() is None
    startup_phase("anything")
    startup_advance()
    finish_startup("ready")


def test_on_a_terminal_the_live_line_is_cleared_before_each_log_line():
    stream = io.StringIO()
    lines, sink = capture()
    try:
        with StartupProgress(stream=stream, live=True, refresh=0.01):
            startup_phase("loading weights", 2, "tensors")
            startup_advance()
            deadline = time.monotonic() + 5
            while "loading weights 1/2 tensors" not in stream.getvalue() and time.monotonic() < deadline:
                time.sleep(0.01)
            logger.info("a line from elsewhere")
    finally:
        logger.remove(sink)
    text = stream.getvalue()
    assert "\r\x1b[Kstartup: loading weights 1/2 tensors" in text
    assert text.endswith("\r\x1b[K")  # nothing left drawn once closed
    assert "a line from elsewhere" in lines


def test_tensors_are_counted_once_each():
    class Source:
        def keys(self):
            return ["a", "b"]

        def get_slice(self, name):
            return name.upper()

        def describe(self, name):
            return "file"

    progress = StartupProgress(stream=io.StringIO(), live=False)
    progress.phase("loading weights", 2, "tensors")
    counted = CountingSource(Source(), progress)
    assert [counted.get_slice(n) for n in ("a", "a", "b")] == ["A", "A", "B"]
    assert counted.keys() == ["a", "b"] and counted.describe("a") == "file"
    assert progress.status().startswith("startup: loading weights 2/2 tensors")
    progress.close()


# -- the launcher starts its ranks before importing torch -------------------------------------------
def test_the_launcher_knows_the_dtypes_without_importing_the_models():
    from text_generation_server.launcher.supervisor import DTYPE_NAMES
    from text_generation_server.models.loader import DTYPES

    assert set(DTYPE_NAMES) == set(DTYPES)


def test_without_a_gpu_driver_the_device_is_the_cpu(tmp_path, monkeypatch):
    from text_generation_server.launcher import supervisor
    from text_generation_server.settings.serve_args import ServeArgs

    assert supervisor.no_gpu_driver([str(tmp_path / "nvidia0")])
    (tmp_path / "nvidia0").touch()
    assert not supervisor.no_gpu_driver([str(tmp_path / "nvidia0")])
    monkeypatch.setattr(supervisor, "no_gpu_driver", lambda: True)
    assert supervisor.pick_device(ServeArgs()) == "cpu"


def test_the_native_kernels_are_built_as_a_phase_only_where_layers_use_them(tmp_path):
    import json

    from text_generation_server.launcher.rank import needs_native_kernels
    from text_generation_server.settings.serve_args import ServeArgs

    # The embedded model in float32 (serve's CPU default): its dense layers decode natively too.
    assert needs_native_kernels(ServeArgs())
    assert needs_native_kernels(ServeArgs(dtype="float32"))
    assert needs_native_kernels(ServeArgs(dtype="bfloat16"))
    assert needs_native_kernels(ServeArgs(quantize="eetq"))
    assert not needs_native_kernels(ServeArgs(dtype="float16"))  # float16 layers keep torch's ops
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    assert needs_native_kernels(ServeArgs(model=str(tmp_path), dtype="float16"))
    (tmp_path / "config.json").write_text("{}")
    assert not needs_native_kernels(ServeArgs(model=str(tmp_path), dtype="float16"))
