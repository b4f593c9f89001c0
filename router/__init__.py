"""The public front door: validation, tokenization, routing to decode workers, streaming back."""
