"""capplan: reviewable CUDA-graph capture plans for vLLM's Model Runner V2."""

__version__ = "0.4.0"
