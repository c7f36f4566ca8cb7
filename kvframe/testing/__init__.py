"""kvframe.testing."""
