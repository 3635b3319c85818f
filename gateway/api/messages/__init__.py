"""The Anthropic Messages API (`/v1/messages`): request parsing (`messages_request`, which reuses the Responses
parser for tools) and the answer as content blocks (`messages_api`). May import `api.responses` and every room
below `api/`."""
