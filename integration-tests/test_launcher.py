"""`serve` as a real process: rank supervision, signals, and no orphaned ranks.

Each test starts `text-generation-server serve` on a random tiny Llama (see
conftest.py) and breaks it the way production breaks it: a rank killed by the OOM
killer, SIGTERM from an orchestrator during a request, a bad model folder, the
launcher itself SIGKILLed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime

import grpc
import pytest
from conftest import SMALL_LIMITS, ServeProcess, clean_env, free_port, pid_alive, serve_command, wait_until

from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.generate.v3 import generate_pb2_grpc as spb_grpc
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox", "class Stack:"]


def test_shard_only_answers_the_shard_protocol(tiny_model, start_serve):
    """`--shard-only` without RANK/WORLD_SIZE is rank 0 of 1, as a TGI router would run it."""
    server = start_serve(tiny_model, "--shard-only", "--block-size", "8")
    server.wait_sockets()
    path = server.socket_path(0)
    with grpc.insecure_channel(f"unix://{path}") as channel:
        stub = spb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(spb.InfoRequest(), timeout=10)
        assert (info.dtype, info.device_type, info.block_size) == ("float32", "cpu", 8)
        stub.Health(spb.HealthRequest(), timeout=10)
        urls = stub.ServiceDiscovery(spb.ServiceDiscoveryRequest(), timeout=10).urls
        assert list(urls) == [f"unix://{path}"]
    # A second server on the same --uds-path must not steal the live socket.
    clash = start_serve(tiny_model, uds_path=server.uds_path)
    assert clash.wait_exit(30) == 2
    assert f"already listening on {path}" in clash.log()
    assert server.proc.poll() is None and os.path.exists(path)
    # Standalone (no launcher), Ctrl-C stops the shard cleanly and removes its socket.
    server.proc.send_signal(signal.SIGINT)
    assert server.wait_exit(15) == 0
    assert not os.path.exists(path)
    log = server.log()
    assert "rank 0" in log and "world size 1" in log


def test_shard_only_rejects_a_malformed_rank(tiny_model, start_serve):
    """A bad RANK from an external launcher is an error naming the variable, never a silent rank 0."""
    bad = start_serve(tiny_model, "--shard-only", env=clean_env(RANK="x"))
    assert bad.wait_exit(30) == 2
    assert "RANK" in bad.log()


def test_killed_rank_stops_serve_with_its_rank_named(tiny_model, start_serve):
    server = start_serve(tiny_model, num_shard=2)
    server.wait_serving()
    shards = server.shard_pids()
    assert sorted(shards) == [0, 1], f"expected two ranks, found {shards}"

    os.kill(shards[1], signal.SIGKILL)
    started = time.monotonic()
    code = server.wait_exit(15)
    elapsed = time.monotonic() - started

    assert code != 0
    assert elapsed < 10, f"serve took {elapsed:.1f} s to notice the dead rank"
    assert "shard rank 1 exited with code -9" in server.log()
    assert not any(pid_alive(pid) for pid in shards.values()), "a rank outlived serve"
    assert not any(os.path.exists(server.socket_path(r)) for r in range(2))


def _long_greedy_prompt(stub) -> tuple[str, cpb.GenerateResponse]:
    """A prompt whose greedy completion is long: a random model may emit EOS early on some prompts."""
    params = cpb.GenerateParameters(max_new_tokens=200, details=True)
    for prompt in PROMPTS:
        answer = stub.Generate(cpb.GenerateRequest(inputs=prompt, parameters=params), timeout=60)
        if answer.details.generated_tokens >= 50:
            return prompt, answer
    pytest.fail("no prompt gives a greedy completion of 50 tokens or more")


def test_sigterm_lets_a_running_generate_finish(tiny_model, start_serve):
    server = start_serve(tiny_model, num_shard=2)
    server.wait_serving()
    stub = cpb_grpc.TextGenerationStub(server.channel())
    prompt, reference = _long_greedy_prompt(stub)

    params = cpb.GenerateParameters(max_new_tokens=200, details=True)
    stream = stub.GenerateStream(cpb.GenerateRequest(inputs=prompt, parameters=params), timeout=60)
    messages = [next(stream)]  # generation is running
    server.proc.send_signal(signal.SIGTERM)
    messages += list(stream)

    assert messages[-1].HasField("generated_text")
    assert messages[-1].generated_text == reference.generated_text
    assert len(messages) == reference.details.generated_tokens
    assert server.wait_exit(30) == 0
    assert "received SIGTERM" in server.log()


def test_sigterm_to_the_process_group_drains_too(tiny_model, start_serve):
    """A stop sent to every process of the group (systemd's default KillMode=control-group, `kill -TERM
    -<pgid>`): the ranks leave the stop to the launcher, which drains the running request first and
    exits 0, as with a SIGTERM to the launcher alone."""
    server = start_serve(tiny_model, num_shard=2)
    server.wait_serving()
    shards = server.shard_pids()
    stub = cpb_grpc.TextGenerationStub(server.channel())
    prompt, reference = _long_greedy_prompt(stub)

    params = cpb.GenerateParameters(max_new_tokens=200, details=True)
    stream = stub.GenerateStream(cpb.GenerateRequest(inputs=prompt, parameters=params), timeout=60)
    messages = [next(stream)]  # generation is running
    os.killpg(server.pid, signal.SIGTERM)
    messages += list(stream)

    assert messages[-1].HasField("generated_text")
    assert messages[-1].generated_text == reference.generated_text
    assert server.wait_exit(30) == 0, server.log()[-3000:]
    log = server.log()
    assert log.count("not from the launcher") == 2, log[-3000:]  # each rank's
    assert "exited with code" not in log
    assert not any(pid_alive(pid) for pid in shards.values())


def test_second_sigint_forces_a_quick_exit(tiny_model, start_serve):
    server = start_serve(tiny_model, "--drain-timeout-s", "60")
    server.wait_serving()
    shards = server.shard_pids()
    stub = cpb_grpc.TextGenerationStub(server.channel())
    prompt, _ = _long_greedy_prompt(stub)
    params = cpb.GenerateParameters(max_new_tokens=200)
    stream = stub.GenerateStream(cpb.GenerateRequest(inputs=prompt, parameters=params), timeout=60)
    next(stream)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)  # two signals sent at once may merge into one
    server.proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    code = server.wait_exit(10)
    assert time.monotonic() - started < 5
    assert code == 130, server.log()[-2000:]
    assert not any(pid_alive(pid) for pid in shards.values())


def test_missing_model_folder_is_named(tmp_path, start_serve):
    folder = tmp_path / "no-such-model"
    server = start_serve(folder)
    assert server.wait_exit(30) != 0
    assert str(folder) in server.log()


def test_broken_model_folder_fails_in_the_rank_and_serve_exits(tmp_path, start_serve):
    """The rank reports what is wrong (one JSON log line, tagged with its rank); serve exits non-zero."""
    folder = tmp_path / "broken-model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    server = start_serve(folder, "--json-output")
    assert server.wait_exit(60) != 0
    records = [json.loads(line) for line in server.log().splitlines()]
    errors = {(r["component"], r["message"]) for r in records if r["level"] == "ERROR"}
    assert ("rank 0", f"cannot start: {folder / 'config.json'} is missing") in errors
    assert ("launcher", "shard rank 0 exited with code 2 during startup") in errors


def test_sigkill_of_the_launcher_leaves_no_rank(tiny_model, start_serve):
    server = start_serve(tiny_model, num_shard=2)
    server.wait_serving()
    shards = server.shard_pids()
    assert sorted(shards) == [0, 1]

    server.proc.kill()
    server.proc.wait(timeout=5)
    gone = wait_until(lambda: not any(pid_alive(pid) for pid in shards.values()), timeout_s=10)
    assert gone, f"ranks {[r for r, p in shards.items() if pid_alive(p)]} outlived the launcher"


def test_sighup_to_the_process_group_reloads_and_keeps_serving(tiny_model, start_serve):
    """`kill -HUP -<pgid>` (a service manager's reload) reaches the launcher and every rank: the
    launcher re-reads its files, the ranks ignore it, also while they are still starting."""
    server = start_serve(tiny_model, num_shard=2)
    assert wait_until(lambda: "starting 2 rank(s)" in server.log(), 60), server.log()[-2000:]
    os.killpg(server.pid, signal.SIGHUP)  # the ranks are importing, before their own handlers exist
    server.wait_serving()
    shards = server.shard_pids()
    assert sorted(shards) == [0, 1], server.log()[-2000:]
    stub = cpb_grpc.TextGenerationStub(server.channel())
    params = cpb.GenerateParameters(max_new_tokens=12, details=True)
    before = stub.Generate(cpb.GenerateRequest(inputs=PROMPTS[0], parameters=params), timeout=60)

    time.sleep(0.05)  # two signals sent at once may merge into one
    os.killpg(server.pid, signal.SIGHUP)
    assert wait_until(lambda: server.log().count("received SIGHUP") == 2, 10), server.log()[-2000:]
    after = stub.Generate(cpb.GenerateRequest(inputs=PROMPTS[0], parameters=params), timeout=60)
    assert [t.id for t in after.details.tokens] == [t.id for t in before.details.tokens]
    assert server.proc.poll() is None
    assert server.shard_pids() == shards and all(pid_alive(pid) for pid in shards.values())
    server.proc.send_signal(signal.SIGTERM)  # and the ranks still stop when told to
    assert server.wait_exit(30) == 0


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--port", "not-a-port"], "--port"),
        (["--max-input-tokens", "300", "--max-total-tokens", "256"], "--max-input-tokens"),
        (["--logger-level", "chatty"], "--logger-level"),
        (["--dtype", "float64"], "--dtype"),
        (["--speculate", "9"], "--speculate must be an integer from 0 to 8"),
        (["--revision", "main"], "--revision: models are local folders"),
        (["--sharded", "maybe"], "--sharded"),
        (["--cuda-graphs", "0,8"], "--cuda-graphs"),
        (["--cpu-affinity", "numa"], "--cpu-affinity"),
        (["--max-input-tokens", "10", "--max-input-length", "20"], "--max-input-length"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(tiny_model, start_serve, flags, named):
    server = start_serve(tiny_model, *flags, limits=False)
    assert server.wait_exit(30) == 2
    assert named in server.log()


def test_json_output_is_one_flat_object_per_line(tiny_model, start_serve):
    """JSON_OUTPUT from the environment, as a TGI deployment sets it: every line the launcher and
    its ranks write is a JSON object with TGI's top-level fields; request lines carry request_id."""
    server = start_serve(tiny_model, num_shard=2, env=clean_env(JSON_OUTPUT="true", LOG_LEVEL="info"))
    server.wait_serving()
    stub = cpb_grpc.TextGenerationStub(server.channel())
    params = cpb.GenerateParameters(max_new_tokens=4)
    stub.Generate(cpb.GenerateRequest(inputs="def f(x):", parameters=params), timeout=60)
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit(30) == 0
    lines = server.log().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line: {line!r}")
    for record in records:
        assert {"timestamp", "level", "message", "target", "component"} <= set(record), record
        assert "record" not in record and "text" not in record  # no loguru serialize blob
        datetime.strptime(record["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ")
        assert record["target"].startswith("text_generation_server"), record
    assert {r["component"] for r in records} == {"launcher", "rank 0", "rank 1"}
    requests = [r for r in records if "request_id" in r]
    assert requests and all(isinstance(r["request_id"], int) for r in requests)
    assert any(r["target"] == "text_generation_server.router.service" for r in requests)


def test_configured_by_tgi_environment_variables_alone(tiny_model, tmp_path):
    """A TGI-style deployment: no flags, every setting from the environment under TGI's names."""
    port, metrics_port = free_port(), free_port()
    uds_path = str(tmp_path / "tgi")
    limits = dict(zip(SMALL_LIMITS[::2], SMALL_LIMITS[1::2]))
    env = clean_env(
        MODEL_ID=str(tiny_model), PORT=str(port), PROMETHEUS_PORT=str(metrics_port), SHARD_UDS_PATH=uds_path,
        HOSTNAME="127.0.0.1", SHARDED="false", MAX_INPUT_LENGTH="200",
        MAX_TOTAL_TOKENS=limits["--max-total-tokens"], MAX_BATCH_TOTAL_TOKENS=limits["--max-batch-total-tokens"],
        MAX_BATCH_PREFILL_TOKENS=limits["--max-batch-prefill-tokens"], MEMORY_FRACTION=limits["--memory-fraction"],
        MAX_BEST_OF="2", USAGE_STATS="off", LOG_LEVEL="text_generation_launcher=debug",
    )
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    server = ServeProcess(proc, port, metrics_port, uds_path, log_path, 1)
    try:
        server.wait_serving()
        stub = cpb_grpc.TextGenerationStub(server.channel())
        info = stub.Info(cpb.InfoRequest(), timeout=10)
        assert info.max_input_tokens == 200 and info.max_total_tokens == 256
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            assert response.status == 200
        assert os.path.exists(f"{uds_path}-0")
        log = server.log()
        assert "environment variable MAX_BEST_OF=2: ignored" in log and "USAGE_STATS" not in log
        assert "DEBUG" in log  # LOG_LEVEL's text_generation_launcher=debug
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(30) == 0
    finally:
        server.cleanup()


def _masks(pid: int) -> set[tuple[int, ...]]:
    """Every thread's CPU mask in a process."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except (ProcessLookupError, FileNotFoundError):
            continue
    return out


def test_cpu_rank_and_router_run_on_the_cores_the_affinity_rule_gives(tiny_model, start_serve):
    """--cpu-affinity auto (the default): the rank's threads on their own cores, the router on what
    they leave; what the log says is what /proc shows. The machine's core count decides which
    (launcher/cpu_affinity.py): the expectation is computed from this process's own mask."""
    import re

    from text_generation_server.launcher.cpu_affinity import rank_cpus, router_cpus

    env = clean_env()
    del env["OMP_NUM_THREADS"]  # the tests' default; a user who sets it chooses the threads and nothing is pinned
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # a user's own OpenMP waits are kept
        env.pop(name, None)
    server = start_serve(tiny_model, env=env)
    server.wait_serving()
    stub = cpb_grpc.TextGenerationStub(server.channel())
    reply = stub.Generate(cpb.GenerateRequest(inputs=PROMPTS[0], parameters=cpb.GenerateParameters(
        max_new_tokens=4)), timeout=60)
    assert reply.generated_text
    threads = int(re.search(r"(\d+) torch thread\(s\) per rank", server.log()).group(1))
    available = sorted(os.sched_getaffinity(0))
    expected_rank = rank_cpus(available, 0, 1, threads)
    rank_pid = server.shard_pids()[0]
    assert _masks(rank_pid) == {tuple(expected_rank or available)}
    expected_router = router_cpus(available, [expected_rank or available])
    assert _masks(server.pid) == {tuple(expected_router or available)}
    if expected_rank is not None:
        assert "pinned to core(s)" in server.log()
    # torch's idle OpenMP threads sleep in a rank (settings/serve_flags.openmp_environment)
    with open(f"/proc/{rank_pid}/environ", "rb") as f:
        assert b"OMP_WAIT_POLICY=passive" in f.read().split(b"\0")
