"""Tool calls: the OpenAI `tools` / `tool_choice` fields into argument schemas and checks (`tool_schema`), and the
parsed tool calls' record and validation (`tool_calls`). Imports `structured` and core."""
