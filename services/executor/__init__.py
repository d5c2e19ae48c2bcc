"""Executor stage: model weights, KV pool, forward passes, sampling."""
