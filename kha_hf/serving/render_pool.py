"""Prompt rendering in worker processes that `kha serve` can end: a time limit and a memory limit that really hold.

A checkpoint's chat template runs on every chat request. Jinja's sandbox stops attribute tricks, not work: one
native string repetition (`{{ m['content'] * 150000000 }}`) took the server past 4 GB in 6.6 s, and neither a
thread's time limit nor an exception raised into it can stop a call inside C code. So each render (the template,
the tokenizer, the processor's image work) runs in a worker process:

- its address space is capped (`RLIMIT_AS`: what it holds once its processor is loaded, plus `memory` bytes), so a
  render that asks for more fails inside the worker with MemoryError (a 400), and the server's memory is untouched;
- a render still running at its request's deadline (or whose client went) is ended with SIGKILL, and a fresh worker,
  forked from a fork server that has imported transformers already, takes its place;
- what comes back is read with `torch.load(weights_only=True)`: tensors, lists, numbers and strings only, never a
  pickle that could run code in the server, whatever the template did in the worker.

`size` workers serve at once (RENDER_WORKERS); more requests wait for one, within their own time limit.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing
import pickle
import re
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..common.errors import KHAError

RENDER_WORKERS = 2
_PRELOAD = ["torch", "transformers", "kha_hf.serving.render_pool"]
STARTUP_TIMEOUT = 120.0  # seconds a worker may take to load its processor


class RenderFailed(Exception):
    """The render raised (the template or processor refused the messages, or it needed more than its cap)."""


class RenderTimedOut(Exception):
    """No worker was free, or the render did not end, before the request's deadline."""


