"""Text around the token ids: streamed text and stop strings (stream.py), mapping between two tokenizers
(token_bridge.py), tool calls in answers (tool_calls.py)."""
