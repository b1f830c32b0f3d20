"""Placeholder: filled in by the work in progress on this kernel family."""
