"""decoding floor."""
