"""The sans-I/O core: pure state machines that take ``now`` and return what must happen.

Imports only the standard library and attrs. Never reads a clock, sleeps, starts a thread, opens
a socket or logs.
"""
