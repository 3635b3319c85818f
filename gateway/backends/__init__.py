"""The services behind the gateway: gRPC clients of the tokenizer service and the workers and the model facts
fetched from them (`clients`), the worker pool (`workers`) and which worker serves a request (`worker_choice`),
admission control, the answer history and the metrics.
Also holds the grammar tokenizer built from the facts (`structured.constraints.build_tokenizer`). Imports
structured and core."""
