"""hf-hybrid: efficient-attention architectures as first-class Hugging Face Transformers models."""
__version__ = "0.1.0"
