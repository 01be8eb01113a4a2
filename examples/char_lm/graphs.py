"""The training step captured once in a CUDA graph and replayed (``--graphs``; docs/training.md, "Graph capture").

torch's recipe for whole-step capture (``torch.cuda.graph``): a few eager warm-up steps on a side stream (lazy
initialisation, optimizer state, cuBLAS workspaces and the tuning of ``backward="auto"`` happen there, outside the
capture), then one capture on that stream, then a replay per step, with the batch copied into static input tensors
first. The optimizer must be capturable (``capturable=True``, its learning rate a device tensor the host refills
before each replay), and autocast's weight cache off inside the capture (torch's rule for autocast under graphs).

What a replay does not run: Python. Host bookkeeping (the step count, the metric count) stays with the caller, and
steps that need Python during their backward (RigL's gradient hooks before a topology update) or around each phase
(the sampled, timed steps) run eagerly, which interleaves with replays: both update the same parameters and
optimizer state in place. A topology update that keeps the edge count is written into the captured tensors
(``DynamicSparsity(in_place=True)``); one that changes it calls :meth:`GraphedStep.invalidate`, and the next
graphed step captures again after an eager step at the new sizes.

Example (CUDA only; elsewhere the object is built but refuses to capture)::

    >>> step = GraphedStep(lambda x, y: None, torch.device("cpu"))
    >>> step.ready, step.captures
    (False, 0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

__all__ = ["GraphedStep", "WARMUP_STEPS"]

#: Eager steps before the first capture, as torch's whole-network example runs (a few, on the capture's stream).
WARMUP_STEPS = 3


class GraphedStep:
    """``body(x, y)`` (forward, backward, clipping, optimizer update, metric accumulation on the device) captured
    from static copies of ``x`` and ``y`` and replayed by :meth:`replay`. ``prepare`` runs before each capture
    (``optimizer.zero_grad(set_to_none=True)``, so that the captured backward allocates the gradients it writes).

    :meth:`eager` runs any eager step on the capture's stream, counting towards the warm-up; :attr:`ready` says
    whether enough have run for the next graphed step to capture (or replay).
    """

    def __init__(self, body: Callable[[torch.Tensor, torch.Tensor], None], device: torch.device, *,
                 prepare: Callable[[], None] | None = None, warmup_steps: int = WARMUP_STEPS) -> None:
        self._body, self._prepare = body, prepare
        self.device = device
        self.warmup_steps = warmup_steps
        self._eager_left = warmup_steps
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.captures = 0
        self.replays = 0

    @property
    def ready(self) -> bool:
        """Whether the next graphed step may capture or replay (the warm-up is done)."""
        return self._eager_left == 0

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """A block of eager step work on the capture's side stream, ordered after and before the current stream's
        work (torch's warm-up pattern); it counts as one warm-up step."""
        if self._stream is None:  # no CUDA: nothing to order (tests drive the loop's bookkeeping this way)
            yield
        else:
            current = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                yield
            current.wait_stream(self._stream)
        self._eager_left = max(self._eager_left - 1, 0)

    def invalidate(self) -> None:
        """The tensors the graph holds were replaced (a change of edge count): drop the graph; the next graphed step
        captures again, after one eager step at the new sizes."""
        self._graph = self._inputs = None
        self._eager_left = max(self._eager_left, 1)

    def replay(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One step on the batch ``(x, y)``: copied into the static inputs, then the graph replayed (captured first
        when there is none). The replay is queued on the current stream; nothing waits for the device."""
        if not self.ready:
            raise RuntimeError(f"GraphedStep.replay before the warm-up: {self._eager_left} more eager step(s) first")
        if self._graph is None:
            self._capture(x, y)
        self._inputs[0].copy_(x)
        self._inputs[1].copy_(y)
        self._graph.replay()
        self.replays += 1

    def _capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Record ``body`` on the static inputs. Capturing runs no kernel: the step itself is the first replay."""
        inputs = (torch.empty_like(x), torch.empty_like(y))
        if self._prepare is not None:
            self._prepare()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.graph(graph, stream=self._stream):
            self._body(*inputs)
        current.wait_stream(self._stream)
        self._graph, self._inputs = graph, inputs
        self.captures += 1
