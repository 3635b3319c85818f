"""One request into a plan (`Ask` -> `Plan` / `ChatPlan` -> `Job`s with `GenParams`): the answer budget decided
once (`answer_limit.answer_budget`), the chat template inputs, the resolved tool mode, stop ids and constraint
(`chat_plan`). Imports generation, structured, backends and core; never `api`."""
