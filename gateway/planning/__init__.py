"""One request into a plan. Imports generation, structured, backends and core; never `api`.

The planning types, one line each, in the order a request meets them:

  RequestContext  context.py       what the door knows besides the body: the backends' request view (one
                                   `ModelFacts` snapshot), the limits, the tenant, the session, a gRPC request id.
  AnswerLimit     answer_limit.py  the answer limit asked for and the field that set it; `answer_budget` decides
                                   each choice's int from it, once.
  Ask             planner.py       what a request asks beyond its prompts, every default and limit resolved once.
  ChatPlan        chat_plan.py     how to generate the answer and split it: grammar, tool mode and format, thinking,
                                   the final stop ids.
  Plan            planner.py       the planned request: prompts, one `Job` per choice, output splitters, the
                                   answer-history scope.
  Job             planner.py       one choice: its index, prompt ids, `GenParams` and worker request id.
  GenParams       generation/generate.py  what the worker is asked for one choice, complete when built.
"""
