"""The shared runtime: model, paged KV scheduling, sampling and the offline ``LLM`` API."""

from engine.config import EngineConfig
from engine.config_file import load_config
from engine.continuation import Continuation
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "Continuation", "EngineConfig", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams",
           "load_config"]  # fmt: skip
