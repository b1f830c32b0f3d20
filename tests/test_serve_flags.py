"""`serve`'s flags as a TGI user gives them: environment variables, TGI's names, refused TGI flags.

Each test runs the real `serve` command in-process (typer's runner) with `launch` replaced by
a recorder, so what is checked is the ServeArgs the launcher would get and the warnings it
would log. Every variable `serve` reads is cleared first, whatever the machine has set.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import warnings as pywarnings

import pytest
import typer
from loguru import logger
from typer.testing import CliRunner

from text_generation_server.cli import main as cli
from text_generation_server.launcher import process_exit, rank
from text_generation_server.launcher import supervisor as launcher
from text_generation_server.utils import logging_setup
from text_generation_server.settings.serve_args import ATTENTION_BACKENDS, DEFAULT_CUDA_GRAPHS, ServeArgs, flag_of
from text_generation_server.settings.serve_flags import (
    CUSTOM_KERNELS,
    TGI_ONLY_FLAGS,
    parse_cuda_graphs,
    parse_log_level,
    resolve_num_shard,
)

SERVE = typer.main.get_command(cli.app).commands["serve"]


def envvars_of(param) -> list[str]:
    return [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())


ALL_ENVVARS = cli.serve_environment_variables()


@dataclasses.dataclass
class Run:
    code: int
    output: str
    args: ServeArgs | None
    warnings: list[str]


@pytest.fixture
def serve(monkeypatch):
    """serve(*argv, **env) -> Run: the command with `launch` recorded instead of run."""
    for name in ALL_ENVVARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(rank.SERVE_ARGS_ENV, raising=False)
    seen: dict = {}

    def fake_launch(args, startup_timeout_s=600.0, warnings=()):
        seen["args"], seen["warnings"] = args, list(warnings)
        return 0

    monkeypatch.setattr(launcher, "launch", fake_launch)

    def run(*argv: str, **env: str) -> Run:
        seen.clear()
        result = CliRunner().invoke(cli.app, ["serve", *argv], env=env)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return Run(result.exit_code, result.output, seen.get("args"), seen.get("warnings", []))

    return run


def ok(run: Run) -> ServeArgs:
    assert run.code == 0, run.output
    assert run.args is not None
    return run.args


# -- every flag from the environment -------------------------------------------------------------
# variable -> (value, ServeArgs field, expected)
ENV_CASES = {
    "MODEL_ID": ("/models/llama", "model", "/models/llama"),
    "HOSTNAME": ("0.0.0.0", "hostname", "0.0.0.0"),
    "PORT": ("8081", "port", 8081),
    "METRICS_PORT": ("9100", "metrics_port", 9100),
    "PROMETHEUS_PORT": ("9200", "metrics_port", 9200),
    "UDS_PATH": ("/tmp/x", "uds_path", "/tmp/x"),
    "SHARD_UDS_PATH": ("/tmp/y", "uds_path", "/tmp/y"),
    "NUM_SHARD": ("3", "num_shard", 3),
    "QUANTIZE": ("gptq", "quantize", "gptq"),
    "DTYPE": ("bfloat16", "dtype", "bfloat16"),
    "DEVICE": ("cpu", "device", "cpu"),
    "MAX_INPUT_TOKENS": ("100", "max_input_tokens", 100),
    "MAX_INPUT_LENGTH": ("101", "max_input_tokens", 101),
    "MAX_TOTAL_TOKENS": ("300", "max_total_tokens", 300),
    "MAX_STOP_SEQUENCES": ("2", "max_stop_sequences", 2),
    "MAX_STOP_SEQUENCE_LENGTH": ("30", "max_stop_sequence_length", 30),
    "MAX_TOP_N_TOKENS": ("3", "max_top_n_tokens", 3),
    "MAX_INPUT_CHARS": ("5000", "max_input_chars", 5000),
    "MAX_MESSAGE_BYTES": ("65536", "max_message_bytes", 65536),
    "PAYLOAD_LIMIT": ("2000000", "max_message_bytes", 2000000),
    "MAX_CONCURRENT_REQUESTS": ("7", "max_concurrent_requests", 7),
    "MAX_BATCH_PREFILL_TOKENS": ("4096", "max_batch_prefill_tokens", 4096),
    "MAX_BATCH_TOTAL_TOKENS": ("8192", "max_batch_total_tokens", 8192),
    "MAX_BATCH_SIZE": ("12", "max_batch_size", 12),
    "MAX_WAITING_TOKENS": ("5", "max_waiting_tokens", 5),
    "WAITING_SERVED_RATIO": ("0.3", "waiting_served_ratio", 0.3),
    "BLOCK_SIZE": ("32", "block_size", 32),
    "MEMORY_FRACTION": ("0.5", "memory_fraction", 0.5),
    "CUDA_MEMORY_FRACTION": ("0.8", "cuda_memory_fraction", 0.8),
    "KV_CACHE_DTYPE": ("fp8", "kv_cache_dtype", "fp8_e4m3fn"),
    "KV_CACHE_FP8_SKIP_LAYERS": ("1, 0,5-6", "kv_cache_fp8_skip_layers", "0-1,5-6"),
    "PREFIX_CACHING": ("0", "prefix_caching", False),
    "LORA_ADAPTERS": ("a=/x/a,/y/b", "lora_adapters", ["a=/x/a", "b=/y/b"]),
    "MAX_LORAS": ("4", "max_loras", 4),
    "MAX_LORA_RANK": ("16", "max_lora_rank", 16),
    "USE_PREFIX_CACHING": ("false", "prefix_caching", False),
    "CUDA_GRAPHS": ("1,2,4", "cuda_graphs", [1, 2, 4]),
    "ATTENTION_BACKEND": ("torch-sdpa", "attention_backend", "torch-sdpa"),
    "MODEL_IMPL": ("transformers", "model_impl", "transformers"),
    "SPECULATE": ("2", "speculate", 2),
    "QUANTIZE_LM_HEAD": ("int8", "quantize_lm_head", "int8"),
    "DISABLE_CUSTOM_KERNELS": ("true", "disable_custom_kernels", True),
    "ALLOW_DENSE_FALLBACK": ("1", "allow_dense_fallback", True),
    "TGS_CPU_ISA": ("avx2", "cpu_isa", "avx2"),
    "TGS_CPU_INT8_ACTIVATIONS": ("off", "cpu_int8_activations", "off"),
    "TGS_CPU_AFFINITY": ("off", "cpu_affinity", "off"),
    "DISABLE_GRAMMAR_SUPPORT": ("true", "disable_grammar_support", True),
    "DRAIN_TIMEOUT_S": ("12.5", "drain_timeout_s", 12.5),
    "SHARD_IN_PROCESS": ("true", "shard_in_process", True),
    "GRACEFUL_TERMINATION_TIMEOUT": ("90", "drain_timeout_s", 90.0),
    "RANK_STALL_TIMEOUT_S": ("30", "rank_stall_timeout_s", 30.0),
    "LOGGER_LEVEL": ("debug", "logger_level", "DEBUG"),
    "LOG_LEVEL": ("warn", "logger_level", "WARNING"),
    "JSON_OUTPUT": ("true", "json_output", True),
    "SHARDED": ("false", "num_shard", 1),
    "API_KEY": ("old-key,new-key", "api_keys", ["old-key", "new-key"]),
    "METRICS_HOSTNAME": ("0.0.0.0", "metrics_hostname", "0.0.0.0"),
    "HTTP_PORT": ("8080", "http_port", 8080),
    "CORS_ALLOW_ORIGIN": ("https://a.example, https://b.example", "cors_allow_origin",
                          ["https://a.example", "https://b.example"]),
    "MAX_CLIENT_BATCH_SIZE": ("8", "max_client_batch_size", 8),
    "TOOL_CALL_PARSER": ("mistral", "tool_call_parser", "mistral"),
    "LORA_LOAD_DIR": ("/tmp", "lora_load_dir", "/tmp"),
}
# Variables naming files that must exist and load (key file, certificates) or that need another
# flag: tests/test_auth_tls_unit.py::test_every_security_setting_reads_its_variable.
SECURITY_FILE_VARIABLES = {"API_KEY_FILE", "API_KEY_PROTECTS_HEALTH", "TLS_CERT_PATH", "TLS_KEY_PATH",
                           "TLS_CLIENT_CA_PATH"}


# -- the flag set: a contract -----------------------------------------------------------------------------
# Every option of `serve` but the hidden TGI-only ones, in --help's order: (names, variables, default, hidden).
# The options are built from the ServeArgs fields' declarations; this list is what users rely on.
FLAG_SET = [
    ("MODEL_DIR", None, None, False),
    ("--model-id", "MODEL_ID", None, False),
    ("--hostname", "HOSTNAME", "127.0.0.1", False),
    ("--port", "PORT", 50051, False),
    ("--metrics-port", "METRICS_PORT", 9000, False),
    ("--prometheus-port", "PROMETHEUS_PORT", None, False),
    ("--uds-path", "UDS_PATH", "/tmp/text-generation-server", False),
    ("--shard-uds-path", "SHARD_UDS_PATH", None, False),
    ("--metrics-hostname", "METRICS_HOSTNAME", None, False),
    ("--api-key", "API_KEY", [], False),
    ("--api-key-file", "API_KEY_FILE", None, False),
    ("--api-key-protects-health", "API_KEY_PROTECTS_HEALTH", False, False),
    ("--tls-cert-path", "TLS_CERT_PATH", None, False),
    ("--tls-key-path", "TLS_KEY_PATH", None, False),
    ("--tls-client-ca-path", "TLS_CLIENT_CA_PATH", None, False),
    ("--num-shard", "NUM_SHARD", None, False),
    ("--sharded", "SHARDED", None, False),
    ("--quantize", "QUANTIZE", None, False),
    ("--dtype", "DTYPE", None, False),
    ("--device", "DEVICE", None, False),
    ("--model-impl", "MODEL_IMPL", "auto", False),
    ("--quantize-lm-head", "QUANTIZE_LM_HEAD", None, False),
    ("--max-input-tokens", "MAX_INPUT_TOKENS", None, False),
    ("--max-input-length", "MAX_INPUT_LENGTH", None, False),
    ("--max-total-tokens", "MAX_TOTAL_TOKENS", None, False),
    ("--max-stop-sequences", "MAX_STOP_SEQUENCES", 4, False),
    ("--max-stop-sequence-length", "MAX_STOP_SEQUENCE_LENGTH", 256, False),
    ("--max-top-n-tokens", "MAX_TOP_N_TOKENS", 5, False),
    ("--max-input-chars", "MAX_INPUT_CHARS", 1000000, False),
    ("--max-message-bytes", "MAX_MESSAGE_BYTES", 4194304, False),
    ("--payload-limit", "PAYLOAD_LIMIT", None, False),
    ("--max-concurrent-requests", "MAX_CONCURRENT_REQUESTS", 128, False),
    ("--max-batch-prefill-tokens", "MAX_BATCH_PREFILL_TOKENS", None, False),
    ("--max-batch-total-tokens", "MAX_BATCH_TOTAL_TOKENS", None, False),
    ("--max-batch-size", "MAX_BATCH_SIZE", None, False),
    ("--max-waiting-tokens", "MAX_WAITING_TOKENS", 20, False),
    ("--waiting-served-ratio", "WAITING_SERVED_RATIO", 1.2, False),
    ("--speculate", "SPECULATE", 0, False),
    ("--block-size", "BLOCK_SIZE", 16, False),
    ("--memory-fraction", "MEMORY_FRACTION", None, False),
    ("--cuda-memory-fraction", "CUDA_MEMORY_FRACTION", 1.0, False),
    ("--kv-cache-dtype", "KV_CACHE_DTYPE", "auto", False),
    ("--kv-cache-fp8-skip-layers", "KV_CACHE_FP8_SKIP_LAYERS", "auto", False),
    ("--prefix-caching/--no-prefix-caching", "PREFIX_CACHING", True, False),
    ("--use-prefix-caching/--no-use-prefix-caching", "USE_PREFIX_CACHING", None, True),
    ("--cuda-graphs", "CUDA_GRAPHS", None, False),
    ("--attention-backend", "ATTENTION_BACKEND", None, False),
    ("--disable-custom-kernels", "DISABLE_CUSTOM_KERNELS", False, False),
    ("--allow-dense-fallback", "ALLOW_DENSE_FALLBACK", False, False),
    ("--cpu-isa", "TGS_CPU_ISA", "native", False),
    ("--cpu-int8-activations", "TGS_CPU_INT8_ACTIVATIONS", "auto", False),
    ("--cpu-affinity", "TGS_CPU_AFFINITY", "auto", False),
    ("--disable-grammar-support", "DISABLE_GRAMMAR_SUPPORT", False, False),
    ("--lora-adapters", "LORA_ADAPTERS", [], False),
    ("--max-loras", "MAX_LORAS", None, False),
    ("--max-lora-rank", "MAX_LORA_RANK", 64, False),
    ("--drain-timeout-s", "DRAIN_TIMEOUT_S", 60.0, False),
    ("--graceful-termination-timeout", "GRACEFUL_TERMINATION_TIMEOUT", None, False),
    ("--rank-stall-timeout-s", "RANK_STALL_TIMEOUT_S", 300.0, False),
    ("--logger-level", ("LOGGER_LEVEL", "LOG_LEVEL"), "INFO", False),
    ("--json-output", "JSON_OUTPUT", False, False),
    ("--shard-only", "SHARD_ONLY", False, False),
    ("--shard-in-process", "SHARD_IN_PROCESS", False, False),
    ("--http-port", "HTTP_PORT", None, False),
    ("--cors-allow-origin", "CORS_ALLOW_ORIGIN", [], False),
    ("--max-client-batch-size", "MAX_CLIENT_BATCH_SIZE", 4, False),
    ("--tool-call-parser", "TOOL_CALL_PARSER", None, False),
    ("--lora-load-dir", "LORA_LOAD_DIR", None, False),
    ("--lora-load-without-api-key", "LORA_LOAD_WITHOUT_API_KEY", False, False),
    ("--version", None, False, False),
]


def test_the_flag_set_is_pinned():
    rows = []
    for param in SERVE.params:
        names = "/".join(param.opts + param.secondary_opts) if param.param_type_name == "option" else param.metavar
        envvar = param.envvar if param.envvar is None or isinstance(param.envvar, str) else tuple(param.envvar)
        rows.append((names, envvar, param.default, bool(getattr(param, "hidden", False))))
    assert rows[:len(FLAG_SET)] == FLAG_SET
    tgi_only = [(f.option, f.envvar if f.read_env else None, False if f.is_flag else None, True)
                for f in TGI_ONLY_FLAGS]
    assert rows[len(FLAG_SET):] == tgi_only


def test_the_declarations_are_servearg_defaults_and_flags():
    """Each ServeArgs field but `extra` declares its flag, and no flag given means the declared defaults."""
    assert [f.name for f in dataclasses.fields(ServeArgs) if flag_of(f) is None] == ["extra"]
    params = {p.name for p in SERVE.params}
    assert {f.metadata["flag"].param or f.name for f in dataclasses.fields(ServeArgs) if flag_of(f)} <= params


def test_no_flag_gives_the_declared_defaults(serve):
    assert ok(serve()) == ServeArgs()


@pytest.mark.parametrize("variable", sorted(ENV_CASES))
def test_each_setting_comes_from_its_environment_variable(serve, variable):
    value, field, expected = ENV_CASES[variable]
    args = ok(serve(**{variable: value}))
    assert getattr(args, field) == expected


def test_run_time_adapter_loading_from_the_environment(serve):
    """LORA_LOAD_WITHOUT_API_KEY needs LORA_LOAD_DIR (alone it is refused, naming both flags)."""
    args = ok(serve(LORA_LOAD_DIR="/tmp", LORA_LOAD_WITHOUT_API_KEY="true"))
    assert (args.lora_load_dir, args.lora_load_without_api_key) == ("/tmp", True)
    run = serve(LORA_LOAD_WITHOUT_API_KEY="true")
    assert run.code != 0 and "--lora-load-without-api-key" in run.output and "--lora-load-dir" in run.output


def test_serve_environment_variables_lists_tgis_and_ours():
    names = set(ALL_ENVVARS)
    assert {"MODEL_ID", "HOSTNAME", "PORT", "LOG_LEVEL", "LOGGER_LEVEL", "SPECULATE", "USE_PREFIX_CACHING"} <= names
    assert not {"MASTER_ADDR", "MASTER_PORT", "HUGGINGFACE_HUB_CACHE", "ENV"} & names


def test_every_serve_option_reads_a_variable_and_each_is_tested():
    read = set()
    for param in SERVE.params:
        if param.name in ("model_dir", "version", "help") or getattr(param, "hidden", False):
            continue
        names = envvars_of(param)
        assert names, f"{param.opts[0]} reads no environment variable"
        read.update(names)
    hidden_read = {n for p in SERVE.params if getattr(p, "hidden", False) for n in envvars_of(p)}
    tgi_only = {f.envvar for f in TGI_ONLY_FLAGS if f.read_env}
    # SHARD_ONLY: test_shard_only_from_the_environment; LORA_LOAD_WITHOUT_API_KEY:
    # test_run_time_adapter_loading_from_the_environment
    tested = set(ENV_CASES) | {"SHARD_ONLY", "LORA_LOAD_WITHOUT_API_KEY"} | SECURITY_FILE_VARIABLES
    assert read | (hidden_read - tgi_only) <= tested, sorted((read | hidden_read) - tested - tgi_only)


def test_shard_only_from_the_environment(serve, monkeypatch):
    seen = {}
    monkeypatch.setattr(rank, "run_shard", lambda args, rank, world, warnings=(): seen.update(
        args=args, rank=rank, world=world) or 0)
    monkeypatch.setattr(process_exit, "exit_process", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    run = serve("/models/m", SHARD_ONLY="yes", RANK="0", WORLD_SIZE="1")
    assert run.code == 0 and run.args is None, run.output  # a rank, not the launcher
    assert seen["args"].shard_only and seen["args"].model == "/models/m" and (seen["rank"], seen["world"]) == (0, 1)


def test_command_line_wins_over_the_environment(serve):
    args = ok(serve("--port", "4321", "--max-input-length", "50", "--no-prefix-caching",
                    PORT="1234", MAX_INPUT_TOKENS="60", PREFIX_CACHING="true"))
    assert (args.port, args.max_input_tokens, args.prefix_caching) == (4321, 50, False)
    # Positional MODEL_DIR beats MODEL_ID; --metrics-port beats PROMETHEUS_PORT.
    args = ok(serve("/models/a", "--metrics-port", "9001", MODEL_ID="/models/b", PROMETHEUS_PORT="9002"))
    assert (args.model, args.metrics_port) == ("/models/a", 9001)
    assert ok(serve("--model-id", "/models/c")).model == "/models/c"


@pytest.mark.parametrize(
    "argv, env, named",
    [
        (["--max-input-tokens", "10", "--max-input-length", "20"], {},
         "--max-input-tokens (10) and --max-input-length (20)"),
        (["/models/a", "--model-id", "/models/b"], {}, "MODEL_DIR (/models/a) and --model-id (/models/b)"),
        ([], {"METRICS_PORT": "1", "PROMETHEUS_PORT": "2"}, "environment variable METRICS_PORT (1) and "
         "environment variable PROMETHEUS_PORT (2)"),
    ],
)
def test_two_names_that_disagree_are_an_error(serve, argv, env, named):
    run = serve(*argv, **env)
    assert run.code == 2 and run.args is None
    assert named in run.output and "give one" in run.output
    # The same value under both names is fine.
    same = serve("--max-input-tokens", "10", "--max-input-length", "10")
    assert ok(same).max_input_tokens == 10


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("NO", False),
])
def test_boolean_variables(serve, text, expected):
    args = ok(serve(JSON_OUTPUT=text, ALLOW_DENSE_FALLBACK=text, DISABLE_CUSTOM_KERNELS=text, PREFIX_CACHING=text))
    assert (args.json_output, args.allow_dense_fallback, args.disable_custom_kernels, args.prefix_caching) == (
        expected, expected, expected, expected)


@pytest.mark.parametrize("variable", ["JSON_OUTPUT", "PREFIX_CACHING", "USE_PREFIX_CACHING", "SHARDED",
                                      "ALLOW_DENSE_FALLBACK", "SHARD_ONLY"])
def test_a_bad_boolean_names_its_variable(serve, variable):
    run = serve(**{variable: "maybe"})
    assert run.code == 2 and run.args is None
    assert variable in run.output


# -- HOSTNAME ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [("0.0.0.0", "0.0.0.0"), ("::", "::"), ("10.1.2.3", "10.1.2.3"),
                                             ("localhost", "localhost")])
def test_hostname_holding_an_address_is_used(serve, value, expected):
    run = serve(HOSTNAME=value)
    assert ok(run).hostname == expected and run.warnings == []


def test_hostname_holding_a_pod_name_is_ignored_with_a_warning(serve):
    run = serve(HOSTNAME="tgi-7d9f8c-x2kq")
    assert ok(run).hostname == "127.0.0.1"
    assert len(run.warnings) == 1 and "tgi-7d9f8c-x2kq" in run.warnings[0] and "--hostname" in run.warnings[0]
    assert ok(serve("--hostname", "0.0.0.0", HOSTNAME="tgi-7d9f8c-x2kq")).hostname == "0.0.0.0"
    assert ok(serve()).hostname == "127.0.0.1"


# -- TGI flags that do not apply -------------------------------------------------------------------
REFUSED = [f for f in TGI_ONLY_FLAGS if f.refuse]
IGNORED = [f for f in TGI_ONLY_FLAGS if not f.refuse]


@pytest.mark.parametrize("flag", REFUSED, ids=lambda f: f.option)
def test_refused_tgi_flags_exit_2_with_one_line_reason(serve, flag):
    argv = [flag.option] if flag.is_flag else [flag.option, "x"]
    run = serve(*argv)
    assert run.code == 2 and run.args is None
    assert run.output.strip() == f"error: {flag.option}: {flag.reason}"
    by_env = serve(**{flag.envvar: "1"})
    if flag.read_env:
        assert by_env.code == 2 and f"environment variable {flag.envvar}: {flag.reason}" in by_env.output
    else:  # set by other programs (torch.distributed, Hugging Face tools): not ours to refuse
        assert ok(by_env) and by_env.warnings == []


@pytest.mark.parametrize("flag", IGNORED, ids=lambda f: f.option)
def test_ignored_tgi_flags_start_with_a_warning(serve, flag):
    argv = [flag.option] if flag.is_flag else [flag.option, "2"]
    run = serve(*argv)
    ok(run)
    if flag.is_flag and "true" in flag.quiet:
        assert run.warnings == []
    else:
        assert len(run.warnings) == 1 and run.warnings[0].startswith(flag.option) and flag.reason in run.warnings[0]
    for quiet in flag.quiet:
        if not flag.is_flag:
            assert serve(flag.option, quiet).warnings == []
    env_value = "true" if flag.is_flag else "on" if flag.name == "usage_stats" else "2"
    by_env = serve(**{flag.envvar: env_value})
    ok(by_env)
    assert len(by_env.warnings) == (0 if flag.is_flag and "true" in flag.quiet else 1)


def test_help_hides_tgi_only_flags_but_each_has_its_reason():
    hidden = {p.name: p for p in SERVE.params if getattr(p, "hidden", False)}
    for flag in TGI_ONLY_FLAGS:
        assert flag.reason in hidden[flag.name].help


# -- log levels --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, level", [
    ("info", "INFO"), ("INFO", "INFO"), ("warn", "WARNING"), ("warning", "WARNING"), ("debug", "DEBUG"),
    ("trace", "TRACE"), ("error", "ERROR"), ("off", "CRITICAL"),
    ("text_generation_launcher=debug", "DEBUG"),
    ("text_generation_launcher=warn,text_generation_router=info,tokio=trace", "INFO"),
    ("error,text_generation_router=debug", "DEBUG"),
])
def test_log_levels_ours_and_tgis(text, level):
    assert parse_log_level(text) == level


@pytest.mark.parametrize("text", ["chatty", "tokio=debug", "", "text_generation_router=loud", "text_generation"])
def test_unusable_log_levels_are_refused_with_the_name(text):
    with pytest.raises(ValueError, match="LOG_LEVEL"):
        parse_log_level(text, "environment variable LOG_LEVEL")


def test_logger_level_beats_log_level(serve):
    assert ok(serve(LOGGER_LEVEL="error", LOG_LEVEL="debug")).logger_level == "ERROR"
    run = serve(LOG_LEVEL="tokio=debug")
    assert run.code == 2 and "environment variable LOG_LEVEL" in run.output


# -- --sharded -------------------------------------------------------------------------------------
def test_resolve_num_shard():
    def count(n: int):
        return lambda: n

    assert resolve_num_shard(None, None, None, count(8)) == 1  # unset: one rank, not every GPU
    assert resolve_num_shard(None, 3, None, count(0)) == 3
    assert resolve_num_shard(False, None, None, count(8)) == 1
    assert resolve_num_shard(True, None, None, count(4)) == 4
    assert resolve_num_shard(True, None, "cuda", count(2)) == 2
    assert resolve_num_shard(True, 2, "cpu", count(0)) == 2
    for sharded, num_shard, device, devices, message in [
        (True, None, None, 0, "--num-shard N"),
        (True, None, "cpu", 8, "--num-shard N"),
        (True, None, None, 1, "at least 2 CUDA devices, found 1"),
        (True, 1, None, 8, "--num-shard >= 2"),
        (False, 2, None, 8, "contradicts --num-shard 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_num_shard(sharded, num_shard, device, count(devices))


def test_sharded_from_the_command_line(serve):
    assert ok(serve("--sharded", "true", "--num-shard", "2")).num_shard == 2
    assert ok(serve("--sharded", "false")).num_shard == 1
    cpu = serve("--sharded", "true", "--device", "cpu")
    assert cpu.code == 2 and "--num-shard N" in cpu.output
    bad = serve("--sharded", "sometimes")
    assert bad.code == 2 and "--sharded: expected true or false" in bad.output


# -- the new settings ----------------------------------------------------------------------------------
def test_cuda_graphs_syntax():
    assert parse_cuda_graphs("1,2,4,8,16,32,64,128") == list(DEFAULT_CUDA_GRAPHS)
    assert parse_cuda_graphs("0") == []
    assert parse_cuda_graphs(" 8, 2,2 ") == [2, 8]
    for text in ("0,4", "-1", "a", "1,,2", ""):
        with pytest.raises(ValueError, match="--cuda-graphs"):
            parse_cuda_graphs(text)


def test_new_settings_defaults_and_flags(serve):
    args = ok(serve())
    assert (args.prefix_caching, args.cuda_graphs, args.attention_backend, args.allow_dense_fallback) == (
        True, None, None, False)
    assert (args.max_waiting_tokens, args.waiting_served_ratio, args.rank_stall_timeout_s) == (20, 1.2, 300.0)
    assert args.cuda_memory_fraction == 1.0 and args.effective_cuda_graphs == list(DEFAULT_CUDA_GRAPHS)
    args = ok(serve("--cuda-graphs", "0", "--attention-backend", "triton-paged", "--allow-dense-fallback",
                    "--max-waiting-tokens", "0", "--waiting-served-ratio", "0.3", "--rank-stall-timeout-s", "5"))
    assert (args.cuda_graphs, args.effective_cuda_graphs, args.attention_backend) == ([], [], "triton-paged")
    assert (args.allow_dense_fallback, args.max_waiting_tokens, args.waiting_served_ratio) == (True, 0, 0.3)
    assert args.rank_stall_timeout_s == 5.0


def test_disable_custom_kernels_picks_the_portable_attention(serve):
    assert ok(serve("--disable-custom-kernels")).attention_backend == "torch-sdpa"
    clash = serve("--disable-custom-kernels", "--attention-backend", "triton-paged")
    assert clash.code == 2 and "--disable-custom-kernels" in clash.output
    unknown = serve("--attention-backend", "flashinfer")
    assert unknown.code == 2 and "triton-paged, torch-sdpa" in unknown.output


@pytest.mark.parametrize("field, value, named", [
    ("max_waiting_tokens", -1, "--max-waiting-tokens"),
    ("waiting_served_ratio", -0.5, "--waiting-served-ratio"),
    ("waiting_served_ratio", math.nan, "--waiting-served-ratio"),
    ("rank_stall_timeout_s", 0.0, "--rank-stall-timeout-s"),
    ("rank_stall_timeout_s", math.inf, "--rank-stall-timeout-s"),
    ("cuda_memory_fraction", 0.0, "--cuda-memory-fraction"),
    ("cuda_memory_fraction", 1.5, "--cuda-memory-fraction"),
    ("cuda_graphs", [4, 2], "--cuda-graphs"),
    ("cuda_graphs", [2, 2], "--cuda-graphs"),
    ("cuda_graphs", [0], "--cuda-graphs"),
    ("attention_backend", "flash", "--attention-backend"),
    ("drain_timeout_s", -1.0, "--drain-timeout-s"),
])
def test_serve_args_validation_names_the_flag(field, value, named):
    with pytest.raises(ValueError, match=named):
        dataclasses.replace(ServeArgs(), **{field: value}).validate()


def test_serve_args_json_round_trip_keeps_the_new_fields():
    args = ServeArgs(model="m", prefix_caching=False, cuda_graphs=[1, 8], attention_backend=ATTENTION_BACKENDS[1],
                     disable_custom_kernels=True, allow_dense_fallback=True, cuda_memory_fraction=0.7,
                     rank_stall_timeout_s=12.0, max_waiting_tokens=3, waiting_served_ratio=0.5)
    again = ServeArgs.from_json(args.to_json())
    assert again == args
    again.validate()
    assert ServeArgs.from_json(ServeArgs().to_json()).cuda_graphs is None


# -- what the ranks get ----------------------------------------------------------------------------------
def test_rank_environment():
    assert rank.rank_environment(ServeArgs(), {}) == {}
    env = rank.rank_environment(ServeArgs(allow_dense_fallback=True, disable_custom_kernels=True),
                                {"TGS_DISABLE_KERNELS": "reference"})
    assert env == {"TGS_ALLOW_DENSE_FALLBACK": "1", "TGS_DISABLE_KERNELS": "reference," + ",".join(CUSTOM_KERNELS)}
    again = rank.rank_environment(ServeArgs(disable_custom_kernels=True),
                                  {"TGS_DISABLE_KERNELS": env["TGS_DISABLE_KERNELS"]})
    assert again["TGS_DISABLE_KERNELS"] == env["TGS_DISABLE_KERNELS"]  # no duplicates


def test_custom_kernels_are_registered_cuda_kernels():
    from text_generation_server.kernels.table import CUDA

    names = {kernel.name for kernel in CUDA}
    assert set(CUSTOM_KERNELS) <= names, names


def test_shard_only_rank_of_our_launcher_ignores_flag_resolution(serve, monkeypatch):
    """A rank started by our launcher takes the launcher's settings whole, even with a bad LOG_LEVEL
    or an ignored TGI variable in the inherited environment."""
    seen = {}
    monkeypatch.setattr(rank, "run_shard", lambda args, rank, world, warnings=(): seen.update(
        args=args, rank=rank, world=world, warnings=list(warnings)) or 0)
    monkeypatch.setattr(process_exit, "exit_process", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    sent = ServeArgs(model="from-launcher", num_shard=2, logger_level="DEBUG")
    monkeypatch.setenv(rank.SERVE_ARGS_ENV, sent.to_json())
    run = serve("--shard-only", RANK="1", WORLD_SIZE="2", LOG_LEVEL="tokio=debug", MAX_BEST_OF="4")
    assert run.code == 0, run.output
    assert seen == {"args": sent, "rank": 1, "world": 2, "warnings": []}


# -- JSON logs ----------------------------------------------------------------------------------------
@pytest.fixture
def restore_logging():
    hook = sys.excepthook
    yield
    logger.remove()
    logger.add(sys.stderr)
    logging.captureWarnings(False)
    logging.basicConfig(handlers=[logging.NullHandler()], force=True)
    sys.excepthook = hook


def test_json_logs_are_flat_objects_one_per_line(capsys, restore_logging):
    logging_setup.configure_logging("debug", True, "rank 3")
    logger.bind(request_id=42).info("request {} queued", 42)
    logger.debug("plain line")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    pywarnings.warn("careful", UserWarning)
    logging.getLogger("grpc._server").warning("from the logging module")
    logger.trace("below the level")
    lines = capsys.readouterr().err.splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 5, lines
    first = records[0]
    assert list(first)[:4] == ["timestamp", "level", "message", "target"]
    assert first["message"] == "request 42 queued" and first["level"] == "INFO"
    assert first["target"] == "test_serve_flags" and first["component"] == "rank 3" and first["request_id"] == 42
    assert first["timestamp"].endswith("Z") and "T" in first["timestamp"]
    from datetime import datetime

    datetime.strptime(first["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ")
    assert "request_id" not in records[1] and "record" not in records[1]
    assert records[2]["level"] == "ERROR" and "RuntimeError: boom" in records[2]["exception"]
    assert records[3]["level"] == "WARNING" and "careful" in records[3]["message"]
    assert records[3]["target"] == "py.warnings"
    assert records[4]["target"] == "grpc._server" and records[4]["message"] == "from the logging module"


def test_plain_logs_keep_their_format(capsys, restore_logging):
    logging_setup.configure_logging("INFO", False, "launcher")
    logger.bind(request_id=1).info("hello")
    err = capsys.readouterr().err
    assert " | INFO     | launcher | test_serve_flags:" in err and err.rstrip().endswith("- hello")
    assert not err.lstrip().startswith("{")


@pytest.mark.parametrize("given, expected", [
    ("auto", "auto"), ("fp8_e4m3fn", "fp8_e4m3fn"), ("fp8_e5m2", "fp8_e5m2"), ("FP8_E5M2", "fp8_e5m2"),
    ("fp8", "fp8_e4m3fn"), ("fp8_e4m3", "fp8_e4m3fn"),  # vLLM's spellings
])
def test_kv_cache_dtype_takes_tgis_names_and_vllms(serve, given, expected):
    assert ok(serve("--kv-cache-dtype", given)).kv_cache_dtype == expected
    assert ok(serve()).kv_cache_dtype == "auto"


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices(serve):
    run = serve("--kv-cache-dtype", "int8")
    assert run.code == 2 and run.args is None
    assert "--kv-cache-dtype" in run.output and "fp8_e4m3fn" in run.output and "'int8'" in run.output
    run = serve(KV_CACHE_DTYPE="fp4")
    assert run.code == 2 and "KV_CACHE_DTYPE" in run.output and "'fp4'" in run.output


def test_shard_in_process_runs_one_rank_and_a_router():
    ServeArgs(shard_in_process=True).validate()
    with pytest.raises(ValueError, match="--shard-in-process runs one rank; --num-shard is 2"):
        ServeArgs(shard_in_process=True, num_shard=2).validate()
    with pytest.raises(ValueError, match="--shard-in-process and --shard-only contradict"):
        ServeArgs(shard_in_process=True, shard_only=True).validate()


def test_ranks_start_with_passive_openmp_waits_unless_the_user_set_one():
    from text_generation_server.settings.serve_flags import openmp_environment

    assert openmp_environment({}) == {"OMP_WAIT_POLICY": "passive"}
    assert openmp_environment({"OMP_WAIT_POLICY": "active"}) == {}
    assert openmp_environment({"GOMP_SPINCOUNT": "1000"}) == {}
