"""kvframe.protocol."""
