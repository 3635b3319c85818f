"""The gateway's vocabulary, imported by every room and importing none: OpenAI request types (`openai_types`),
errors with their HTTP and gRPC statuses (`errors`), request limits (`limits`), the model family's output-format
interface (`tool_format`) and a bounded LRU cache (`lru`)."""
