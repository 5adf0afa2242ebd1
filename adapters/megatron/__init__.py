"""Megatron-Core and Megatron-Bridge trainers (issues "Megatron-Core trainers…" and "Megatron-Bridge…").

Nothing here imports megatron at package import time; ``compat`` holds the
Python 3.11 and CPU shims the stack needs on machines without a GPU.
"""
