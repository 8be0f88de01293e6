"""Distributed pretraining of small Transformer language models."""
