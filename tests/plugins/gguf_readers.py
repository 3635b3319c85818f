"""pytest plugin: one `gguf.GGUFReader` per file for the whole test session.

gguf-py parses a GGUF's metadata in Python (slow for the 262,144-token vocabulary of the embedded model: figures in
docs/performance.md, "Test suite"), and the references read it again and again: transformers twice per model load
(config, then weights), its tokenizer, our converter and the tokenizer tests. A reader is read-only over a memory
map, so every read-only reader of the same file can be the same object; this plugin makes `GGUFReader(path)` return
it (readers opened for writing are untouched). Registered by tests/conftest.py (`pytest_plugins`); it changes nothing outside the test process.
"""

from __future__ import annotations

import os


def pytest_configure(config):
    """Patch `gguf.GGUFReader` (once per process) so that read-only readers of one file are one object."""
    import gguf

    reader_class = gguf.GGUFReader
    if getattr(reader_class, "_shared_per_file", False):
        return
    readers: dict[str, object] = {}
    init = reader_class.__init__

    def new(cls, path, mode="r"):
        key = os.path.realpath(path)
        if mode != "r":
            return object.__new__(cls)
        if key not in readers:
            readers[key] = object.__new__(cls)
        return readers[key]

    def shared_init(self, path, mode="r"):
        if not getattr(self, "_initialized", False):
            init(self, path, mode)
            self._initialized = True

    reader_class.__new__ = new
    reader_class.__init__ = shared_init
    reader_class._shared_per_file = True
