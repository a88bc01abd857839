"""Token mixers and building blocks shared by the architectures (attention layers, norms, RoPE, MLP)."""
