"""Running a plan: one generation as an async stream of deltas (`generate`: Prefill -> Decode -> detokenize -> stop
strings), a request's choices (`choices`, `choice_runner`), the chat output split into reasoning, text and tool
calls (`chat_output`, `reasoning`, `tool_parsers`), log-probabilities and answer blocks. Imports structured,
backends and core; never planning or api."""
