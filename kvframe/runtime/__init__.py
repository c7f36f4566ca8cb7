"""kvframe.runtime."""
