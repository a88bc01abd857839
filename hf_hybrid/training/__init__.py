"""Training-step helpers: the decoder layers' forward and backward replayed as CUDA graphs (layer_graphs.py)."""
from .layer_graphs import graph_training_layers, layer_graph_report, ungraph_training_layers

__all__ = ["graph_training_layers", "layer_graph_report", "ungraph_training_layers"]
