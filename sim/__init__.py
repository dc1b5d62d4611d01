"""kvsim: a discrete-event simulator of LLM-serving KV-cache memory management."""

__version__ = "0.1.0"
