"""A compiled library whose kernel calls are recorded, for tests that check a host's launches (which kernels, grid,
threadgroup size)."""

from __future__ import annotations

__all__ = ["LoggedLibrary"]


class LoggedLibrary:
    """Wraps a library from ``compile_shader``: every kernel call appends ``(name, threads, group_size)`` to ``log``
    and then runs; the kernels' pipeline limits stay readable."""

    def __init__(self, library, log: list):
        self._library, self._log = library, log

    def __getattr__(self, name: str):
        fn, log = getattr(self._library, name), self._log

        class Kernel:
            max_threads_per_threadgroup = fn.max_threads_per_threadgroup
            thread_execution_width = fn.thread_execution_width
            static_thread_group_memory_length = fn.static_thread_group_memory_length

            def __call__(self, *args, **kwargs):
                log.append((name, kwargs.get("threads"), kwargs.get("group_size")))
                return fn(*args, **kwargs)

        return Kernel()
