"""Structured output: JSON schemas and tools into llguidance grammars (`json_schema`, `schema_check`, `patterns`),
the per-request token-mask constraint (`constraints`) and its budget (`budget`), the compiled-grammar cache
(`grammar_cache`); `tools/` holds tool-call schemas and argument checks. Imports core only (and `backends`
never)."""
