"""Placeholder: this format's configs and loader are being written."""

CONFIGS: dict = {}
LOADERS: dict = {}
