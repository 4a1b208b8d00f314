"""The networks: the native model (model.py) and its native-kernel layers, transformers' models behind the same
forward (hf_model.py), CUDA graphs applied from outside (cuda_graphs.py), and the caches a forward reads."""
