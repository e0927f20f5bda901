"""Parameters in and out of a layout: Hugging Face checkpoints (hf) and jaxrl's own (params)."""
