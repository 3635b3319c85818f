"""The gateway: the OpenAI REST API (Chat Completions, Completions, Responses, Messages) and gRPC `Generate`,
structured output by token masks, in front of the tokenizer service and the model workers.

Rooms, from the top down (an import points only down this list; `tests/test_layers.py` holds it):

  main.py       the process: flags, TLS, the HTTP and gRPC servers.
  api/          the front doors: the FastAPI app and its guard (`app`, `http_guard`, `auth`, `openapi`), gRPC
                `Generate` (`grpc_service`), the Responses API (`responses/`) and the Messages API (`messages/`).
                Each door parses its request, asks the planning room for a plan and renders the answer's shape.
  planning/     one request into a plan: the request's context (`context`), the answer budget decided once
                (`answer_limit`), the chat template's inputs, the resolved tool mode, the final stop ids and the
                constraint (`planner`, `chat_plan`); its `__init__` is the planning types' glossary.
  generation/   running a plan: one generation as a stream of deltas (`generate`), the choices of a request
                (`choices`, `choice_runner`), the chat output's split into reasoning, text and tool calls
                (`chat_output`, `reasoning`, `tool_parsers`), detokenization, log-probabilities and answer blocks.
  backends/     the services behind the gateway, one owner (`clients.Backends`) of parts: the tokenizer service's
                connection (`tokenizer_client`), the worker pool and the choice of a worker (`workers`,
                `worker_choice`), the model facts (`model_facts`), the grammar tokenizer built from them
                (`grammar_tokenizer`), admission, answer history, metrics; the narrow views a function receives
                (`views`).
  structured/   structured output: JSON schemas and tools into llguidance grammars, the token-mask constraint and
                its budget, the grammar cache (`tools/`: tool-call schemas and arguments).
  core/         the gateway's vocabulary, imported by every room: OpenAI request types, errors, limits, the model
                family's output-format interface (`tool_format`) and a bounded LRU cache.

Words that mean one thing each:

  route         choose the worker that serves a request (`Backends.route`, `WorkerPool.route`,
                `worker_choice.Router`); nothing else. (Starlette's matched route object, the 404's "no route"
                and the requests metric's "route template" keep FastAPI's word for an endpoint.)
  endpoint      an HTTP method and path the app answers (`/v1/chat/completions`).
  splitter      what turns one choice's tokens into `content`, `reasoning_content` and `tool_calls`
                (`chat_output.ChatSplitter`, made by `ChatPlan.splitter`; `reasoning.ReasoningSplitter` for the
                thought channel).
  job           one choice's planned work (`planner.Job`), built with its `GenParams` by `planner._build_jobs`.
"""
