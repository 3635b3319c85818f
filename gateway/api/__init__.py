"""The front doors (the top room): the FastAPI app with the OpenAI endpoints (`app`), its request guard and API keys
(`http_guard`, `auth`), the OpenAPI document, the HTTP server protocol, gRPC `Generate` (`grpc_service`), and the
Responses (`responses/`) and Messages (`messages/`) APIs. A door parses, plans (planning room), runs (generation
room) and renders its own answer shape; it may import every room below."""
