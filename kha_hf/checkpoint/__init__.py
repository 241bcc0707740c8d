"""Checkpoint folders: read (config, safetensors headers, KHA knocks), checked once, loaded, written atomically."""
