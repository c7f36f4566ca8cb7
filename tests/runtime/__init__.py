"""Tests of the runtime shell: the plugin host and ``kvframe plugins``."""
