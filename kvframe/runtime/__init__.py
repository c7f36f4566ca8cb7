"""The runtime shell: what the sans-I/O core and the contracts leave to the outside world.

- :mod:`kvframe.runtime.plugins` — the plugin host (one per runtime; no global state).
- :mod:`kvframe.runtime.plugin_report` — the ``kvframe plugins`` report.
- :mod:`kvframe.runtime.docgen` — generated reference sections of the documentation.

Import the submodules directly; this package re-exports nothing, so importing it stays cheap.
"""

__all__: list[str] = []
