"""Talking to inference engines: which prompts still need an answer, the request cache,
the client and what a reply must be, fitting max_tokens into the context, the server of
a run (URLs or a launched engine), its probes, watchdogs and logs."""
