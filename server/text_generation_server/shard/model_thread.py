"""The rank's model thread: runs the model calls one at a time, and serves our router's step socket itself.

Why the socket is read on this thread and not on the event loop: with one core per rank, a decode
step served through the event loop crossed threads four times (the call read on the loop, handed
to the model thread, its result handed back, the answer written), and the two threads took the GIL
and the core from each other at every op of the forward: the served forward of the embedded model
read 1.2 ms against 0.9 in-process, ~0.3 ms a token (BENCHMARKS.md, issue #31 session 10). Here a
step call arrives on the socket, runs, and its answer leaves on the same thread, with no hand-off
(vLLM V1's engine core reads its input socket on the thread that runs the model, for the same
reason). The gRPC calls (a TGI router's, Info, Health, Warmup, adapters) still arrive on the event
loop and reach this thread as submitted work, as on a one-worker ThreadPoolExecutor.

The step socket: length-prefixed StepCall frames in, StepAnswer frames out (utils/step_frames.py),
calls on one connection run in order; bytes that are not frames of ours drop that connection alone.
The socket sits beside the rank's gRPC socket (`<uds>-<rank>.steps`), owner-only like it, and the
rank names it in Info's trailing metadata (`tgs-steps-socket`), so only a router that read Info
uses it.
"""

from __future__ import annotations

import collections
import os
import selectors
import socket
import threading
import time
import weakref
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Callable

from loguru import logger

from text_generation_server.utils.step_frames import FrameError, FrameProtocol, frame

STEP_SOCKET_SUFFIX = ".steps"
_RECV_BYTES = 1 << 16  # (under glibc's mmap threshold: a larger read buffer costs an mmap per call)
SEND_TIMEOUT_S = 60.0  # a router that reads nothing for this long has hung: its connection is dropped


def open_step_listener(path: str) -> socket.socket:
    """A listening unix socket at `path`, owner-only from its bind on (a stale file is replaced)."""
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o077)
    try:
        listener.bind(path)
    except BaseException:
        listener.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    listener.listen(8)
    listener.setblocking(False)
    return listener


_DECODE_TAG = (3 << 3) | 2  # StepCall.decode: field 3, length-delimited
_SEQ_TAG = (1 << 3) | 0  # StepCall.seq: field 1, varint


def _is_decode(payload: bytes) -> bool:
    """Whether a serialized StepCall carries a Decode, read from its first field tags (protobuf
    writes fields in number order: seq, then the call) without parsing the message."""
    i = 0
    if payload[:1] == bytes((_SEQ_TAG,)):
        i = 1
        while i < len(payload) and payload[i] & 0x80:
            i += 1
        i += 1
    return i < len(payload) and payload[i] == _DECODE_TAG


class Deferred:
    """A call that first needs work off the model thread (a Prefill whose grammars compile, whose
    prompts tokenize): `future` does that work elsewhere, then `then(result)` runs the call on the
    model thread and returns what builds its answer. Its connection's later calls wait for it; the
    model thread runs other work (steps ahead, other connections) meanwhile."""

    def __init__(self, future: Future, then: Callable[[Any], Callable[[], bytes]]):
        self.future = future
        self.then = then


