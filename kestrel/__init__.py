"""Kestrel: an LLM inference and serving engine.

    from kestrel import LLM, SamplingParams
    LLM().generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
"""

from kestrel.engine.arg_utils import EngineArgs
from kestrel.entrypoints.llm import LLM
from kestrel.outputs import CompletionOutput, Logprob, RequestOutput
from kestrel.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
