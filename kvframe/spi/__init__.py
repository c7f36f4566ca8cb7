"""kvframe.spi."""
