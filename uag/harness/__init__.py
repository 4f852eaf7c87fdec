"""harness floor."""
