"""The engine: requests (sequence.py) advanced one target forward at a time (engine.py), and their statistics."""
