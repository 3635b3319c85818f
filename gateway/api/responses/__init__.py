"""The Responses API (`/v1/responses`): request parsing into a chat plan (`responses_request`), the answer as
output items (`responses_api`) and the stored responses that `previous_response_id` continues (`response_store`).
May import every room below `api/`."""
