"""Tensor parallelism's low level: the process group state and the collective ops the model layers call.

A leaf package (torch only): models and layers read the rank and size at construction, the graphs register
the all-reduce as a split op; the engine starts the worker processes (engine/tp_workers.py).
"""
