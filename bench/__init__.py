"""capplan benchmarks against vLLM's own planning code, measured in one run."""
