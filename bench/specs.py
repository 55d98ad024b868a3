"""The three specs the benchmark runs: small, typical, extreme."""

SMALL = {
    "target": {"vllm": "0.33"},
    "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_model_len": 512},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE"},
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
}
TYPICAL = {
    "target": {"vllm": "0.33"},
    "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 32768},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE"},
    "lora": {"enabled": True, "max_loras": 8, "specialize_active": True},
}
EXTREME = {
    "target": {"vllm": "0.33"},
    "scheduler": {"max_num_seqs": 1024, "max_num_batched_tokens": 16384, "max_model_len": 32768},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE", "max_capture_size": 1024},
    "lora": {"enabled": True, "max_loras": 32, "specialize_active": True},
    "speculative": {"num_speculative_tokens": 3},
    "parallel": {"data_parallel_size": 8, "moe": True},
}
SPECS = {"small": SMALL, "typical": TYPICAL, "extreme": EXTREME}