class _Connection:
    """One router connection on the model thread: its bytes cut into frames, its answers written."""

    def __init__(self, sock: socket.socket, on_lost: Callable[[_Connection, BaseException | None], None]):
        self.sock = sock
        self.sock.settimeout(SEND_TIMEOUT_S)  # recv runs only once select says readable
        self.calls: collections.deque[bytes] = collections.deque()
        self.deferred: Deferred | None = None  # a call of this connection waiting for its off-thread work
        self._on_lost = on_lost
        self.closed = False
        self.protocol = FrameProtocol(self.calls.append, lambda exc: on_lost(self, exc))
        self.protocol.connection_made(self)  # type: ignore[arg-type]: the few transport calls it makes

    # What FrameProtocol uses of a transport.
    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def write(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:  # (a timeout too: the router stopped reading)
            self.closed = True
            self.protocol.connection_lost(exc)

    def receive(self) -> None:
        try:
            data = self.sock.recv(_RECV_BYTES)
        except OSError as exc:
            self.closed = True
            self.protocol.connection_lost(exc)
            return
        if not data:
            self.closed = True
            self.protocol.connection_lost(None)
            return
        self.protocol.data_received(data)


class ModelThread(Executor):
    """A one-thread executor whose thread also serves step sockets between submitted calls.

    Submitted work runs first, in order; then the step calls buffered on the connections, one at a
    time; then the thread sleeps in select() until either arrives."""

    def __init__(self, name: str = "model"):
        self._work: collections.deque[tuple[Future | None, Callable, tuple, dict]] = collections.deque()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._sleeping = False
        self._stopping = False
        self._drop_queued = False
        self._connections: list[_Connection] = []
        self._listener: socket.socket | None = None
        self._handle: Callable[[bytes], Callable[[], bytes]] | None = None
        self._sender: ThreadPoolExecutor | None = None  # builds and writes answers (serve_steps' `inline`)
        self._resumable = 0  # deferred calls whose off-thread work is done, queued to run here
        self._resumable_lock = threading.Lock()  # (counted up on the worker's thread, down on this one)
        self.answer_ns: int | None = None  # what a Decode's answer costs this thread, call to answer sent (EMA)
        self.send_ns: int | None = None  # building and writing one answer, wherever it ran (EMA)
        self._device_ns: Callable[[], int] | None = None  # the last step's device time (serve_steps)
        self._queued_sends = 0  # answers handed to the sender and not yet written
        self._sends_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"{name}_0")
        self._thread.start()
        alive = weakref.ref(self)  # (the exit hook must not keep a shut-down thread's executor alive)

        def stop_at_exit() -> None:
            worker = alive()
            if worker is not None:
                worker._stop()

        try:  # stop with the interpreter, as concurrent.futures' own workers do
            threading._register_atexit(stop_at_exit)  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):
            pass

    # -- Executor ---------------------------------------------------------------------------
    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        if self._stopping:
            raise RuntimeError("cannot schedule new work after shutdown")
        future: Future = Future()
        self._work.append((future, fn, args, kwargs))
        if self._sleeping:  # (the loop re-checks the queue after saying it sleeps: no wake-up is lost)
            self._wake()
        return future

    def post(self, fn: Callable, /, *args: Any) -> None:
        """Queues `fn(*args)` as `submit` does, with no Future: for work nobody waits on (the step
        computed ahead, queued once a token), whose Future (a Condition and its lock, made, run and
        set) cost ~2 µs of the model thread each time on the 2-core EPYC. A failure, which a Future
        nobody read used to swallow, is logged; `fn` keeps its own outcome."""
        if self._stopping:
            raise RuntimeError("cannot schedule new work after shutdown")
        self._work.append((None, fn, args, {}))
        if self._sleeping:
            self._wake()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._drop_queued = cancel_futures
        self._stop()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the step socket ----------------------------------------------------------------------
    def serve_steps(self, listener: socket.socket, handle: Callable[[bytes], Callable[[], bytes] | Deferred],
                    inline: bool, device_ns: Callable[[], int] | None = None) -> None:
        """Accepts connections on `listener` and runs each frame's call with `handle(payload)` on this
        thread; what it returns builds the answer's bytes (or is a Deferred call). `handle` raises
        FrameError for a payload that is not a call: its connection drops.

        `inline`: this thread builds and writes each answer before it goes on (a CPU rank: every
        core it has runs its forward, so another thread would only take one from it); otherwise a
        sender thread does, while this one already runs the next step (a GPU rank: the device must
        not wait for a batch's answer to be converted). `device_ns` (with a sender): the last step's
        device time; while it is under twice what an answer costs to build and write, the step
        leaves this thread no wait to hide the answer in, and handing it over costs more than
        writing it (the two threads trade the GIL), so this thread writes it, unless answers
        handed over earlier are still unwritten (a connection's answers keep their order)."""
        self._handle = handle
        if not inline:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-answers")
            self._device_ns = device_ns
        self.submit(self._listen, listener)

    def steps_waiting(self, decodes_wait: bool = False) -> bool:
        """Whether a step call waits on a connection: a chain of steps ahead ends for it, as for a
        submitted call. `decodes_wait`: a waiting Decode does not count (a chain that has run for
        less than an answer costs goes on; the Decode then takes its steps), any other call does.
        Bytes that arrived are read and cut into calls first. Only meaningful on this thread."""
        if self._resumable:
            return True
        if not self._connections:
            return False
        for key, _ in self._selector.select(timeout=0):
            if isinstance(key.data, _Connection):
                key.data.receive()
        return any(c.deferred is None and any(not (decodes_wait and _is_decode(call)) for call in c.calls)
                   for c in self._connections)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    # -- the loop ------------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # full: a wake-up is pending anyway; closed: the loop is gone

    def _stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._wake()

    def _listen(self, listener: socket.socket) -> None:
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, listener)

    def _loop(self) -> None:
        try:
            while True:
                if self._work:
                    if self._drop_queued:
                        while self._work:
                            self._cancel(self._work.popleft()[0])
                        continue
                    self._run(*self._work.popleft())
                    continue
                if self._stopping:
                    return
                ready = next((c for c in self._connections if c.calls and c.deferred is None), None)
                if ready is not None:
                    try:
                        self._answer(ready)
                    except Exception as exc:  # noqa: BLE001: a fault of ours must not stop the model thread
                        logger.opt(exception=exc).error("step socket: a call failed outside its handler; "
                                                        "dropping its connection")
                        ready.protocol.fail(exc)
                    continue
                self._sleeping = True
                if self._work or self._stopping:
                    self._sleeping = False
                    continue
                events = self._selector.select()
                self._sleeping = False
                for key, _ in events:
                    self._on_event(key.data)
        finally:
            self._close_all()

    @staticmethod
    def _run(future: Future | None, fn: Callable, args: tuple, kwargs: dict) -> None:
        if future is None:  # (post)
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001: nobody waits on it; the thread goes on
                logger.opt(exception=exc).error("model thread: posted work {} failed", getattr(fn, "__qualname__", fn))
            return
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001: the submitter's to handle
            future.set_exception(exc)
        else:
            future.set_result(result)

    @staticmethod
    def _cancel(future: Future | None) -> None:
        if future is not None:
            future.cancel()

    def _on_event(self, source: Any) -> None:
        if source is None:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        elif isinstance(source, _Connection):
            source.receive()
        elif self._listener is not None:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                return
            connection = _Connection(sock, self._lost)
            self._connections.append(connection)
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _answer(self, connection: _Connection) -> None:
        payload = connection.calls.popleft()
        started = time.perf_counter_ns()
        try:
            build = self._handle(payload)
        except FrameError as exc:
            connection.protocol.fail(exc)
            return
        if isinstance(build, Deferred):
            connection.deferred = build
            self._resumable_later(connection, build)
            return
        self._send(connection, build)
        if _is_decode(payload):
            spent = time.perf_counter_ns() - started
            self.answer_ns = spent if self.answer_ns is None else (3 * self.answer_ns + spent) // 4

    def _resumable_later(self, connection: _Connection, deferred: Deferred) -> None:
        def done(_: Future) -> None:  # (on the thread that did the work)
            with self._resumable_lock:
                self._resumable += 1
            try:
                self.submit(self._resume, connection, deferred)
            except RuntimeError:
                pass  # shut down meanwhile: the connection closes with the thread

        deferred.future.add_done_callback(done)

    def _resume(self, connection: _Connection, deferred: Deferred) -> None:
        with self._resumable_lock:
            self._resumable -= 1
        connection.deferred = None
        if connection.closed:
            return
        self._send(connection, deferred.then(deferred.future))

    def _send(self, connection: _Connection, build: Callable[[], bytes]) -> None:
        if self._sender is not None and not self._send_here():
            with self._sends_lock:
                self._queued_sends += 1
            self._sender.submit(self._send_later, connection, build)
        elif not connection.closed:
            started = time.perf_counter_ns()
            connection.protocol.send(build())
            self._sent(time.perf_counter_ns() - started)

    def _send_here(self) -> bool:
        """With a sender: whether this thread writes the answer itself now (serve_steps' `device_ns`)."""
        if self._device_ns is None or self.send_ns is None or self._queued_sends:
            return False
        return self._device_ns() < 2 * self.send_ns

    def _sent(self, spent: int) -> None:
        self.send_ns = spent if self.send_ns is None else (3 * self.send_ns + spent) // 4

    def _send_later(self, connection: _Connection, build: Callable[[], bytes]) -> None:
        """On the sender thread: the answer built and written. A failed write shuts the socket, and
        the model thread, reading its end, drops the connection (its selector is its own)."""
        try:
            if connection.closed:
                return
            started = time.perf_counter_ns()
            try:
                connection.sock.sendall(frame(build()))
            except OSError:
                connection.closed = True
                try:
                    connection.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._sent(time.perf_counter_ns() - started)
        finally:
            with self._sends_lock:
                self._queued_sends -= 1

    def _lost(self, connection: _Connection, exc: BaseException | None) -> None:
        if isinstance(exc, FrameError):
            logger.error("step socket: dropped a connection: {}", exc)
        connection.closed = True
        connection.calls.clear()
        if connection in self._connections:
            self._connections.remove(connection)
            try:
                self._selector.unregister(connection.sock)
            except (KeyError, ValueError):
                pass
        connection.sock.close()

    def _close_all(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)  # answers already built go out before the sockets close
        for connection in list(self._connections):
            self._lost(connection, None)
        if self._listener is not None:
            self._listener.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        while self._work:
            self._cancel(self._work.popleft()[0])
