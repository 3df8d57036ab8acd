"""Hugging Face format checkpoints: config, orchestr's own decoder modules, loading with
``safetensors``, the tokenizer and chat template, and tiny checkpoints made locally."""
