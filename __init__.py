"""servetwin: a vLLM-v1-identical scheduler shared by a SimPy simulator and a real torch backend.

The repository's folders are this package's subpackages: `servetwin.core` (scheduler, KV cache, engine,
entry points, testbed drivers), `servetwin.sim`, `servetwin.gpu`, `servetwin.experiments`.
"""
from servetwin.core.request import FinishReason, Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "Request", "RequestStatus", "FinishReason"]


def __getattr__(name: str):
    # LLM pulls in the engine clients (zmq, msgspec): loaded on first use so `import servetwin.sim` stays light.
    if name == "LLM":
        from servetwin.core.engine.llm import LLM  # noqa: PLC0415
        return LLM
    raise AttributeError(f"module 'servetwin' has no attribute {name!r}")
