"""The services behind the gateway, with one owner for the gateway's life (`clients.Backends`) made of parts: the
tokenizer service's connection (`tokenizer_client`), the worker pool (`workers`) and which worker serves a request
(`worker_choice`), the model facts fetched from both (`model_facts`), the grammar tokenizer built from them
(`grammar_tokenizer`, with structured's `build_tokenizer`), admission control, the answer history and the metrics.
`views` names what each room and front door uses of them. Imports structured and core."""
