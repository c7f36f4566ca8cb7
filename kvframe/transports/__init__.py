"""kvframe.transports."""
