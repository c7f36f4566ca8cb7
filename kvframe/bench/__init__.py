"""kvframe.bench."""
