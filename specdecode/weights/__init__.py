"""Weights from files to a loaded model: hub ids, folders and GGUF files (files.py), packaged models (hub.py),
GGUF blocks as stored (gguf_stored.py, blocks.py), re-quantizing (quantize.py), vocabulary subsets, and the
loading of a target and its drafter (loading.py)."""
