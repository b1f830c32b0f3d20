"""The rank's model thread (shard/model_thread.py): submitted work and step-socket calls on one thread.

Real unix sockets and a stand-in handler (the shard service's own is tested in test_step_stream.py):
answers come back in order on every connection, built inline or by the sender thread; a call waiting
on a socket is visible to a chain (`steps_waiting`) from the model thread; bytes that are not frames
drop their connection alone; shutdown cancels queued work when asked and closes the sockets.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from text_generation_server.shard.model_thread import ModelThread, open_step_listener
from text_generation_server.utils.step_frames import FrameError, frame


def read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    (size,) = struct.unpack("<I", exactly(4))
    return exactly(size)


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


@pytest.mark.parametrize("inline", [True, False])
def test_calls_are_answered_in_order_on_the_model_thread(tmp_path, inline):
    seen_threads = set()

    def handle(payload: bytes):
        if payload == b"junk":
            raise FrameError("not a call")
        seen_threads.add(threading.current_thread().name)
        return lambda: payload.upper()

    worker = ModelThread("test-model")
    try:
        path = str(tmp_path / "s.steps")
        worker.serve_steps(open_step_listener(path), handle, inline=inline)
        assert oct((tmp_path / "s.steps").stat().st_mode & 0o777) == "0o600"
        a, b = connect(path), connect(path)
        a.sendall(b"".join(frame(f"call {i}".encode()) for i in range(20)))  # many frames in one write
        b.sendall(frame(b"x" * 100_000))  # one frame over many reads
        assert [read_frame(a) for _ in range(20)] == [f"CALL {i}".encode() for i in range(20)]
        assert read_frame(b) == b"X" * 100_000
        assert seen_threads == {"test-model_0"}
        # Submitted work runs on the same thread, in order, between the calls.
        assert worker.submit(lambda: threading.current_thread().name).result(5) == "test-model_0"
        # A payload the handler refuses drops that connection alone.
        b.sendall(frame(b"junk"))
        assert b.recv(10) == b""
        a.sendall(frame(b"still here"))
        assert read_frame(a) == b"STILL HERE"
    finally:
        worker.shutdown(wait=True)


def test_answers_keep_their_order_when_the_writer_changes(tmp_path):
    """With a sender thread and the device's time (serve_steps' `device_ns`): a short device step
    has the model thread write the answer, a long one hands it over; answers handed over and not yet
    written keep the model thread from writing one past them."""
    writers = []
    device = iter([0, 10**9, 10**9, 0, 0, 10**9, 0] * 10)

    def handle(payload: bytes):
        def build() -> bytes:
            writers.append(threading.current_thread().name)
            time.sleep(0.001)  # a slow build: the sender's queue is still full when the next call comes
            return payload.upper()
        return build

    worker = ModelThread("test-model")
    try:
        path = str(tmp_path / "s.steps")
        worker.serve_steps(open_step_listener(path), handle, inline=False, device_ns=lambda: next(device))
        a = connect(path)
        for i in range(30):  # one at a time, then a burst
            a.sendall(frame(f"call {i}".encode()))
            assert read_frame(a) == f"CALL {i}".encode()
        a.sendall(b"".join(frame(f"more {i}".encode()) for i in range(30)))
        assert [read_frame(a) for _ in range(30)] == [f"MORE {i}".encode() for i in range(30)]
        assert {"test-model_0"} < set(writers) and worker.send_ns > 0
    finally:
        worker.shutdown(wait=True)


def test_a_chain_sees_a_call_waiting_on_the_socket(tmp_path):
    worker = ModelThread("test-model")
    try:
        path = str(tmp_path / "s.steps")
        worker.serve_steps(open_step_listener(path), lambda p: (lambda: p), inline=True)
        sock = connect(path)
        sock.sendall(frame(b"first"))
        assert read_frame(sock) == b"first"  # (the connection is registered by now)
        arrived = threading.Event()

        def chain() -> list[bool]:
            seen = [worker.steps_waiting()]
            arrived.wait(5)
            deadline = time.monotonic() + 5
            while not worker.steps_waiting() and time.monotonic() < deadline:
                time.sleep(0.001)
            return seen + [worker.steps_waiting()]

        job = worker.submit(chain)
        time.sleep(0.05)
        sock.sendall(frame(b"second"))
        arrived.set()
        assert job.result(10) == [False, True]
        assert read_frame(sock) == b"second"  # answered once the chain gave the thread back
    finally:
        worker.shutdown(wait=True)


def test_shutdown_cancels_queued_work_and_closes_the_sockets(tmp_path):
    worker = ModelThread("test-model")
    path = str(tmp_path / "s.steps")
    worker.serve_steps(open_step_listener(path), lambda p: (lambda: p), inline=True)
    sock = connect(path)
    sock.sendall(frame(b"hello"))
    assert read_frame(sock) == b"hello"
    gate, started = threading.Event(), threading.Event()
    running = worker.submit(lambda: started.set() or gate.wait(5))
    assert started.wait(5)
    queued = worker.submit(lambda: "ran")
    worker.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert running.result(5) is True
    worker.thread.join(5)
    assert not worker.thread.is_alive() and queued.cancelled()
    assert sock.recv(10) == b""  # the connection closed with the thread
    with pytest.raises(RuntimeError, match="shutdown"):
        worker.submit(lambda: None)


def test_a_deferred_call_holds_its_connection_alone(tmp_path):
    """A call whose work runs elsewhere first (a Prefill's grammar compile): its connection's next
    calls wait for it, answered in order; another connection and submitted work go on meanwhile."""
    from concurrent.futures import Future

    from text_generation_server.shard.model_thread import Deferred

    pending: Future = Future()
    chains_seen = []

    def handle(payload: bytes):
        if payload == b"slow":
            return Deferred(pending, lambda done: (lambda: b"slow:" + done.result()))
        return lambda: payload

    worker = ModelThread("test-model")
    try:
        path = str(tmp_path / "s.steps")
        worker.serve_steps(open_step_listener(path), handle, inline=True)
        a, b = connect(path), connect(path)
        a.sendall(frame(b"slow") + frame(b"after"))
        time.sleep(0.1)
        b.sendall(frame(b"other"))
        assert read_frame(b) == b"other"  # not held up by a's deferred call
        chains_seen.append(worker.submit(worker.steps_waiting).result(5))  # a's waiting call does not end chains
        pending.set_result(b"done")
        assert read_frame(a) == b"slow:done" and read_frame(a) == b"after"
        assert chains_seen == [False]
    finally:
        worker.shutdown(wait=True)


@pytest.mark.parametrize("seq", [0, 1, 300, 2**40])
def test_a_decode_is_told_from_its_first_bytes(seq):
    from text_generation_server.pb.generate.v3 import generate_pb2 as pb
    from text_generation_server.shard.model_thread import _is_decode

    calls = {
        "decode": pb.StepCall(seq=seq, decode=pb.DecodeRequest(batches=[pb.CachedBatch(id=1, request_ids=[1])])),
        "empty decode": pb.StepCall(seq=seq, decode=pb.DecodeRequest()),
        "prefill": pb.StepCall(seq=seq, prefill=pb.PrefillRequest(batch=pb.Batch(id=2))),
        "filter": pb.StepCall(seq=seq, filter_batch=pb.FilterBatchRequest(batch_id=1)),
        "clear": pb.StepCall(seq=seq, clear_cache=pb.ClearCacheRequest()),
        "nothing": pb.StepCall(seq=seq),
    }
    told = {name: _is_decode(call.SerializeToString()) for name, call in calls.items()}
    assert told == {"decode": True, "empty decode": True, "prefill": False, "filter": False, "clear": False,
                    "nothing": False}


def test_a_chain_may_hold_a_waiting_decode_but_no_other_call(tmp_path):
    from text_generation_server.pb.generate.v3 import generate_pb2 as pb

    worker = ModelThread("test-model")
    try:
        path = str(tmp_path / "s.steps")
        worker.serve_steps(open_step_listener(path), lambda p: (lambda: b"ok"), inline=True)
        sock = connect(path)
        sock.sendall(frame(b"hello"))
        assert read_frame(sock) == b"ok"
        decode = frame(pb.StepCall(seq=5, decode=pb.DecodeRequest()).SerializeToString())
        prefill = frame(pb.StepCall(seq=6, prefill=pb.PrefillRequest()).SerializeToString())
        started, go = threading.Event(), threading.Event()

        def chain() -> list[tuple[bool, bool]]:
            seen = []
            for _ in range(2):
                started.set()
                go.wait(5)
                go.clear()
                time.sleep(0.05)
                seen.append((worker.steps_waiting(decodes_wait=True), worker.steps_waiting()))
            return seen

        job = worker.submit(chain)
        assert started.wait(5)
        started.clear()
        sock.sendall(decode)
        go.set()
        assert started.wait(5)
        sock.sendall(prefill)
        go.set()
        assert job.result(10) == [(False, True), (True, True)]
        assert read_frame(sock) == b"ok" and read_frame(sock) == b"ok"
        assert worker.answer_ns is not None and worker.answer_ns > 0  # the decode's answer was timed
    finally:
        worker.shutdown(wait=True)


def test_a_fault_outside_the_handler_drops_the_connection_not_the_thread(tmp_path):
    def handle(payload: bytes):
        if payload == b"bad":
            return lambda: (_ for _ in ()).throw(RuntimeError("a bug while building the answer"))
        return lambda: payload

    worker = ModelThread("test-model")
    try:
        path = str(tmp_path / "s.steps")
        worker.serve_steps(open_step_listener(path), handle, inline=True)
        a = connect(path)
        a.sendall(frame(b"bad"))
        assert a.recv(10) == b""  # dropped
        b = connect(path)
        b.sendall(frame(b"fine"))
        assert read_frame(b) == b"fine"  # the thread serves on
        assert worker.submit(lambda: 42).result(5) == 42
    finally:
        worker.shutdown(wait=True)


def test_a_step_socket_path_over_the_limit_is_an_oserror(tmp_path):
    """serve_shard logs it and serves the Steps stream instead (a unix socket path holds ~107 bytes)."""
    with pytest.raises(OSError):
        open_step_listener(str(tmp_path / ("x" * 120)) + ".steps")


def test_an_answer_larger_than_the_socket_buffer_arrives_whole(tmp_path):
    """The model thread's first write() takes what the socket buffer holds; the rest follows (in
    order, whole) once the router reads: a big answer must not be cut or reordered."""
    big = bytes(range(256)) * 8192  # 2 MiB: far over a unix socket's buffer
    thread = ModelThread("test")
    path = str(tmp_path / "s.steps")
    thread.serve_steps(open_step_listener(path), lambda payload: (lambda: big if payload == b"big" else payload),
                       inline=True)
    try:
        sock = connect(path)
        sock.sendall(frame(b"big") + frame(b"small"))
        time.sleep(0.2)  # let the model thread fill the buffer and wait on it before anything is read
        assert read_frame(sock) == big
        assert read_frame(sock) == b"small"
        sock.close()
    finally:
        thread.shutdown()


def test_posted_work_runs_in_order_and_a_failure_does_not_stop_the_thread():
    thread = ModelThread("test")
    ran: list[str] = []
    gate = threading.Event()
    try:
        thread.submit(gate.wait, 10)  # holds the thread while the rest queues behind it
        thread.post(ran.append, "first")
        thread.post(lambda: 1 / 0)
        done = thread.submit(ran.append, "second")
        gate.set()
        done.result(timeout=10)
        assert ran == ["first", "second"]
    finally:
        thread.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        thread.post(ran.append, "late")


def test_shutdown_drops_posted_work_with_the_queued_futures():
    thread = ModelThread("test")
    gate = threading.Event()
    ran: list[str] = []
    thread.submit(gate.wait, 10)
    thread.post(ran.append, "posted")
    queued = thread.submit(ran.append, "submitted")
    thread.shutdown(wait=False, cancel_futures=True)
    gate.set()
    thread.thread.join(timeout=10)
    assert queued.cancelled() and ran == []
