"""Generation helpers: the static-buffer / CUDA-graph decode step generate() uses on CUDA (graph_decode.py)."""
from .graph_decode import DecodeGraphMixin, DecodeGraphSession, StaticDecodeStep, resolve_decode_mode

__all__ = ["DecodeGraphMixin", "DecodeGraphSession", "StaticDecodeStep", "resolve_decode_mode"]
