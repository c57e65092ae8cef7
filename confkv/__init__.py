"""confkv: an LLM inference engine whose KV cache is sized by the model's own confidence (CONF-KV)."""

from confkv.config import CachePolicy, EngineConfig, load_policy_file
from confkv.engine.engine import LLMEngine
from confkv.engine.params import SamplingParams
from confkv.engine.sequence import RequestOutput
from confkv.errors import ConfkvError
from confkv.llm import LLM

__all__ = [
    "LLM",
    "CachePolicy",
    "ConfkvError",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "load_policy_file",
]
__version__ = "0.1.0"
