"""From a request's fields to the engine's plan, whichever API the request came through.

Each API has one adapter that reads its wire type into `PlanFields`
(`switchyard.planning.fields`): TGI's in `switchyard.planning.tgi`, chat and
completions in `switchyard.openai_mapping.plans`, Responses in
`switchyard.responses.prompt`. The adapters check ranges through one table
(`switchyard.planning.rules`), worded in each API's own field names and
style, and `switchyard.planning.plan.build_plan` turns the checked fields and
the prompt's token ids into a `GenerationPlan`.
"""
