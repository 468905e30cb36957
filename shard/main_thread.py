"""The shard's torch work runs on the process's main thread, handed over by the gRPC handler threads.

Measured on the 2-core CPU machines: the same decode step at batch 1 takes ~1.7x as long when torch is called
from a second thread rather than from the thread that loaded the model (its OpenMP workers belong to that one).
"""
import functools
import queue
import threading
from concurrent.futures import Future


class MainThread:
    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()

    def call(self, fn, *args):
        """Runs fn(*args) on the main thread and returns (or raises) what it did."""
        done: Future = Future()
        self._jobs.put((fn, args, done))
        return done.result()

    def run(self, stop: threading.Event) -> None:
        """The main thread's loop, until `stop` is set."""
        while not stop.is_set():
            try:
                fn, args, done = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # context.abort's exception included: re-raised in the handler's thread
                done.set_exception(e)


def on_main_thread(method):
    """A servicer method that runs on its service's MainThread when it has one."""
    @functools.wraps(method)
    def handler(self, request, context):
        if self.main is None:
            return method(self, request, context)
        return self.main.call(method, self, request, context)
    return handler
