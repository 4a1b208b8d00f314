"""specdecode: lossless speculative decoding for self-hosted LLMs."""

from specdecode.api import Generation, SpecDecoder, TextChunk
from specdecode.config import SamplingParams
from specdecode.errors import SpecdecodeError

__all__ = ["Generation", "SamplingParams", "SpecDecoder", "SpecdecodeError", "TextChunk"]
__version__ = "0.1.0"