def _address_space() -> int:
    with open("/proc/self/status") as status:
        return int(re.search(r"VmSize:\s+(\d+) kB", status.read()).group(1)) * 1024


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _plain(value: Any) -> Any:
    """VALUE (a BatchEncoding / BatchFeature, nested lists, numpy arrays) as dicts, lists, tensors and numbers."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__array__") and not isinstance(value, (str, bytes)):
        return torch.as_tensor(value)
    return value


def _serve_renders(conn, processor_blob: bytes, memory: int) -> None:
    """A worker's loop: load the processor, cap the address space, then answer (kind, args, kwargs) jobs with
    (True, result) or (False, (message, is_memory)), until the pipe closes."""
    import resource

    processor = pickle.loads(processor_blob)
    tokenizer = getattr(processor, "tokenizer", processor)
    limit = _address_space() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send_bytes(b"ready")
    while True:
        try:
            kind, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            render = processor.apply_chat_template if kind == "chat" else tokenizer
            reply = _dumps((True, _plain(render(*args, **kwargs))))
        except MemoryError:
            reply = None
        except BaseException as err:  # the template's, the tokenizer's or the processor's own error
            reply = _dumps((False, (f"{type(err).__name__}: {err}"[:300], False)))
        if reply is None:  # outside the handler: its frame no longer holds what ran out of memory
            reply = _dumps((False, ("MemoryError", True)))
        conn.send_bytes(reply)


@dataclass
class _Worker:
    process: Any
    conn: Any

    def kill(self) -> None:
        # the pipe is not closed here: a thread may still be reading it (it gets EOF once the process is gone), and
        # closing its descriptor under that thread could hand the number to another file; it closes with the object
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)


@dataclass
class RenderPool:
    """SIZE render workers for one processor (pickled into each). `run` from the server's event loop."""

    processor: Any
    memory: int  # bytes a render may add to its worker's address space (`ServeLimits.render_memory`)
    size: int = RENDER_WORKERS
    _blob: bytes = b""
    _idle: asyncio.Queue | None = None
    _ready: list = field(default_factory=list)  # started by `start`, before the event loop's first render
    _workers: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False
    _tasks: set = field(default_factory=set)  # the replacements under way (the event loop keeps weak references)

    def _start_worker(self) -> _Worker:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        parent, child = context.Pipe()
        process = context.Process(
            target=_serve_renders, args=(child, self._blob, self.memory), name="kha-serve-render", daemon=True
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        try:  # its processor loaded and its cap set (the first worker also waits for the fork server to start)
            ready = parent.poll(STARTUP_TIMEOUT) and parent.recv_bytes() == b"ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            worker.kill()
            raise KHAError("a prompt render worker did not start (see the log above)")
        with self._lock:
            self._workers.append(worker)
            closed = self._closed
        if closed:  # the server stopped while this one started
            worker.kill()
        return worker

    def start(self) -> None:
        """Start the workers now (the server's start waits for them), so that no request waits for one."""
        try:
            self._blob = pickle.dumps(self.processor)
        except Exception as err:  # a processor of remote code may hold what pickle cannot take
            raise KHAError(f"the model's processor cannot be handed to a render worker: {str(err)[:200]}") from err
        self._ready = [self._start_worker() for _ in range(self.size)]

    def _spawn(self, loop: asyncio.AbstractEventLoop, worker: _Worker | None) -> None:
        task = loop.create_task(self._replace(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, worker: _Worker | None) -> None:
        """End WORKER (if any) and put a fresh one in the idle queue (started off the event loop)."""
        loop = asyncio.get_running_loop()
        if worker is not None:
            with self._lock:
                if worker in self._workers:
                    self._workers.remove(worker)
            await loop.run_in_executor(None, worker.kill)
        if not self._closed:
            fresh = await loop.run_in_executor(None, self._start_worker)
            if not self._closed:
                self._idle.put_nowait(fresh)

    async def run(self, kind: str, args: tuple, kwargs: dict, timeout: float) -> Any:
        """The processor's `apply_chat_template(*ARGS, **KWARGS)` (KIND "chat") or its tokenizer's call (KIND
        "tokenize") in a worker, within TIMEOUT seconds: RenderTimedOut past it (the worker ended), RenderFailed
        when the render raised. Cancelling the caller (a client that went) ends the worker too."""
        loop = asyncio.get_running_loop()
        if self._idle is None:
            self._blob = self._blob or pickle.dumps(self.processor)
            self._idle = asyncio.Queue()
            for worker in self._ready:
                self._idle.put_nowait(worker)
            for _ in range(self.size - len(self._ready)):
                self._spawn(loop, None)
        deadline = loop.time() + timeout
        job = pickle.dumps((kind, args, kwargs))
        while True:
            try:
                worker = await asyncio.wait_for(self._idle.get(), timeout=max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise RenderTimedOut() from None
            try:  # a worker that died while idle (the OOM killer, a kill) fails no request: the next one takes it
                if worker.process.is_alive():
                    worker.conn.send_bytes(job)
                    break
            except OSError:
                pass
            self._spawn(loop, worker)
        done = False
        try:
            reply = await asyncio.wait_for(
                loop.run_in_executor(None, worker.conn.recv_bytes), timeout=max(deadline - loop.time(), 0.0)
            )
            ok, value = torch.load(io.BytesIO(reply), weights_only=True)
            done = True
        except asyncio.TimeoutError:
            raise RenderTimedOut() from None
        except (EOFError, OSError):  # the worker died while rendering: a crash in native code, the OOM killer, a kill
            raise RenderFailed(self._death(worker)) from None
        finally:
            if done and (ok or not value[1]):
                self._idle.put_nowait(worker)
            else:  # timed out, cancelled, died, or ran out of memory (its heap may hold the wreck): a fresh one
                self._spawn(loop, worker)
        if not ok:
            message, memory = value
            raise RenderFailed(f"it needed more than --render-memory ({self.memory >> 20} MiB)" if memory else message)
        return value

    def _death(self, worker: _Worker) -> str:
        """Why WORKER ended while rendering, as a client reads it. Native code that cannot allocate under the worker's
        address-space cap aborts the process (SIGABRT: tokenizers' Rust allocator does) instead of raising
        MemoryError, so an abort is the render needing more than --render-memory too."""
        worker.process.join(1)
        if worker.process.exitcode == -signal.SIGABRT:
            return f"it needed more than --render-memory ({self.memory >> 20} MiB): native code ran out and aborted"
        if worker.process.exitcode == -signal.SIGKILL:
            return "its render process was killed before it answered (the system's OOM killer, or a kill)"
        return f"its render process ended before it answered (exit code {worker.process.exitcode})"

    def close(self) -> None:
        """End every worker (the server stops)."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.kill()
