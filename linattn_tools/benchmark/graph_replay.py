"""A step's time with the host out of the way: the step captured whole in one CUDA graph and replayed.

The eager step's time is at least the host's time to issue its launches (``targets.issue_seconds``); a graph's
replay issues them all in one call, so the eager time over the replay's says what capturing the step (an opt-in
CUDA-graph path, fairseq's trainer captured whole) would gain at that shape. A step that cannot be captured (a host
sync, a CPU copy, an op CUDA graphs refuse) says why instead: that too is what a GPU must show.
"""
import statistics
from typing import Callable, Optional, Tuple

import torch

from .measure import elapsed_seconds

WARMUP = 3  # eager steps on a side stream before the capture, as torch.cuda.graphs' documentation asks


def replay_seconds(run: Callable[[], object], device: torch.device, repeats: int
                   ) -> Tuple[Optional[float], Optional[str]]:
    """(median seconds of ``repeats`` replays of ``run()`` captured in one CUDA graph, None), or (None, why not):
    not a CUDA device, or the capture's error. ``run`` must read and write the same tensors at every call (its
    inputs kept, its outputs and gradients overwritten); the graph and its memory pool are freed before returning."""
    if device.type != "cuda":
        return None, f"CUDA graphs need a CUDA device; this step ran on {device.type}"
    graph = None
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return statistics.median(elapsed_seconds(graph.replay, device) for _ in range(repeats)), None
    except Exception as exc:  # the capture's refusal is the measurement here
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    finally:
        del graph
        torch.cuda.empty_cache()
