"""A real Prometheus for tests: found installed, or Debian's package unpacked without root.

Lookup order: $TGS_PROMETHEUS (a binary), `prometheus` on PATH, /usr/bin/prometheus,
then a cache folder ($XDG_CACHE_HOME or ~/.cache, text-generation-server/prometheus-<arch>)
that is filled on first use with `apt-get download prometheus` + `dpkg -x` (no root
needed where apt's package lists are present; as root, `apt-get update` runs first
when they are not). Anything else is an error naming what to install, never a skip: the
dashboard test is how CI knows TGI's dashboard works against us.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

PROMETHEUS_ENV = "TGS_PROMETHEUS"


class PrometheusUnavailable(RuntimeError):
    """No Prometheus binary and no way to fetch one; the message says what to install."""


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "text-generation-server" / f"prometheus-{platform.machine()}"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def fetch_debian_prometheus(dest: Path) -> Path:
    """Debian's prometheus package unpacked under dest (dest/usr/bin/prometheus)."""
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise PrometheusUnavailable(
                f"no prometheus binary and no {tool} to fetch Debian's package: install Prometheus "
                f"(e.g. apt-get install prometheus) or set {PROMETHEUS_ENV} to its binary")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)  # apt's unprivileged _apt user writes the .deb here when run as root
        got = _run(["apt-get", "download", "prometheus"], work)
        if got.returncode != 0 and os.geteuid() == 0:
            _run(["apt-get", "update", "-qq"], work)
            got = _run(["apt-get", "download", "prometheus"], work)
        debs = sorted(work.glob("prometheus_*.deb"))
        if got.returncode != 0 or not debs:
            raise PrometheusUnavailable(
                f"apt-get download prometheus failed ({got.returncode}): {got.stderr.strip()[-500:]}; install "
                f"Prometheus (apt-get install prometheus) or set {PROMETHEUS_ENV} to its binary")
        root = work / "root"
        unpacked = _run(["dpkg", "-x", str(debs[0]), str(root)], work)
        if unpacked.returncode != 0 or not (root / "usr/bin/prometheus").exists():
            raise PrometheusUnavailable(f"dpkg -x {debs[0].name} failed: {unpacked.stderr.strip()[-500:]}")
        try:
            root.rename(dest)  # atomic: a concurrent fetch either wins or finds dest complete
        except OSError:
            if not (dest / "usr/bin/prometheus").exists():
                raise
    return dest / "usr/bin/prometheus"


def find_prometheus() -> Path:
    explicit = os.environ.get(PROMETHEUS_ENV)
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PrometheusUnavailable(f"{PROMETHEUS_ENV}={explicit} is not an executable file")
        return path
    for candidate in (shutil.which("prometheus"), "/usr/bin/prometheus", cache_dir() / "usr/bin/prometheus"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return fetch_debian_prometheus(cache_dir())


SCRAPE_INTERVAL = "250ms"


class PrometheusServer:
    """Prometheus on loopback scraping `targets` every SCRAPE_INTERVAL, with `labels` on every series.

    A quarter second: a test's burst of requests on a tiny model can end within one second (chains
    of steps ahead, the router's pace), and a gauge it raised must still be seen."""

    def __init__(self, binary: Path, workdir: Path, port: int, targets: list[str], labels: dict[str, str]):
        self.url = f"http://127.0.0.1:{port}"
        config = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL,
                       "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [{"job_name": "tgs", "static_configs": [{"targets": targets, "labels": labels}]}],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.log_path = workdir / "prometheus.log"
        cmd = [str(binary), f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as resp:
            return json.loads(resp.read())

    def api(self, path: str, **params):
        """GET /api/v1/<path>; the `data` of a successful answer (AssertionError with the error otherwise)."""
        body = self._get(f"/api/v1/{path}", **params)
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        return data["result"]

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {timeout_s:.0f} s:\n{self.log()[-3000:]}")

    def wait_for(self, expr: str, predicate, timeout_s: float = 30.0) -> list[dict]:
        """Queries expr until predicate(result) holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr} never reached the expected state; last result: {result}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
