"""The per-step weight sync: re-quantize every trained weight into its rollout copy, in place.

Each trained `QuantLinear` re-quantizes its master weight into the buffers the rollout engine reads. The work is a
few small kernels per linear; launched one by one from Python, the launches cost more than the kernels (a 135M
model has 210 linears). On a GPU `RolloutSync` therefore captures the whole re-quantization into one CUDA graph
and replays it each step. The graph reads the weights and writes the rollout copies at fixed addresses, so it is
captured again whenever one of them moves (a reconfiguration, a loaded checkpoint assigned new tensors). The first
sync after such a change runs eagerly (it compiles kernels and runs their self-checks outside any capture) and
the next one captures. Where capture fails (a quantizer with a host synchronisation) the sync stays eager and the
fallback is reported once (`quarl.fallbacks`).
"""

from __future__ import annotations

import torch
from torch import nn

from quarl.fallbacks import report_fallback
from quarl.model.qlinear import ROLLOUT_BUFFERS, QuantLinear


class RolloutSync:
    """Callable: `sync()` brings every rollout copy of `model` up to date with its master weight (the model's
    QuantLinears as of the first call: build or load every module before syncing).

    Weights being trained are re-quantized every call (through the CUDA graph on a GPU when `use_cuda_graph`);
    the others (a frozen LoRA base) only when they changed since their last quantization.
    """

    def __init__(self, model: nn.Module, use_cuda_graph: bool = True):
        self.model = model
        self.use_cuda_graph = use_cuda_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self._graph_key: tuple | None = None  # the buffers the captured graph reads and writes
        self._last_key: tuple | None = None  # the buffers of the previous call (capture once they are stable)
        self.captures = 0
        # The model's QuantLinears, found once: quarl configures its linears in place and never swaps modules, and
        # walking the module tree each step costs host time comparable to the sync itself on a small model.
        self._linears: list[QuantLinear] | None = None

    def __call__(self) -> None:
        if self._linears is None:
            self._linears = [m for m in self.model.modules() if isinstance(m, QuantLinear)]
        trained = []
        for m in self._linears:
            if m.trained_rollout_copy:
                trained.append(m)
            else:
                m.refresh(only_if_changed=True)  # frozen: re-quantized only if changed, else a no-op
        if not trained:
            return
        if self._replay(trained):
            for m in trained:
                m.mark_rollout_copy_current()
            return
        for m in trained:
            m.refresh()

    def _replay(self, trained: list[QuantLinear]) -> bool:
        """Run the re-quantization of `trained` as a CUDA graph (capturing it if needed); False = run eagerly."""
        if not self.use_cuda_graph or trained[0].weight.device.type != "cuda":
            return False
        key = _buffers_key(trained)
        if key != self._graph_key:
            self.graph = self._graph_key = None
            if key != self._last_key:  # new buffers: this call warms up eagerly, the next one captures
                self._last_key = key
                return False
            try:
                self.graph = _capture(trained)
            except Exception as e:  # the eager sync is correct, only slower
                reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                report_fallback("sync_graph", f"capturing the weight sync failed ({reason}); syncing eagerly")
                self.use_cuda_graph = False
                torch.cuda.synchronize()
                return False
            self._graph_key = key
            self.captures += 1
        self.graph.replay()
        return True


def _buffers_key(trained: list[QuantLinear]) -> tuple:
    """Addresses (and shapes, dtypes) of what the sync reads and writes: each weight and its rollout copy's
    buffers."""
    # read from the module's own dicts, not as attributes: nn.Module's attribute lookup, for five tensors of
    # every linear on every sync, would cost more host time than the sync's graph replay on a small model
    key = []
    for m in trained:
        buffers = m._buffers
        for t in (m._parameters["weight"], *(buffers[name] for name in ROLLOUT_BUFFERS)):
            key.append(None if t is None else (t.data_ptr(), t.shape, t.dtype))
    return tuple(key)


def _capture(trained: list[QuantLinear]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of every `requantize_rollout_copy` of `trained`. Capturing records the kernels without
    running them: the caller replays the graph to sync."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for m in trained:
            m.requantize_rollout_copy()
    return graph
