"""Quantized checkpoint formats, and the checkpoint layer beneath every model.

sources.py (tensor sources, CheckpointError), weights.py (Weights, the WeightsLoader
contract, unquantized weights), checkpoint.py (config and tokenizer files), dist.py
(process groups), config.py (one config type per method), one module per format
(config, loader, typed Weight), factory.py (checkpoint and flag -> config -> loader),
and the quantize algorithms (gptq_solver.py, rtn.py). This file imports nothing: importing
any module here runs it first.
"""
