"""kvmesh: an LLM serving mesh. ``from kvmesh import LLM, SamplingParams``."""

from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineError", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name):   # keep `import kvmesh` light: torch/transformers load on first use
    if name in ("LLM", "AsyncLLM"):
        from kvmesh import llm
        return getattr(llm, name)
    if name == "EngineConfig":
        from kvmesh.core.engine_config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
